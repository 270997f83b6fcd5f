"""Calibrates the semantic-SKIP threshold on constructed LoCoMo cases.

  python tools/skip_calibration.py --config=configs/reward_study.py \
      --output=results/skip_calibration [--choose=0:5 --check=5:7]

A semantic SKIP is justified when what the user states in the session is
already in the semantic store (App. B); the reward judges it by ρ, the
largest clamped CMI of a user statement against that store
(`RewardComputer._semantic_skip_statement_rhos`, logged as
`semantic_skip_rho`), and pays the bonus below
`reward.semantic_skip_threshold`. For every session t
with user statements of the chosen conversations, the store before it is
the annotation builder's `M_{t-1}` (LoCoMo's observations of sessions
< t, `task.build_memory`), and three cases of one SKIP are scored:

  not_stored   M_{t-1}: the session's statements are not stored; skipping
               is wrong (the negative class);
  verbatim     M_{t-1} plus every user statement of session t as a
               SEMANTIC ADD: skipping is right;
  paraphrased  M_{t-1} plus LoCoMo's observations of session t about the
               user (speaker_a, the role "user"): the same facts in the
               annotators' words, built without an LLM; skipping is right.

The threshold maximises Youden's J (justified rate of the two positive
classes pooled minus that of `not_stored`) over the `--choose`
conversations; a tie takes the smallest such threshold (the bonus is paid
as rarely as the best separation allows). It is a midpoint between two
observed ρ. The `--check` conversations report the same rates at that
threshold, never used to choose it. Only LoCoMo training conversations
belong here (the small reproduction trains on 0-6, validates on 7 and
evaluates on 8-9): a range reaching 7 is refused.

Other ways to pool the statements' ρ into one score (their mean, 90th
percentile, and the fraction of statements at or above the chosen
threshold) are reported beside the largest, as the AUC of each separating
`not_stored` from each stored class: whether a better pooling would pay
the bonus on paraphrased storage.

Writes `DIR/calibration.json` (every case's ρ and its statements' ρ) and
`DIR/calibration.md` (the tables); prints them. Exits non-zero when a
class is empty.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402

from cmimem_jax.cmi.reward import (RewardComputer, RewardConfig,  # noqa: E402
                                   RolloutInput)
from cmimem_jax.config import run_command, validate_config  # noqa: E402
from cmimem_jax.data import Dialogue, load_dataset  # noqa: E402
from cmimem_jax.data.files import write_atomic, write_json  # noqa: E402
from cmimem_jax.data.fragments import user_statements  # noqa: E402
from cmimem_jax.encoders import make_encoder  # noqa: E402
from cmimem_jax.memory import MemoryBank, parse  # noqa: E402
from cmimem_jax.memory.apply import apply_operations  # noqa: E402
from cmimem_jax.memory.builder import build_bank  # noqa: E402
from cmimem_jax.memory.types import Action, MemoryType, Operation  # noqa: E402
from cmimem_jax.task.build_memory import annotation_responder  # noqa: E402
from reward_study import auc  # noqa: E402

CLASSES = ("not_stored", "verbatim", "paraphrased")
POSITIVE = ("verbatim", "paraphrased")
# Core has no SKIP (Table 10); the core line is outside the semantic store
# the judgement reads.
SKIP = "CORE:APPEND|Talked.\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP"
# The first conversation the calibration may not read (validation: 7,
# evaluation: 8-9 in configs/small_repro.py).
FIRST_HELD_OUT = 7


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


def cases(dialogue: Dialogue, encoder, memory
          ) -> list[tuple[str, int, RolloutInput]]:
  """(class, session index, SKIP rollout) of every session of `dialogue`
  in which the user states something."""
  _, _, steps = build_bank(dialogue, encoder, annotation_responder(dialogue),
                           memory)
  skip = parse(SKIP)
  out = []
  for t, step in enumerate(steps):
    session = step.session
    turns = session.user_turns()
    statements = user_statements(turns)
    if not statements:  # Nothing stated: every SKIP is justified.
      continue
    stores = {"not_stored": step.bank_before,
              "verbatim": with_semantic(step.bank_before, statements, encoder,
                                        t)}
    observed = user_observations(dialogue, session)
    if observed:
      stores["paraphrased"] = with_semantic(step.bank_before, observed,
                                            encoder, t)
    for label, bank in stores.items():
      out.append((label, t, RolloutInput(bank, session.format(), skip,
                                         user_turns=turns)))
  return out


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


def summarize(records: list[dict], threshold: float,
              previous: float) -> dict:
  """Per (split, class): n, justified rates, median ρ; per split the AUC
  of ρ separating not_stored from each positive class and from both."""
  out = {"threshold": threshold, "previous_threshold": previous, "splits": {}}
  for split in ("choose", "check"):
    rows = [r for r in records if r["split"] == split]
    if not rows:
      continue
    per_class = {}
    for label in CLASSES:
      rho = np.asarray([r["rho"] for r in rows if r["class"] == label])
      per_class[label] = {
          "n": int(len(rho)),
          "justified": float(np.mean(rho < threshold)),
          "justified_previous": float(np.mean(rho < previous)),
          "median_rho": float(np.median(rho))}
    aucs = {}
    for name, labels in (("verbatim", ("verbatim",)),
                         ("paraphrased", ("paraphrased",)),
                         ("both", POSITIVE)):
      chosen = [r for r in rows if r["class"] in ("not_stored",) + labels]
      aucs[name] = auc(np.asarray([r["rho"] for r in chosen]),
                       np.asarray([r["class"] == "not_stored"
                                   for r in chosen]))
    out["splits"][split] = {"classes": per_class, "auc": aucs}
  return out


def poolings(threshold: float) -> dict[str, Callable[[np.ndarray], float]]:
  """Ways to pool a session's statement ρ `[U]` into one score (higher:
  more novel); `largest` is the reward's."""
  return {"largest": lambda rho: float(rho.max(initial=0.0)),
          "mean": lambda rho: float(rho.mean()) if rho.size else 0.0,
          "90th percentile": (lambda rho: float(np.quantile(rho, 0.9))
                              if rho.size else 0.0),
          "fraction novel": (lambda rho: float(np.mean(rho >= threshold))
                             if rho.size else 0.0)}


