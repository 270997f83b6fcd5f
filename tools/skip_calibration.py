"""Calibrates the Semantic SKIP judgement of one encoder on constructed
LoCoMo cases, and stores its thresholds in the calibration table.

  python -m tools.skip_calibration --config=configs/reward_study.py \
      --output=results/semantic_skip_calibration/coverage_minilm [--choose=0:5 --check=5:7]
  python -m tools.skip_calibration --config=configs/qwen3_4b.py \
      --config.encoder.path=/ckpt/Qwen3-Embedding-0.6B \
      --locomo=../shared/data/locomo/locomo10.json \
      --output=/data/skip_calibration --table=/data/skip_calibration.json

A semantic SKIP is justified when what the user states in the session is
already covered by the semantic store (App. B: "already fully captured"),
or the user states nothing. The reward (`RewardComputer`) judges it by
coverage: each user statement's nearest semantic entry, by cosine; the
share of statements whose cosine is at least `semantic_skip_cosine`; the
SKIP is justified at a share of at least `semantic_skip_coverage`. Both
thresholds are the encoder's own (an encoder decides what a cosine
means): this tool chooses them for the `encoder` section of `--config`
(any config: a training config's own section is the one its run uses)
and writes them to `--table` under that encoder's identity
(`task.skip_table`; default: the packaged table). A training run whose
encoder has no entry refuses to start.

For every session t with user statements of the chosen conversations,
the store before it is the annotation builder's `M_{t-1}` (LoCoMo's
observations of sessions < t), and one SKIP is scored on five stores:

  not_stored   M_{t-1}: the session's statements are not stored
               (skipping is wrong);
  partial      M_{t-1} plus every other one of LoCoMo's observations of
               session t about the user (speaker_a): half the session's
               facts are stored (skipping is wrong);
  unrelated    M_{t-1} plus as many observations about the user of
               another conversation: the store grows by facts of someone
               else (skipping is wrong);
  paraphrased  M_{t-1} plus all of LoCoMo's observations of session t about
               the user: the session's facts in the annotators' words,
               built without an LLM (skipping is right);
  verbatim     M_{t-1} plus every user statement of session t: right by
               construction (cosine 1), reported, never chosen on.

The statement cosine is the one whose coverage separates `paraphrased`
from the three negative classes best (AUC over a grid of cosines), the
coverage threshold the one maximising Youden's J (justified rate of
`paraphrased` minus that of the negatives pooled; the largest on a tie:
the bonus is paid as rarely as the best separation allows), both on the
`--choose` conversations; the `--check` conversations report the rates and
AUCs at those thresholds, never used to choose them. Beside them, the
previous rule (ρ, the largest clamped CMI of a statement against the
store, justified below 0.232) on the same cases. Only LoCoMo training
conversations belong here (the small reproduction trains on 0-6,
validates on 7 and evaluates on 8-9): a range reaching 7 is refused.

Writes `OUTPUT/calibration.json` (every case's statement cosines and ρ)
and `OUTPUT/calibration.md` (the tables), prints the tables and, last, a
JSON line of the chosen thresholds. Exits non-zero when a class is empty.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from absl import flags, logging

from cmimem_jax.cmi.banked import banked_rho
from cmimem_jax.config import (define_command_line_flags, run_command,
                               validate_config)
from cmimem_jax.data import Dialogue, load_dataset
from cmimem_jax.data.files import write_atomic, write_json
from cmimem_jax.data.fragments import user_statements
from cmimem_jax.encoders import EncoderConfig, encoder_identity, make_encoder
from cmimem_jax.evaluation.compare import auc
from cmimem_jax.memory import MemoryBank, parse
from cmimem_jax.memory.apply import apply_operations
from cmimem_jax.memory.builder import MemoryConfig, build_bank
from cmimem_jax.memory.types import Action, MemoryType, Operation
from cmimem_jax.task.build_memory import annotation_responder
from cmimem_jax.task.reward import (RewardComputer, RewardConfig,
                                    RolloutInput, skip_coverage)
from cmimem_jax.task.skip_table import table_path, write_entry

CLASSES = ("not_stored", "partial", "unrelated", "paraphrased", "verbatim")
NEGATIVE = ("not_stored", "partial", "unrelated")
# Core has no SKIP (Table 10); the core line is outside the semantic store
# the judgement reads.
SKIP = "CORE:APPEND|Talked.\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP"
# The first conversation the calibration may not read (validation: 7,
# evaluation: 8-9 in configs/small_repro.py).
FIRST_HELD_OUT = 7
# The statement cosines the coverage rule is tried at.
COSINE_GRID = tuple(np.round(np.arange(0.05, 1.0, 0.05), 2).tolist())
# The previous rule, reported beside: justified below this ρ.
PREVIOUS_RHO_THRESHOLD = 0.232

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
define_command_line_flags(workdir=False, flag_values=FLAGS)
flags.DEFINE_string("output", None, "Directory for calibration.json/md.",
                    flag_values=FLAGS)
flags.DEFINE_string("choose", "0:5", "Conversations the thresholds are "
                    "chosen on (START:STOP).", flag_values=FLAGS)
flags.DEFINE_string("check", "5:7", "Conversations they are checked on.",
                    flag_values=FLAGS)
flags.DEFINE_string("locomo", "", "The LoCoMo file (default: the config's "
                    "dataset.path when its dataset is LoCoMo).",
                    flag_values=FLAGS)
flags.DEFINE_string("table", "", "The calibration table the encoder's "
                    "entry is written to (default: the packaged one, "
                    "cmimem_jax/task/skip_calibration.json).",
                    flag_values=FLAGS)


def user_observations(dialogue: Dialogue, session) -> list[str]:
  """LoCoMo's observations of `session` about speaker_a (the user)."""
  number = session.session_id.rsplit("_", 1)[-1]
  observations = dialogue.metadata.get("observation", {}).get(
      f"session_{number}_observation", {})
  speaker = dialogue.metadata.get("speaker_a")
  return [item[0] for item in observations.get(speaker, [])]


