"""Judges: LLM (Listing 11, or LongMemEval's per-type prompts) and the
offline `context_recall` proxy (SPEC §4.5).

A judge returns 1.0 / 0.0, or None when it could not decide (endpoint
failure, unparseable verdict); None is counted as a failure by the caller
and never averaged in.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Sequence

from cmimem_jax.data.types import Question
from cmimem_jax.client import CallResult, OpenAIClient, then
from cmimem_jax.evaluation.metrics import normalize_answer
from cmimem_jax.memory.prompt_builder import build_judge_prompt

_LME_BASE = ("I will give you a question, a correct answer, and a response "
             "from a model. Please answer yes if the response contains the "
             "correct answer. Otherwise, answer no. ")
_LME_STEPS = ("If the response is equivalent to the correct answer or "
              "contains all the intermediate steps to get the correct answer, "
              "you should also answer yes. If the response only contains a "
              "subset of the information required by the answer, answer no. ")
_LME_TAIL = ("\n\nQuestion: {question}\n\nCorrect Answer: {answer}\n\nModel "
             "Response: {response}\n\nIs the model response correct? Answer "
             "yes or no only.")
# LongMemEval's `get_anscheck_prompt` (src/evaluation/evaluate_qa.py).
LONGMEMEVAL_PROMPTS = {
    "default": _LME_BASE + _LME_STEPS + _LME_TAIL,
    "temporal-reasoning": _LME_BASE + _LME_STEPS + (
        "In addition, do not penalize off-by-one errors for the number of "
        "days. If the question asks for the number of days/weeks/months, "
        "etc., and the model makes off-by-one errors (e.g., predicting 19 "
        "days when the answer is 18), the model's response is still "
        "correct. ") + _LME_TAIL,
    "knowledge-update": _LME_BASE + (
        "If the response contains some previous information along with an "
        "updated answer, the response should be considered as correct as "
        "long as the updated answer is the required answer.") + _LME_TAIL,
    "single-session-preference": (
        "I will give you a question, a rubric for desired personalized "
        "response, and a response from a model. Please answer yes if the "
        "response satisfies the desired response. Otherwise, answer no. The "
        "model does not need to reflect all the points in the rubric. The "
        "response is correct as long as it recalls and utilizes the user's "
        "personal information correctly.\n\nQuestion: {question}\n\nRubric: "
        "{answer}\n\nModel Response: {response}\n\nIs the model response "
        "correct? Answer yes or no only."),
    "abstention": (
        "I will give you an unanswerable question, an explanation, and a "
        "response from a model. Please answer yes if the model correctly "
        "identifies the question as unanswerable. The model could say that "
        "the information is incomplete, or some other information is given "
        "but the asked information is not.\n\nQuestion: {question}\n\n"
        "Explanation: {answer}\n\nModel Response: {response}\n\nDoes the "
        "model correctly identify the question as unanswerable? Answer yes or "
        "no only."),
}


def longmemeval_prompt(question: Question, response: str) -> str:
  if question.is_abstention:
    template = LONGMEMEVAL_PROMPTS["abstention"]
  else:
    template = LONGMEMEVAL_PROMPTS.get(question.category,
                                       LONGMEMEVAL_PROMPTS["default"])
  return template.format(question=question.question, answer=question.answer,
                         response=response)


_LABEL = re.compile(r'"label"\s*:\s*"(CORRECT|WRONG)"', re.IGNORECASE)


def parse_listing11_verdict(text: str) -> float | None:
  """`{"label": "CORRECT" | "WRONG"}` (the last one wins); a bare word when
  exactly one of the two labels appears; otherwise None."""
  labels = _LABEL.findall(text)
  if labels:
    return float(labels[-1].upper() == "CORRECT")
  words = set(re.findall(r"\b(CORRECT|WRONG)\b", text))
  if len(words) == 1:
    return float(words.pop() == "CORRECT")
  return None


def parse_yes_no_verdict(text: str) -> float | None:
  """LongMemEval: the first word "yes" or "no" (so "yesterday" or "know"
  decide nothing; `{"answer": "yes"}` counts); neither: undecided.

  The benchmark's own script tests `'yes' in response`, which scores
  "No, not yesterday." as correct."""
  for word in re.findall(r"[a-z]+", text.lower()):
    if word in ("yes", "no"):
      return float(word == "yes")
  return None


class LLMJudge:
  """Judges answers through an OpenAI-compatible endpoint.

  Args:
    client: the judge endpoint.
    prompt: "listing11" (the paper's judge) or "longmemeval" (the
      benchmark's own per-type prompts).
  """

  def __init__(self, client: OpenAIClient, prompt: str = "listing11"):
    if prompt not in ("listing11", "longmemeval"):
      raise ValueError(f"unknown judge prompt {prompt!r}")
    self.client, self.prompt = client, prompt

  def messages(self, question: Question, prediction: str
               ) -> list[dict[str, str]]:
    """The judge conversation for one answer (one user message)."""
    if self.prompt == "longmemeval":
      prompt = longmemeval_prompt(question, prediction)
    else:
      prompt = build_judge_prompt(question.question, question.answer,
                                  prediction)
    return [{"role": "user", "content": prompt}]

  def judge_many(self, questions: Sequence[Question],
                 predictions: Sequence[str]) -> list[tuple[float | None, str]]:
    """(score or None, error or raw verdict) per question."""
    futures = [self.submit(q, p) for q, p in zip(questions, predictions)]
    return [f.result() for f in futures]

  def submit(self, question: Question, prediction: str
             ) -> concurrent.futures.Future[tuple[float | None, str]]:
    """`judge_many` of one answer, in the judge endpoint's pool: returns
    at once."""
    return then(self.client.submit(self.messages(question, prediction)),
                self._verdict)

  def _verdict(self, result: CallResult) -> tuple[float | None, str]:
    if not result.ok:
      return None, result.error or "failed"
    parse = (parse_yes_no_verdict if self.prompt == "longmemeval"
             else parse_listing11_verdict)
    score = parse(result.text or "")
    if score is None:
      self.client.failures.call("unparseable_verdict")
      return None, "unparseable verdict: " + json.dumps(result.text)[:200]
    return score, result.text or ""


def context_recall(question: Question, context: str) -> float | None:
  """1 if any normalised gold answer occurs in the normalised context;
  None for questions the history cannot answer (`is_abstention`), where
  there is no answer to look for."""
  if question.is_abstention:
    return None
  haystack = normalize_answer(context)
  golds = question.all_answers or (question.answer,)
  return float(any(normalize_answer(g) and normalize_answer(g) in haystack
                   for g in golds))
