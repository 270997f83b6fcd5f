"""`tools/reward_study.py`: its operation classes are what they claim, the
measured use of a fact that answers a question is positive, and a run
writes the per-class intervals and per-estimator AUC / Spearman."""

import json

import numpy as np
import pytest

from cmimem_jax.config import memory_defaults
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.memory import Action, MemoryBank, MemoryType, Operation
from cmimem_jax.memory.apply import apply_operations
from cmimem_jax.memory.builder import MemoryConfig, build_bank
from cmimem_jax.task.build_memory import annotation_responder
from tools import reward_study, skip_calibration

ENCODER = HashingEncoder(128)
MEMORY = MemoryConfig.from_config(memory_defaults())


def test_classes_are_built_as_stated(locomo_dialogues):
  dialogue, other = locomo_dialogues[0], locomo_dialogues[1]
  _, _, steps = build_bank(dialogue, ENCODER, annotation_responder(dialogue),
                           MEMORY)
  t = 3
  bank = steps[t].bank_before
  cands = reward_study.candidates(dialogue, other, t, bank, 4,
                                  np.random.default_rng(0))
  by_class = {}
  for label, op in cands:
    assert op.memory_type is MemoryType.EPISODIC and op.action is Action.ADD
    by_class.setdefault(label, []).append(op)
  assert set(by_class) == set(reward_study.CLASSES)
  stored = {e.text: e.turn_ids for e in bank.entries()}
  for op in by_class["duplicate"]:  # Byte-equal to a stored memory.
    assert op.new_text in stored and op.turn_ids == stored[op.new_text]
  assert {op.new_text for op in by_class["paraphrase"]} <= {
      reward_study.paraphrase(text) for text in stored}
  for op in by_class["paraphrase"]:  # Other words, never a stored text.
    assert op.new_text.startswith("In short, ") and op.new_text not in stored
  own = {text for text, _ in reward_study.annotated_facts(
      dialogue, dialogue.sessions[t])}
  assert {op.new_text for op in by_class["own"]} == own
  foreign = {text for s in other.sessions
             for text, _ in reward_study.annotated_facts(other, s)}
  mine = {text for s in dialogue.sessions
          for text, _ in reward_study.annotated_facts(dialogue, s)}
  for op in by_class["irrelevant"]:  # From the other conversation.
    assert op.new_text in foreign and op.new_text not in mine
    assert op.turn_ids == ()
  later = {text for s in dialogue.sessions[t + 1:]
           for text, _ in reward_study.annotated_facts(dialogue, s)}
  assert {op.new_text for op in by_class["future"]} <= later


def test_a_fact_that_answers_a_question_is_used(locomo_dialogues):
  """Hand-built: a bank of two unrelated entries; adding the gold answer
  of a question with the question's evidence turn raises both recalls;
  an unrelated fact leaves them."""
  dialogue = locomo_dialogues[0]
  question = next(q for q in dialogue.questions
                  if q.evidence and not q.is_abstention)
  bank, _ = apply_operations(MemoryBank(dialogue.dialogue_id, ENCODER.dim), [
      Operation(MemoryType.EPISODIC, Action.ADD, (text,))
      for text in ("The weather was mild in spring",
                   "A bus timetable was discussed")], ENCODER,
                             session_index=0)
  meter = reward_study.UseMeter(dialogue, ENCODER, top_k=10)
  base = meter.base(bank)
  fact = f"{question.question} {question.answer}"
  vector = ENCODER.encode([fact])[0]
  context, evidence = meter.use(base, bank, fact, tuple(question.evidence),
                                vector)
  assert context > 0 and evidence > 0
  unrelated = "Zebras graze quietly"
  assert meter.use(base, bank, unrelated, (),
                   ENCODER.encode([unrelated])[0]) == (0.0, 0.0)


@pytest.mark.slow
def test_a_run_writes_intervals_auc_and_spearman(locomo_path, tmp_path):
  from configs import reward_study as study_config
  config = study_config.get_config()
  config.dataset.path = locomo_path
  config.encoder.update({"kind": "hashing", "dim": 128})
  config.study.per_class = 2
  result = reward_study.run(config, str(tmp_path))
  saved = json.loads((tmp_path / "study.json").read_text())
  assert saved["summary"]["operations"] == result["operations"] > 100
  for row in saved["summary"]["classes"].values():
    low, high = row["residual_s"]["ci95"]
    assert low <= row["residual_s"]["mean"] <= high
  for name in reward_study.VALUES:
    assert set(saved["summary"]["estimators"][name]) == {
        "auc_used", "spearman_use", "auc_own"}
  assert (tmp_path / "study.png").stat().st_size > 0
  assert "| own |" in (tmp_path / "study.md").read_text()


