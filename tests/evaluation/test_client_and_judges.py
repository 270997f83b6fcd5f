"""The OpenAI-compatible client and the judges against a loopback server."""

import numpy as np
import pytest

from cmimem_jax.data import NOT_ANSWERABLE, load_locomo
from cmimem_jax.data.types import Question
from cmimem_jax.memory.prompt_builder import build_judge_prompt
from cmimem_jax.client import EndpointConfig, OpenAIClient
from cmimem_jax.evaluation.judges import (LLMJudge, context_recall,
                                          longmemeval_prompt,
                                          parse_listing11_verdict,
                                          parse_yes_no_verdict)
from cmimem_jax.testing.fake_openai import FakeOpenAI, embedding_for


def client_for(server, **overrides):
  values = dict(base_url=server.base_url, model="fake", timeout_s=0.5,
                max_retries=2, backoff_s=0.01, concurrency=4)
  values.update(overrides)
  return OpenAIClient(EndpointConfig(**values))


def test_retries_recover_transient_failures():
  transient = {1: "500", 2: "timeout"}
  with FakeOpenAI(lambda c, a: transient.get(a, "ok")) as server:
    client = client_for(server)
    result = client.chat([{"role": "user", "content": "hello"}])
  assert result.ok and result.attempts == 3
  assert result.text == "It was in May 2023."
  assert client.failures.as_dict() == {
      "failed_attempts": {"http_5xx": 1, "timeout": 1}, "failed_calls": {}}


@pytest.mark.parametrize("action,kind", [("500", "http_5xx"),
                                         ("malformed", "malformed"),
                                         ("empty", "malformed"),
                                         ("timeout", "timeout")])
def test_permanent_failures_are_reported_not_answered(action, kind):
  with FakeOpenAI(lambda c, a: action, delay_s=0.8) as server:
    client = client_for(server, max_retries=1)
    result = client.chat([{"role": "user", "content": "q"}])
  assert not result.ok and result.text is None
  assert result.error.startswith(kind) and result.attempts == 2
  assert client.failures.as_dict()["failed_calls"] == {kind: 1}


def test_a_4xx_is_not_retried_but_429_is():
  with FakeOpenAI(lambda c, a: "400") as server:
    client = client_for(server, max_retries=3)
    result = client.chat([{"role": "user", "content": "q"}])
    assert server.requests == 1  # A bad request stays bad: one attempt.
  assert not result.ok and result.attempts == 1
  assert result.error.startswith("http_4xx")
  assert client.failures.as_dict() == {"failed_attempts": {"http_4xx": 1},
                                       "failed_calls": {"http_4xx": 1}}
  with FakeOpenAI(lambda c, a: "429" if a == 1 else "ok") as server:
    client = client_for(server, max_retries=3)
    result = client.chat([{"role": "user", "content": "q"}])
  assert result.ok and result.attempts == 2  # Rate limits are retried.


def test_chat_many_keeps_order_under_concurrency_and_embeds():
  with FakeOpenAI() as server:
    client = client_for(server, concurrency=8)
    results = client.chat_many([[{"role": "user", "content": f"m{i}"}]
                                for i in range(20)])
    vectors = client.embed(["a", "b"])
  assert all(r.ok for r in results) and server.requests == 20
  np.testing.assert_allclose(vectors[1], embedding_for("b"), rtol=1e-6)


def test_listing11_and_yes_no_verdicts():
  assert parse_listing11_verdict('fine. {"label": "CORRECT"}') == 1.0
  assert parse_listing11_verdict('{"label":"wrong"}') == 0.0
  assert parse_listing11_verdict("WRONG") == 0.0
  assert parse_listing11_verdict("CORRECT or WRONG?") is None
  assert parse_listing11_verdict("no idea") is None
  assert parse_yes_no_verdict("Yes.") == 1.0
  assert parse_yes_no_verdict("No") == 0.0
  assert parse_yes_no_verdict("unclear") is None
  # Verdicts are words: "yesterday" / "know" decide nothing.
  assert parse_yes_no_verdict("No, it happened yesterday.") == 0.0
  assert parse_yes_no_verdict("Yesterday is mentioned; I know.") is None
  assert parse_yes_no_verdict('{"answer": "yes"}') == 1.0
  assert parse_yes_no_verdict('{"answer": "no", "why": "yes-man"}') == 0.0


def question(category="single-hop", answer="Paris", abstention=False):
  return Question("q1", "Where did she go?", answer, category,
                  all_answers=(answer,), is_abstention=abstention)


def test_longmemeval_prompts_by_type():
  assert "off-by-one" in longmemeval_prompt(question("temporal-reasoning"),
                                            "x")
  assert "Rubric" in longmemeval_prompt(question("single-session-preference"),
                                        "x")
  assert "unanswerable" in longmemeval_prompt(question(abstention=True), "x")
  assert "Correct Answer: Paris" in longmemeval_prompt(question(), "x")


def test_llm_judge_scores_and_counts_failures():
  def behaviour(content, attempt):
    del attempt
    return "500" if "Lyon" in content else "ok"
  with FakeOpenAI(behaviour) as server:
    judge = LLMJudge(client_for(server, max_retries=1))
    verdicts = judge.judge_many([question()] * 3,
                                ["She went to Paris.", "Rome", "Lyon"])
  assert [v[0] for v in verdicts] == [1.0, 0.0, None]
  assert verdicts[2][1].startswith("http_5xx")
  assert judge.client.failures.as_dict()["failed_calls"] == {"http_5xx": 1}


def test_context_recall():
  assert context_recall(question(), "[Session 2] Caroline: I loved paris!")
  assert not context_recall(question(), "She stayed home.")
  # Nothing to find for an unanswerable question (LoCoMo category 5).
  refusal = question("adversarial", NOT_ANSWERABLE, abstention=True)
  assert context_recall(refusal, "Not answerable. Paris.") is None


def test_locomo_category_5_is_judged_against_the_refusal(locomo_path):
  (conv,) = load_locomo(locomo_path)[:1]
  planted = next(q for q in conv.questions if q.category == "adversarial")
  assert planted.answer == NOT_ANSWERABLE
  prompt = build_judge_prompt(planted.question, planted.answer,
                              planted.adversarial_answer)
  assert f"Gold answer: {NOT_ANSWERABLE}\nGenerated answer: " in prompt