def with_semantic(bank: MemoryBank, texts: list[str], encoder,
                  session_index: int) -> MemoryBank:
  """A copy of `bank` with `texts` added to the semantic store."""
  ops = [Operation(MemoryType.SEMANTIC, Action.ADD, (text,)) for text in texts]
  return apply_operations(bank, ops, encoder, session_index=session_index)[0]


def cases(dialogue: Dialogue, other: Dialogue, encoder, memory: MemoryConfig
          ) -> list[tuple[str, int, RolloutInput]]:
  """(class, session index, SKIP rollout) of every session of `dialogue`
  in which the user states something and LoCoMo observes the user; the
  `unrelated` facts are `other`'s observations of its own user."""
  _, _, steps = build_bank(dialogue, encoder, annotation_responder(dialogue),
                           memory)
  foreign = [text for session in other.sessions
             for text in user_observations(other, session)]
  skip = parse(SKIP)
  out = []
  for t, step in enumerate(steps):
    session = step.session
    turns = session.user_turns()
    statements = user_statements(turns)
    observed = user_observations(dialogue, session)
    if not statements or not observed:
      continue  # Nothing stated (always justified), or nothing paraphrased.
    start = (t * len(observed)) % max(len(foreign), 1)
    added = {"not_stored": [], "partial": observed[::2],
             "unrelated": (foreign + foreign)[start:start + len(observed)],
             "paraphrased": observed, "verbatim": statements}
    if len(observed) < 2:  # Half of one fact is all of it.
      del added["partial"]
    for label, texts in added.items():
      bank = with_semantic(step.bank_before, texts, encoder, t)
      out.append((label, t, RolloutInput(bank, session.format(), skip,
                                         user_turns=turns)))
  return out


def statement_rhos(rollouts: list[RolloutInput], encoder,
                   reward: RewardConfig) -> list[np.ndarray]:
  """The previous rule's score per statement: the clamped CMI
  ρ(C; u | M_sem) `[U]` of each user statement against the semantic store
  (top-k by the App. F query, no recency term, cosine fallback below
  `min_memories`), one batched kernel call."""
  statements = [r.statements() for r in rollouts]
  texts = sorted({r.context for r in rollouts}
                 | {u for s in statements for u in s})
  embeddings = dict(zip(texts, encoder.encode(texts)))
  stores = [r.bank.stores[MemoryType.SEMANTIC] for r in rollouts]
  rows, dim = len(rollouts), encoder.dim
  m = max(1, max(len(s) for s in stores))
  o = max(1, max(len(s) for s in statements))
  vectors = np.zeros((rows, m, dim), np.float32)
  valid = np.zeros((rows, m), bool)
  ctx = np.zeros((rows, dim), np.float32)
  new = np.zeros((rows, o, dim), np.float32)
  for row, (rollout, store, said) in enumerate(zip(rollouts, stores,
                                                   statements)):
    vectors[row, :len(store)] = store.vectors
    valid[row, :len(store)] = True
    ctx[row] = embeddings[rollout.context]
    new[row, :len(said)] = [embeddings[u] for u in said]
  rho, _, _, _ = banked_rho(
      vectors, valid, -np.ones((rows, 1), np.int64), ctx, new, new,
      np.zeros((rows, o), bool), lam=reward.lam,
      config=dataclasses.replace(reward.conditioning, n_recent=0),
      min_memories=reward.min_memories)
  rho = np.clip(np.asarray(rho), 0.0, 1.0)
  return [rho[row, :len(said)] for row, said in enumerate(statements)]


