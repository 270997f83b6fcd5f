import datetime as dt
import re

from cmimem_jax.data import bundled_path, load_dataset
from cmimem_jax.data.types import Session, Turn
from cmimem_jax.memory import MemoryType, parse, render
from cmimem_jax.memory.dsl import rendered_response, response_regex
from cmimem_jax.memory.extractive import extractive_operations
from cmimem_jax.memory.types import Action

SESSION = Session("s1", 0, dt.datetime(2024, 3, 2, 10, 15), "2024/03/02",
                  (Turn("s1:0", "user", "user",
                        "I adopted a greyhound named Biscuit. Any tips?"),
                   Turn("s1:1", "assistant", "assistant",
                        "Keep the first days calm and the walks short."),
                   Turn("s1:2", "user", "user",
                        "He is scared of the stairs on Oak Street."),
                   Turn("s1:3", "user", "user",
                        "I work from home on Mondays. Thanks!")))


def test_the_user_sentences_are_kept_verbatim_with_their_turns():
  ops = extractive_operations(SESSION)
  assert [(o.memory_type, o.action, o.fields, o.turn_ids) for o in ops] == [
      (MemoryType.CORE, Action.APPEND,
       ("I adopted a greyhound named Biscuit.",), ("s1:0",)),
      # Questions, short thanks and the assistant's turns are not stored.
      (MemoryType.EPISODIC, Action.ADD,
       ("2024-03-02: He is scared of the stairs on Oak Street.",),
       ("s1:2",)),
      (MemoryType.EPISODIC, Action.ADD,
       ("2024-03-02: I work from home on Mondays.",), ("s1:3",)),
      (MemoryType.SEMANTIC, Action.SKIP, (), ()),
      (MemoryType.PROCEDURAL, Action.SKIP, (), ())]


def test_a_budget_stops_before_the_first_sentence_that_does_not_fit():
  calls = []

  def fits(ops):
    calls.append(len(ops))
    return sum(o.memory_type is MemoryType.EPISODIC for o in ops) <= 1

  ops = extractive_operations(SESSION, fits)
  assert [o.memory_type for o in ops if o.writes] == [MemoryType.CORE,
                                                     MemoryType.EPISODIC]
  assert calls == [4, 5]  # Each candidate response, skips included.
  nothing_fits = extractive_operations(SESSION, lambda ops: False)
  assert [(o.memory_type, o.action) for o in nothing_fits[:2]] == [
      (MemoryType.CORE, Action.APPEND), (MemoryType.EPISODIC, Action.SKIP)]


def test_a_session_without_statements_is_still_a_valid_response():
  questions = Session("q", 1, None, "", (
      Turn("q:0", "user", "user", "What is the capital of Australia?"),
      Turn("q:1", "assistant", "assistant", "Canberra is the capital.")))
  ops = extractive_operations(questions)
  assert ops[0].fields == ("Talked on unknown.",)
  assert parse(render(ops)).valid


def test_every_bundled_session_gives_a_response_the_grammar_accepts():
  grammar = response_regex()
  for dialogue in load_dataset("longmemeval", bundled_path()):
    for session in dialogue.sessions:
      text = render(extractive_operations(session)) + "\n"
      assert parse(text).valid and re.fullmatch(grammar, text), text


def test_the_teachers_response_keeps_each_entrys_turn():
  response = rendered_response(extractive_operations(SESSION))
  assert response.valid
  assert [(o.turn_ids, o.line) for o in response.operations] == [
      (("s1:0",), 0), (("s1:2",), 1), (("s1:3",), 2), ((), 3), ((), 4)]