def pooling_aucs(records: list[dict], threshold: float
                 ) -> dict[str, dict[str, float]]:
  """Per pooling, the AUC of its score separating `not_stored` (above)
  from each stored class, over `records` (with `statement_rho`)."""
  out = {}
  for name, pool in poolings(threshold).items():
    scores = [pool(np.asarray(r["statement_rho"], np.float64))
              for r in records]
    out[name] = {}
    for label in POSITIVE:
      keep = [i for i, r in enumerate(records)
              if r["class"] in ("not_stored", label)]
      out[name][label] = auc(np.asarray([scores[i] for i in keep]),
                             np.asarray([records[i]["class"] == "not_stored"
                                         for i in keep]))
  return out


def to_markdown(summary: dict, settings: dict) -> str:
  """The RESULTS.md table."""
  lines = [f"Encoder {settings['encoder']}; choose on conversations "
           f"{settings['choose']}, check on {settings['check']}. Chosen "
           f"threshold (max Youden's J on choose): ρ < "
           f"{summary['threshold']:.4f} (was {summary['previous_threshold']}).",
           "", "| split | class | n | justified | justified at the old "
           "threshold | median ρ |", "|---|---|---|---|---|---|"]
  for split, data in summary["splits"].items():
    for label, row in data["classes"].items():
      lines.append(f"| {split} | {label} | {row['n']} | "
                   f"{row['justified']:.3f} | {row['justified_previous']:.3f}"
                   f" | {row['median_rho']:.3f} |")
  lines += ["", "AUC of ρ (not_stored above the stored class):", "",
            "| split | verbatim | paraphrased | both |", "|---|---|---|---|"]
  for split, data in summary["splits"].items():
    a = data["auc"]
    lines.append(f"| {split} | {a['verbatim']:.3f} | {a['paraphrased']:.3f} "
                 f"| {a['both']:.3f} |")
  lines += ["", "AUC of other poolings of the statements' ρ (choose; "
            "`largest` is the reward's):", "",
            "| pooling | verbatim | paraphrased |", "|---|---|---|"]
  for name, row in summary["pooling_auc"].items():
    lines.append(f"| {name} | {row['verbatim']:.3f} | "
                 f"{row['paraphrased']:.3f} |")
  return "\n".join(lines) + "\n"


