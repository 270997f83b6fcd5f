"""The scoring stage's rounds of endpoint calls, as
`task.episode.RolloutScorer` sends them, and what of them the decoding
hides when each wave is scored as it is decoded: the model `tools/plan.py
--run` costs a step's rewards with and `tools/scoring_check.py` checks
against measured steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Only the hints: this module stays import-free.
  from cmimem_jax.task.qa_reward import QAConfig


def call_rounds(calls: int, concurrency: int) -> int:
  """Rounds of endpoint calls for `calls` answers sent at once with each
  verdict asked as soon as its answer arrives
  (`task.episode.RolloutScorer`), at most `concurrency` in flight at the
  slower endpoint: ceil(calls / concurrency) rounds of answers, the last
  verdicts a round later; 0 for no calls."""
  return -(-calls // concurrency) + 1 if calls else 0


def scoring_after_decoding(wave_calls: Sequence[int], concurrency: int,
                           latency_s: float, wave_s: float,
                           beside: bool = True) -> float:
  """Seconds a step's endpoint calls outlast its last decoding wave, when
  wave w's `wave_calls[w]` calls are sent as it is decoded, `wave_s` after
  wave w - 1's (`rl.GRPOStep` with `score_beside_decoding`), into
  endpoints that keep `concurrency` calls in flight for the whole step.

  The endpoints work through the calls in the order they were sent, so
  the last verdict comes when, for some wave w, the calls sent from wave
  w on have all been served one after another since w arrived: at
  max over w of [t_w + call_rounds(calls of waves w.., C) x L], with
  t_w = (w + 1) x wave_s. Less the last wave's arrival t_W, what remains
  after decoding is

      max over w of [call_rounds(calls of waves w.., C) x L
                     - (W - 1 - w) x wave_s]

  (w = W - 1: the last wave's own calls alone), at least 0. The calls of
  waves that end early enough are hidden behind the later waves'
  decoding; a backlog that outlives them shows. `beside=False` (every
  wave scored after the last): all the calls' rounds."""
  if not beside:
    return call_rounds(sum(wave_calls), concurrency) * latency_s
  waves = len(wave_calls)
  return max([0.0] + [
      call_rounds(sum(wave_calls[w:]), concurrency) * latency_s
      - (waves - 1 - w) * wave_s for w in range(waves)])


def endpoint_concurrency(qa: QAConfig, concurrency: int = 0
                         ) -> tuple[int, int]:
  """(answer, judge) calls in flight at their endpoints: `concurrency`
  for both, or the `qa` section's `answer` / `judge_endpoint`'s."""
  if concurrency:
    return concurrency, concurrency
  return qa.answer.concurrency, qa.judge_endpoint.concurrency


def endpoint_rounds(qa: QAConfig, rollouts: int, questions: int,
                    concurrency: int = 0) -> int:
  """Rounds of endpoint calls of `rollouts` rollouts' scoring all at once
  (`task.episode.RolloutScorer`): every rollout's answer calls are sent
  at once, at most `concurrency` in flight per endpoint
  (`endpoint_concurrency`), and each answer's judge call as soon as it
  arrives, so N = rollouts x questions answers take ceil(N / C_answer)
  rounds and the verdicts end one round after the last answer (or, with
  a slower judge, ceil(N / C_judge) rounds after the first): ceil(N /
  min(C_answer, C_judge)) + 1 (`call_rounds`). Every rollout valid (an
  invalid one asks nothing). 0 without the LLM judge (`qa.judge`)."""
  if qa.judge != "llm":
    return 0
  return call_rounds(rollouts * questions,
                     min(endpoint_concurrency(qa, concurrency)))
