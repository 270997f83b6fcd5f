"""Does the CMI reward rank memory operations by their use? A validity study
on LoCoMo with its annotations, no training needed.

  python -m tools.reward_study --config=configs/reward_study.py --output=DIR
      [--config.study.conversations=0:1]

For each session t of the chosen conversations, the bank M_{t-1} is the
one the annotation policy built so far (`task.build_memory`). Candidate
operations, each an EPISODIC ADD (its text, the turns it indexes):

  own         the session's own annotated facts (new, relevant);
  duplicate   byte-equal copies of stored memories;
  paraphrase  stored memories rewritten by a fixed rule: "In short, " +
              the text with its date prefix and trailing punctuation
              dropped, lower-cased (same content, other words);
  irrelevant  facts of another conversation (no turns of this one);
  future      facts of a later session of the same conversation.

Each is scored by every reward estimator the project has on one operation
(residual CMI on the App. F local set, as the paper; unconditional cosine,
Table 9 "w. emb"), unshaped (s = clamp(rho, 0, 1)) and Gaussian-shaped
(g(s), Eq. 11), and the shaped value times the reward's cross-duplicate
factor. The log-prob estimator values whole memory states and needs a
policy; it is not run here. Its measured use is what adding that one
operation to M_{t-1} changes on the conversation's questions: the mean
change of evidence-turn recall (turns of the top-k retrieved entries) and
of context recall (a gold answer in the retrieved entries' text), both with
`memory.qa_top_k` retrieval. An operation is "used" when either rises.

Reported: per class the mean of every value with a 95% bootstrap interval;
per estimator the AUC of separating used from unused operations, the
Spearman correlation with the measured use, and the AUC of separating the
session's own facts from duplicates, paraphrases and irrelevant facts (the
reward's job within one session; a later session's fact can be used yet is
not about this session). `DIR/study.json`,
`DIR/study.md` and `DIR/study.png`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
from absl import flags, logging

from cmimem_jax.config import (Section, Sections, define_command_line_flags,
                               need, positive_int, run_command,
                               validate_config)
from cmimem_jax.data import DatasetConfig, Dialogue, load_dataset
from cmimem_jax.data.files import write_atomic, write_figure, write_json
from cmimem_jax.encoders import EncoderConfig, make_encoder
from cmimem_jax.evaluation.compare import auc, spearman
from cmimem_jax.evaluation.judges import context_recall
from cmimem_jax.evaluation.metrics import bootstrap_interval
from cmimem_jax.memory import MemoryBank
from cmimem_jax.memory.annotations import locomo_annotation_operations
from cmimem_jax.memory.bank import embed_texts
from cmimem_jax.memory.builder import MemoryConfig, build_bank
from cmimem_jax.memory.types import ENTRY_TYPES, Action, MemoryType, Operation
from cmimem_jax.task.build_memory import annotation_responder
from cmimem_jax.task.reward import (RewardComputer, RewardConfig,
                                    gaussian_shaping, normalize_text)

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
define_command_line_flags(workdir=False, flag_values=FLAGS)
flags.DEFINE_string("output", None, "Directory for study.json/md/png.",
                    flag_values=FLAGS)

CLASSES = ("own", "duplicate", "paraphrase", "irrelevant", "future")
ESTIMATORS = ("residual", "cosine")
# The values compared per operation: estimator x (unshaped, shaped,
# shaped with the cross-duplicate factor).
VALUES = tuple(f"{e}_{kind}" for e in ESTIMATORS
               for kind in ("s", "shaped", "shaped_dup"))


def annotated_facts(dialogue: Dialogue, session) -> list[tuple[str, tuple]]:
  """(text, evidence turn ids) of a LoCoMo session's observations."""
  try:
    ops = locomo_annotation_operations(dialogue, session)
  except ValueError:
    return []
  return [(op.new_text, op.turn_ids) for op in ops
          if op.memory_type is MemoryType.SEMANTIC and op.writes]


def paraphrase(text: str) -> str:
  """The study's paraphrase rule (see the module doc)."""
  body = text.split(": ", 1)[1] if text[:4].isdigit() and ": " in text else text
  return "In short, " + body.rstrip(" .!").lower()


