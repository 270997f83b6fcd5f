"""The scoring stage's rounds of endpoint calls, as
`task.episode.RolloutScorer` sends them: the model `tools/plan.py --run`
costs a step's rewards with and `tools/scoring_check.py` checks against a
measured step."""

from __future__ import annotations

from typing import Any


def endpoint_concurrency(config: Any, concurrency: int = 0
                         ) -> tuple[int, int]:
  """(answer, judge) calls in flight at their endpoints: `concurrency`
  for both, or the config's `qa.answer` / `qa.judge_endpoint`."""
  qa = config.qa
  if concurrency:
    return concurrency, concurrency
  return qa.answer.concurrency, qa.judge_endpoint.concurrency


def endpoint_rounds(config: Any, rollouts: int, questions: int,
                    concurrency: int = 0) -> int:
  """Rounds of endpoint calls in a step's scoring stage
  (`task.episode.RolloutScorer`): every rollout's answer calls are sent
  at once, at most `concurrency` in flight per endpoint
  (`endpoint_concurrency`), and each answer's judge call as soon as it
  arrives, so N = rollouts x questions answers take ceil(N / C_answer)
  rounds and the verdicts end one round after the last answer (or, with
  a slower judge, ceil(N / C_judge) rounds after the first): ceil(N /
  min(C_answer, C_judge)) + 1. Every rollout valid (an invalid one asks
  nothing). 0 without the LLM judge."""
  if config.qa.judge != "llm":
    return 0
  return -(-rollouts * questions // min(endpoint_concurrency(
      config, concurrency))) + 1