def choose_threshold(scores: np.ndarray, positive: np.ndarray) -> float:
  """The justified-below threshold maximising Youden's J (smallest on a
  tie), a midpoint between adjacent observed scores."""
  values = np.unique(scores)
  candidates = np.concatenate([[values[0] - 1e-6],
                               (values[:-1] + values[1:]) / 2,
                               [values[-1] + 1e-6]])
  below = scores[None, :] < candidates[:, None]
  youden = below[:, positive].mean(1) - below[:, ~positive].mean(1)
  # Rates are fractions of different counts: equal J may differ in the
  # last bit.
  best = np.flatnonzero(youden >= youden.max() - 1e-12)[0]
  return float(candidates[best])


def coverages(records: list[dict], cosine: float) -> np.ndarray:
  """Each record's coverage at statement cosine `cosine`."""
  return np.asarray([skip_coverage(np.asarray(r["statement_cosines"]),
                                   cosine) for r in records])


def separation(records: list[dict], scores: np.ndarray, positive: str,
               negatives: tuple[str, ...]) -> float:
  """AUC of `scores` (higher: stored) separating class `positive` from
  the classes `negatives` pooled."""
  keep = [i for i, r in enumerate(records)
          if r["class"] in (positive,) + negatives]
  return auc(scores[keep], np.asarray([records[i]["class"] == positive
                                       for i in keep]))


def choose_rule(records: list[dict]) -> tuple[float, float]:
  """(statement cosine, coverage threshold) chosen on `records` (module
  docstring)."""
  by_cosine = [separation(records, coverages(records, c), "paraphrased",
                          NEGATIVE) for c in COSINE_GRID]
  cosine = COSINE_GRID[int(np.nanargmax(by_cosine))]
  scores = coverages(records, cosine)
  # Justified at coverage >= f: below -f on the negated scores, whose
  # smallest tie is the largest f.
  chosen = [i for i, r in enumerate(records)
            if r["class"] in ("paraphrased",) + NEGATIVE]
  negated = choose_threshold(
      -scores[chosen],
      np.asarray([records[i]["class"] == "paraphrased" for i in chosen]))
  return cosine, float(-negated)


def summarize(records: list[dict], cosine: float, coverage: float) -> dict:
  """Per split: per class n, justified rates (the chosen rule, the previous
  one) and median coverage; the AUCs of coverage and of ρ."""
  out = {"semantic_skip_cosine": cosine, "semantic_skip_coverage": coverage,
         "previous_rho_threshold": PREVIOUS_RHO_THRESHOLD, "splits": {}}
  for split in ("choose", "check"):
    rows = [r for r in records if r["split"] == split]
    if not rows:
      continue
    scores = coverages(rows, cosine)
    # ρ is a novelty: lower means stored.
    rho = -np.asarray([r["rho"] for r in rows])
    per_class = {}
    for label in CLASSES:
      which = np.asarray([r["class"] == label for r in rows])
      per_class[label] = {
          "n": int(which.sum()),
          "justified": float(np.mean(scores[which] >= coverage)),
          "justified_previous": float(np.mean(
              -rho[which] < PREVIOUS_RHO_THRESHOLD)),
          "median_coverage": float(np.median(scores[which]))}
    aucs = {}
    for name, score in (("coverage", scores), ("previous_rho", rho)):
      aucs[name] = {f"paraphrased vs {n}": separation(rows, score,
                                                      "paraphrased", (n,))
                    for n in NEGATIVE}
      aucs[name]["paraphrased vs all negatives"] = separation(
          rows, score, "paraphrased", NEGATIVE)
      aucs[name]["verbatim vs not_stored"] = separation(
          rows, score, "verbatim", ("not_stored",))
    out["splits"][split] = {"classes": per_class, "auc": aucs}
  return out


def to_markdown(summary: dict, settings: dict) -> str:
  """The RESULTS.md tables."""
  lines = [f"Encoder {settings['encoder']}; chosen on LoCoMo conversations "
           f"{settings['choose']}, checked on {settings['check']}. A SKIP "
           "is justified when at least "
           f"{summary['semantic_skip_coverage']:.3f} of the user's "
           "statements have a semantic entry at cosine >= "
           f"{summary['semantic_skip_cosine']:.2f} (previous rule: the "
           f"largest ρ < {summary['previous_rho_threshold']}).", "",
           "| split | class | n | justified | justified by the previous rule "
           "| median coverage |", "|---|---|---|---|---|---|"]
  for split, data in summary["splits"].items():
    for label, row in data["classes"].items():
      lines.append(f"| {split} | {label} | {row['n']} | "
                   f"{row['justified']:.3f} | {row['justified_previous']:.3f}"
                   f" | {row['median_coverage']:.3f} |")
  names = list(next(iter(summary["splits"].values()))["auc"]["coverage"])
  lines += ["", "AUC (the stored class above the other):", "",
            "| split | score | " + " | ".join(names) + " |",
            "|---|---|" + "---|" * len(names)]
  for split, data in summary["splits"].items():
    for score, label in (("coverage", "coverage (new)"),
                         ("previous_rho", "largest ρ (previous)")):
      row = data["auc"][score]
      lines.append(f"| {split} | {label} | "
                   + " | ".join(f"{row[n]:.3f}" for n in names) + " |")
  return "\n".join(lines) + "\n"