def candidates(dialogue: Dialogue, other: Dialogue, t: int, bank: MemoryBank,
               per_class: int, rng: np.random.Generator
               ) -> list[tuple[str, Operation]]:
  """(class, EPISODIC ADD) candidates for session t on bank M_{t-1}."""
  session = dialogue.sessions[t]

  def pick(items, k):
    if len(items) <= k:
      return list(items)
    return [items[i] for i in sorted(rng.choice(len(items), k,
                                                replace=False))]

  def add(text, turn_ids=()):
    return Operation(MemoryType.EPISODIC, Action.ADD, (text,),
                     turn_ids=tuple(turn_ids))

  out = [("own", add(text, turns))
         for text, turns in annotated_facts(dialogue, session)]
  stored = list(bank.entries())
  for entry in pick(stored, per_class):
    out.append(("duplicate", add(entry.text, entry.turn_ids)))
  for entry in pick(stored, per_class):
    out.append(("paraphrase", add(paraphrase(entry.text), entry.turn_ids)))
  foreign = [text for s in other.sessions
             for text, _ in annotated_facts(other, s)]
  out += [("irrelevant", add(text)) for text in pick(foreign, per_class)]
  later = [(text, turns) for s in dialogue.sessions[t + 1:]
           for text, turns in annotated_facts(dialogue, s)]
  out += [("future", add(text, turns)) for text, turns in pick(later,
                                                                per_class)]
  return out


class UseMeter:
  """Measured use of one added entry on a conversation's questions, by
  retrieval over M_{t-1} plus that entry alone (the base retrieval of each
  question computed once per session)."""

  def __init__(self, dialogue: Dialogue, encoder, top_k: int):
    self.questions = [q for q in dialogue.questions if q.evidence
                      or not q.is_abstention]
    self.vectors = embed_texts(encoder, [q.question for q in self.questions],
                               kind="query")
    self.top_k = top_k

  def base(self, bank: MemoryBank):
    """Per question: (hits, k-th score, context recall, evidence recall)."""
    out = []
    for question, vector in zip(self.questions, self.vectors):
      hits = bank.search(vector, self.top_k)
      out.append((hits, hits[-1].score if len(hits) == self.top_k else -2.0,
                  self._recalls(question, bank.core, [
                      (h.entry.text, h.entry.turn_ids) for h in hits])))
    return out

  def _recalls(self, question, core: str, entries) -> tuple:
    context = "\n".join([core] + [text for text, _ in entries])
    turns = {t for _, ids in entries for t in ids}
    evidence = (sum(e in turns for e in question.evidence)
                / len(question.evidence) if question.evidence else None)
    return context_recall(question, context), evidence

  def use(self, base, bank: MemoryBank, text: str, turn_ids: tuple,
          vector: np.ndarray) -> tuple[float, float]:
    """(mean Δ context recall, mean Δ evidence recall) of adding the entry."""
    scores = self.vectors @ vector
    context_deltas, evidence_deltas = [], []
    for question, score, (hits, kth, (ctx0, ev0)) in zip(
        self.questions, scores, base):
      ctx1, ev1 = ctx0, ev0
      if score > kth:  # It enters the top-k, the k-th leaves.
        kept = [(h.entry.text, h.entry.turn_ids) for h in hits]
        kept = kept[:self.top_k - 1] if len(kept) == self.top_k else kept
        ctx1, ev1 = self._recalls(question, bank.core,
                                  kept + [(text, turn_ids)])
      if ctx0 is not None:
        context_deltas.append(ctx1 - ctx0)
      if ev0 is not None:
        evidence_deltas.append(ev1 - ev0)
    return (float(np.mean(context_deltas)) if context_deltas else 0.0,
            float(np.mean(evidence_deltas)) if evidence_deltas else 0.0)