# -- tools/skip_calibration.py ------------------------------------------------


def test_skip_cases_are_built_as_stated(locomo_dialogues):
  """Per session with user statements and observations of the user: the
  store before it, plus half of those observations, plus as many of
  another conversation's, plus all of them, plus the statements verbatim;
  verbatim storage covers every statement (cosine 1), nothing stored
  none."""
  from cmimem_jax.task.reward import RewardComputer, RewardConfig
  from cmimem_jax.data.fragments import user_statements
  dialogue, other = locomo_dialogues[0], locomo_dialogues[1]
  built = skip_calibration.cases(dialogue, other, ENCODER, MEMORY)
  by_session = {}
  for label, t, rollout in built:
    by_session.setdefault(t, {})[label] = rollout
  assert all(set(r) <= set(skip_calibration.CLASSES)
             for r in by_session.values())
  t, rollouts = next((t, r) for t, r in sorted(by_session.items())
                     if t > 0 and len(r) == 5)
  before = rollouts["not_stored"].bank
  semantic = lambda bank: [e.text for e in bank.entries(  # noqa: E731
      MemoryType.SEMANTIC)]
  statements = user_statements(dialogue.sessions[t].user_turns())
  assert semantic(rollouts["verbatim"].bank) == semantic(before) + statements
  observed = skip_calibration.user_observations(dialogue, dialogue.sessions[t])
  assert observed and semantic(rollouts["paraphrased"].bank) == (
      semantic(before) + observed)
  assert semantic(rollouts["partial"].bank) == (semantic(before)
                                                + observed[::2])
  foreign = {text for s in other.sessions
             for text in skip_calibration.user_observations(other, s)}
  unrelated = semantic(rollouts["unrelated"].bank)[len(semantic(before)):]
  assert len(unrelated) == len(observed) and set(unrelated) <= foreign
  assert rollouts["not_stored"].response.valid
  terms = RewardComputer(ENCODER, RewardConfig(
      semantic_skip_cosine=0.99, semantic_skip_coverage=1.0))(
          [rollouts["verbatim"], rollouts["not_stored"]])
  assert min(terms[0].semantic_skip_statement_cosines) > 0.999
  assert terms[0].semantic_skip_justified is True
  assert terms[1].semantic_skip_justified is False


def test_the_coverage_rule_is_chosen_on_paraphrases_against_negatives():
  """The cosine whose coverage separates paraphrased storage from the
  negatives best, then the coverage threshold of max Youden's J."""
  records = [{"class": label, "statement_cosines": cosines}
             for label, cosines in (
                 ("not_stored", [0.3, 0.2, 0.1]), ("unrelated", [0.4, 0.3]),
                 ("partial", [0.8, 0.3, 0.2]), ("paraphrased", [0.8, 0.7, 0.2]),
                 ("paraphrased", [0.9, 0.75, 0.7]),
                 ("verbatim", [1.0, 1.0, 1.0]))]
  cosine, coverage = skip_calibration.choose_rule(records)
  # From 0.35 (the first such cosine of the grid) the paraphrases cover
  # 2/3 and 1 of their statements, the negatives at most 1/2: separated.
  assert cosine == 0.35 and 1 / 2 < coverage < 2 / 3
  scores = skip_calibration.coverages(records, cosine)
  assert skip_calibration.separation(records, scores, "paraphrased",
                                     skip_calibration.NEGATIVE) == 1.0


def test_the_threshold_maximises_youden_and_takes_the_smallest_tie():
  scores = np.array([0.0, 0.1, 0.3, 0.2, 0.5, 0.6])
  positive = np.array([1, 1, 1, 0, 0, 0], bool)
  # Below 0.15: J = 2/3 - 0; below 0.4: J = 1 - 1/3: a tie, the smaller.
  assert skip_calibration.choose_threshold(scores, positive) == pytest.approx(
      0.15)
  assert skip_calibration.choose_threshold(
      np.array([0.0, 0.1, 0.5]), np.array([1, 1, 0], bool)) == pytest.approx(
          0.3)


def test_the_calibration_refuses_held_out_conversations(tmp_path):
  from configs import reward_study as study_config
  with pytest.raises(ValueError, match="training conversations"):
    skip_calibration.run(study_config.get_config(), str(tmp_path), "0:5",
                         "5:8")