def _range(text: str) -> range:
  first, _, last = text.partition(":")
  return range(int(first or 0), int(last))


def run(config, output: str, choose: str, check: str) -> dict:
  """The calibration; writes `output/calibration.{json,md}`."""
  splits = {"choose": _range(choose), "check": _range(check)}
  if any(i >= FIRST_HELD_OUT for r in splits.values() for i in r):
    raise ValueError(f"conversations >= {FIRST_HELD_OUT} are validation or "
                     "evaluation data: calibrate on training conversations")
  validate_config(config, required=("dataset", "encoder", "memory", "reward"))
  start = time.perf_counter()
  dialogues = load_dataset("locomo", config.dataset.path)
  encoder = make_encoder(config.encoder)
  reward = RewardConfig.from_config(config.reward)
  computer = RewardComputer(encoder, reward)
  records = []
  for split, indices in splits.items():
    for i in indices:
      dialogue = dialogues[i]
      logging.info("scoring %s", dialogue.dialogue_id)
      built = cases(dialogue, encoder, config.memory)
      terms = computer([rollout for _, _, rollout in built])
      records += [{"split": split, "dialogue": dialogue.dialogue_id,
                   "session": t, "class": label,
                   "rho": float(term.semantic_skip_rho),
                   "statement_rho": list(term.semantic_skip_statement_rhos)}
                  for (label, t, _), term in zip(built, terms)]
  chosen = [r for r in records if r["split"] == "choose"]
  for label in CLASSES:
    if not any(r["class"] == label for r in chosen):
      raise RuntimeError(f"no {label} case in conversations {choose}")
  threshold = choose_threshold(
      np.asarray([r["rho"] for r in chosen]),
      np.asarray([r["class"] in POSITIVE for r in chosen]))
  summary = summarize(records, threshold, reward.semantic_skip_threshold)
  summary["pooling_auc"] = pooling_aucs(chosen, threshold)
  settings = {"encoder": config.encoder.kind, "choose": choose,
              "check": check,
              "conversations": sorted({r["dialogue"] for r in records}),
              "seconds": round(time.perf_counter() - start, 1)}
  os.makedirs(output, exist_ok=True)
  write_json(os.path.join(output, "calibration.json"),
             {"settings": settings, "summary": summary, "records": records})
  markdown = to_markdown(summary, settings)
  write_atomic(os.path.join(output, "calibration.md"), markdown)
  return {"settings": settings, "summary": summary, "markdown": markdown}


def main(argv: list[str]) -> None:
  del argv
  if not flags.FLAGS.output:
    raise ValueError("--output=DIR is required")
  result = run(flags.FLAGS.config, flags.FLAGS.output, flags.FLAGS.choose,
               flags.FLAGS.check)
  print(result["markdown"])


if __name__ == "__main__":
  # Defined here, not at import: the tests import this module beside other
  # tools that define their own --output.
  flags.DEFINE_string("output", None, "Directory for calibration.json/md.")
  flags.DEFINE_string("choose", "0:5", "Conversations the threshold is "
                      "chosen on (START:STOP).")
  flags.DEFINE_string("check", "5:7", "Conversations it is checked on.")
  run_command(main, workdir=False)
