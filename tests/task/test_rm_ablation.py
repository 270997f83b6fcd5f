"""`memory.source_chunks` (Table 3's "RM"): with it the QA contexts of
training and evaluation carry the source turns of retrieved entries
(LookupChunk); without it (the ablation) they carry the entries alone.
A question whose answer only the source turn holds tells the two apart."""

import collections

import pytest

from cmimem_jax.config import apply_overrides
from cmimem_jax.data import bundled_path, load_dataset
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.evaluation.judges import context_recall
from cmimem_jax.evaluation.run import EvaluationConfig, context_provider
from cmimem_jax.memory import Action, MemoryBank, MemoryType, Operation
from cmimem_jax.memory.apply import apply_operations
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.task.episode import Episode, session_questions
from cmimem_jax.task.qa_reward import QAConfig, QAReward
from configs import eval_cpu, tiny

ENCODER = HashingEncoder(64)


@pytest.fixture(scope="module")
def case():
  dialogue = load_dataset("longmemeval", bundled_path())[0]  # Maya.
  session = dialogue.sessions[2]  # "I also moved Biscuit's walks to 7 am".
  questions = tuple(q for q in session_questions(dialogue, session)
                    if q.answer == "7 am")
  # The entry says what changed, not the time; its source turn has "7 am".
  bank, _ = apply_operations(
      MemoryBank(dialogue.dialogue_id, ENCODER.dim),
      [Operation(MemoryType.EPISODIC, Action.ADD,
                 ("What time does Maya walk Biscuit now: she moved the "
                  "walks before her commute",))],
      ENCODER, session_index=session.index,
      turn_ids=(f"{session.session_id}:4",))
  return dialogue, session, questions, bank


@pytest.mark.parametrize("source_chunks,expected", [(True, 1.0),
                                                    (False, 0.0)])
def test_source_chunks_reach_the_training_qa_reward(case, source_chunks,
                                                    expected):
  dialogue, session, questions, bank = case
  config = apply_overrides(tiny.get_config(),
                           {"memory.source_chunks": source_chunks})
  qa = QAReward.from_config(QAConfig.from_config(config.qa),
                           MemoryConfig.from_config(config.memory), ENCODER)
  score, _ = qa(bank, Episode(dialogue, session, MemoryBank("x", 64),
                              questions))
  assert score == expected


@pytest.mark.parametrize("source_chunks,expected", [(True, 1.0),
                                                    (False, 0.0)])
def test_source_chunks_reach_the_evaluation_context(case, tmp_path,
                                                    source_chunks, expected):
  dialogue, _, questions, bank = case
  config = apply_overrides(eval_cpu.get_config(), {
      "method": "policy", "memory.source_chunks": source_chunks})
  bank.save(str(tmp_path / "banks" / "policy" / dialogue.dialogue_id))
  provider = context_provider(
      dialogue, ENCODER, EvaluationConfig.from_config(config),
      MemoryConfig.from_config(config.memory), str(tmp_path), None,
      collections.Counter())
  contexts = provider.many(questions)
  assert [context_recall(q, c.context) for q, c in zip(questions, contexts)
          ] == [expected] * len(questions)
  assert bool(contexts[0].turns) is source_chunks