def _range(text: str) -> range:
  first, _, last = text.partition(":")
  return range(int(first or 0), int(last))


def run(config, output: str, choose: str, check: str, locomo: str = "",
        table: str = "") -> dict:
  """The calibration; writes `output/calibration.{json,md}` and the
  encoder's entry of `table` ("": the packaged table)."""
  splits = {"choose": _range(choose), "check": _range(check)}
  if any(i >= FIRST_HELD_OUT for r in splits.values() for i in r):
    raise ValueError(f"conversations >= {FIRST_HELD_OUT} are validation or "
                     "evaluation data: calibrate on training conversations")
  sections = validate_config(config, required=(EncoderConfig, MemoryConfig,
                                               RewardConfig))
  if not locomo:
    if config.get("dataset", {}).get("name") != "locomo":
      raise ValueError("--locomo=FILE is required: this config's dataset "
                       "is not LoCoMo")
    locomo = config.dataset.path
  start = time.perf_counter()
  dialogues = load_dataset("locomo", locomo)
  encoder = make_encoder(sections[EncoderConfig])
  reward = sections[RewardConfig]
  # Any thresholds: only the statement cosines are read here.
  computer = RewardComputer(encoder, dataclasses.replace(
      reward, semantic_skip_cosine=1.0, semantic_skip_coverage=1.0))
  records = []
  for split, indices in splits.items():
    for i in indices:
      dialogue = dialogues[i]
      logging.info("scoring %s", dialogue.dialogue_id)
      built = cases(dialogue, dialogues[(i + 1) % FIRST_HELD_OUT], encoder,
                    sections[MemoryConfig])
      rollouts = [rollout for _, _, rollout in built]
      terms = computer(rollouts)
      rhos = statement_rhos(rollouts, encoder, reward)
      records += [{"split": split, "dialogue": dialogue.dialogue_id,
                   "session": t, "class": label,
                   "statement_cosines": list(
                       term.semantic_skip_statement_cosines),
                   "rho": float(rho.max(initial=0.0)),
                   "statement_rho": rho.tolist()}
                  for (label, t, _), term, rho in zip(built, terms, rhos)]
  chosen = [r for r in records if r["split"] == "choose"]
  for label in CLASSES:
    if not any(r["class"] == label for r in chosen):
      raise RuntimeError(f"no {label} case in conversations {choose}")
  cosine, coverage = choose_rule(chosen)
  summary = summarize(records, cosine, coverage)
  identity = encoder_identity(sections[EncoderConfig])
  settings = {"encoder": identity, "locomo": os.path.basename(locomo),
              "choose": choose, "check": check,
              "conversations": sorted({r["dialogue"] for r in records}),
              "seconds": round(time.perf_counter() - start, 1)}
  os.makedirs(output, exist_ok=True)
  write_json(os.path.join(output, "calibration.json"),
             {"settings": settings, "summary": summary, "records": records})
  markdown = to_markdown(summary, settings)
  write_atomic(os.path.join(output, "calibration.md"), markdown)
  check_auc = summary["splits"].get("check", {}).get("auc", {}).get(
      "coverage", {})
  entry = {"encoder": identity, "semantic_skip_cosine": cosine,
           "semantic_skip_coverage": coverage,
           "chosen_on": f"{settings['locomo']} conversations {choose}",
           "check_auc_paraphrased_vs_not_stored": check_auc.get(
               "paraphrased vs not_stored")}
  write_entry(table_path(table), entry)
  return {"settings": settings, "summary": summary, "markdown": markdown,
          "entry": entry, "table": table_path(table)}


def main(argv: list[str]) -> None:
  del argv
  if not FLAGS.output:
    raise ValueError("--output=DIR is required")
  result = run(FLAGS.config, FLAGS.output, FLAGS.choose,
               FLAGS.check, FLAGS.locomo, FLAGS.table)
  print(result["markdown"])
  print(json.dumps({"table": result["table"], **result["entry"]}))


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS)