def score_conversation(dialogue: Dialogue, other: Dialogue, encoder,
                       sections: Sections, rng: np.random.Generator
                       ) -> list[dict]:
  """One record per candidate operation of every session (the study's
  validated `sections`: memory, reward, study)."""
  memory = sections[MemoryConfig]
  _, _, steps = build_bank(dialogue, encoder, annotation_responder(dialogue),
                           memory)
  meter = UseMeter(dialogue, encoder, memory.qa_top_k)
  computers = {e: RewardComputer(encoder, dataclasses.replace(
      sections[RewardConfig], estimator=e)) for e in ESTIMATORS}
  reward = computers["residual"].config
  per_session = [(step, candidates(dialogue, other, t, step.bank_before,
                                   sections[StudyConfig].per_class, rng))
                 for t, step in enumerate(steps)]
  items = [(step.bank_before, step.session.format(), [op for _, op in cands])
           for step, cands in per_session]
  rhos = {e: c.operation_rhos(items) for e, c in computers.items()}
  texts = sorted({op.new_text for _, cands in per_session
                  for _, op in cands})
  vectors = dict(zip(texts, embed_texts(encoder, texts)))
  records = []
  for index, (step, cands) in enumerate(per_session):
    bank = step.bank_before
    base = meter.base(bank)
    stored = {normalize_text(e.text) for e in bank.entries()}
    stored_vectors = np.concatenate([bank.stores[t].vectors
                                     for t in ENTRY_TYPES])
    for k, (label, op) in enumerate(cands):
      vector = vectors[op.new_text]
      duplicate = (normalize_text(op.new_text) in stored or bool(
          len(stored_vectors) and np.max(stored_vectors @ vector)
          >= reward.duplicate_cosine))
      dup_factor = 1.0 - reward.cross_duplicate_weight * duplicate
      use_context, use_evidence = meter.use(base, bank, op.new_text,
                                            op.turn_ids, vector)
      record = {"dialogue": dialogue.dialogue_id,
                "session": step.session.index, "class": label,
                "text": op.new_text, "use_context": use_context,
                "use_evidence": use_evidence,
                "use": use_context + use_evidence,
                "used": use_context > 0 or use_evidence > 0,
                "bank_entries": len(bank)}
      for estimator in ESTIMATORS:
        rho = rhos[estimator][index][k][0]
        s = min(max(rho, 0.0), 1.0)
        shaped = float(gaussian_shaping(s, reward.mu, reward.sigma))
        record.update({f"{estimator}_rho": rho, f"{estimator}_s": s,
                       f"{estimator}_shaped": shaped,
                       f"{estimator}_shaped_dup": shaped * dup_factor})
      records.append(record)
  return records


def summarize(records: list[dict], seed: int) -> dict:
  rng = np.random.default_rng(seed)
  classes = {}
  for label in CLASSES:
    chosen = [r for r in records if r["class"] == label]
    if not chosen:
      continue
    row = {"n": len(chosen),
           "used_fraction": float(np.mean([r["used"] for r in chosen]))}
    for name in VALUES + ("use",):
      values = np.array([r[name] for r in chosen])
      row[name] = {"mean": float(values.mean()),
                   "ci95": bootstrap_interval(values, rng)}
    classes[label] = row
  used = np.array([r["used"] for r in records])
  use = np.array([r["use"] for r in records])
  # What the reward is meant to do within a session, whatever a later
  # session brings: new relevant facts above redundant and irrelevant ones.
  within = [r for r in records if r["class"] != "future"]
  estimators = {name: {"auc_used": auc(np.array([r[name] for r in records]),
                                       used),
                       "spearman_use": spearman(
                           np.array([r[name] for r in records]), use),
                       "auc_own": auc(np.array([r[name] for r in within]),
                                      np.array([r["class"] == "own"
                                                for r in within]))}
                for name in VALUES}
  return {"operations": len(records), "used": int(used.sum()),
          "classes": classes, "estimators": estimators}


def to_markdown(summary: dict, settings: dict) -> str:
  lines = ["# Reward validity study", "",
           f"Conversations: {settings['conversations']}; encoder: "
           f"{settings['encoder']}; {summary['operations']} operations, "
           f"{summary['used']} used (a question's evidence recall or "
           "context recall rises when it is added).", "",
           "## Per class: mean with 95% bootstrap interval", "",
           "| class | n | used | residual s | residual g(s) | cosine s | "
           "cosine g(s) | use (Δ recall) |", "|---|---|---|---|---|---|---|---|"]

  def cell(row, name):
    value = row[name]
    low, high = value["ci95"]
    return f"{value['mean']:.3f} [{low:.3f}, {high:.3f}]"
  for label, row in summary["classes"].items():
    lines.append(f"| {label} | {row['n']} | {row['used_fraction']:.2f} | "
                 + " | ".join(cell(row, n) for n in (
                     "residual_s", "residual_shaped", "cosine_s",
                     "cosine_shaped", "use")) + " |")
  lines += ["", "## Per estimator: separating used from unused operations",
            "", "| value | AUC (used vs unused) | Spearman with use | "
            "AUC (own vs duplicate, paraphrase, irrelevant) |",
            "|---|---|---|---|"]
  for name, row in summary["estimators"].items():
    lines.append(f"| {name} | {row['auc_used']:.3f} | "
                 f"{row['spearman_use']:.3f} | {row['auc_own']:.3f} |")
  return "\n".join(lines) + "\n"


def plot(records: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  present = [c for c in CLASSES if any(r["class"] == c for r in records)]
  for ax, name, title in ((axes[0], "residual_s", "residual CMI s"),
                          (axes[1], "cosine_s", "cosine s (w. emb)")):
    ax.boxplot([[r[name] for r in records if r["class"] == c]
                for c in present], tick_labels=present)
    ax.set(title=title, ylabel="s = clamp(rho, 0, 1)")
    ax.tick_params(axis="x", rotation=30)
  colors = dict(zip(CLASSES, ("tab:green", "tab:red", "tab:orange",
                              "tab:gray", "tab:blue")))
  for c in present:
    chosen = [r for r in records if r["class"] == c]
    axes[2].scatter([r["residual_s"] for r in chosen],
                    [r["use"] for r in chosen], s=10, alpha=0.6,
                    color=colors[c], label=c)
  axes[2].set(title="residual CMI vs measured use", xlabel="residual s",
              ylabel="Δ evidence + context recall")
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  write_figure(fig, path)
  plt.close(fig)


@dataclasses.dataclass(frozen=True)
class StudyConfig(Section):
  """The `study` section of `configs/reward_study.py`."""

  SECTION: ClassVar[str] = "study"

  conversations: str  # LoCoMo conversations "FIRST:LAST" (Python slice).
  per_class: int      # Responses drawn per class and session.
  seed: int

  def invalid(self) -> Iterator[str]:
    yield from need(self, "per_class", positive_int, "a positive integer")


def run(config, output: str) -> dict:
  """The study; writes `output/study.{json,md,png}` and returns the
  summary."""
  sections = validate_config(config, required=(
      DatasetConfig, EncoderConfig, MemoryConfig, RewardConfig, StudyConfig))
  study = sections[StudyConfig]
  start = time.perf_counter()
  dialogues = load_dataset("locomo", sections[DatasetConfig].path)
  first, _, last = study.conversations.partition(":")
  chosen = dialogues[int(first or 0):int(last) if last else None]
  encoder = make_encoder(sections[EncoderConfig])
  rng = np.random.default_rng(study.seed)
  records = []
  for dialogue in chosen:
    other = dialogues[(dialogues.index(dialogue) + 1) % len(dialogues)]
    logging.info("scoring %s", dialogue.dialogue_id)
    records += score_conversation(dialogue, other, encoder, sections, rng)
  summary = summarize(records, study.seed)
  settings = {"conversations": [d.dialogue_id for d in chosen],
              "encoder": sections[EncoderConfig].kind,
              "per_class": study.per_class,
              "qa_top_k": sections[MemoryConfig].qa_top_k,
              "seconds": round(time.perf_counter() - start, 1)}
  os.makedirs(output, exist_ok=True)
  write_json(os.path.join(output, "study.json"),
             {"settings": settings, "summary": summary, "records": records})
  write_atomic(os.path.join(output, "study.md"),
               to_markdown(summary, settings))
  plot(records, os.path.join(output, "study.png"))
  return {"settings": settings, **summary}


def main(argv: list[str]) -> None:
  del argv
  if not FLAGS.output:
    raise ValueError("--output=DIR is required")
  result = run(FLAGS.config, FLAGS.output)
  print(to_markdown({k: result[k] for k in ("operations", "used", "classes",
                                            "estimators")},
                    result["settings"]))
  print(json.dumps({"output": FLAGS.output,
                    "seconds": result["settings"]["seconds"]}))


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS)
