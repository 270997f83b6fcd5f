"""CMI-Mem episodes: one training session `C_t` with its memory state
`M_{t-1}` — applying a response to a copy of the state, scoring a group
of rollouts (CMI terms + QA reward), and attribution token weights
(Alg. 1, SPEC §4.4, §5). The policy's prompt for an episode is
`memory.PolicyPrompter`'s, as everywhere else."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from cmimem_jax.data.types import Dialogue, Question, Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.apply import MemoryEditors, apply_response
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import (MemoryConfig, core_config,
                                      count_model_edits)
from cmimem_jax.memory.dsl import ParsedResponse, parse
from cmimem_jax.task.qa_reward import PendingQA, QAReward
from cmimem_jax.task.reward import (RewardComputer, RewardTerms, RolloutInput,
                                    token_weights)


@dataclasses.dataclass(frozen=True)
class Episode:
  dialogue: Dialogue
  session: Session
  bank: MemoryBank                  # M_{t-1}.
  questions: tuple[Question, ...]   # The session's QA pairs.
  # The expert's response for the session (fixed expert states): the
  # length penalty's reference; None = none known.
  expert: ParsedResponse | None = None


def session_questions(dialogue: Dialogue, session: Session
                      ) -> tuple[Question, ...]:
  """The per-session QA pairs (`session_qa`) whose evidence is `session`."""
  return tuple(q for q in dialogue.questions
               if q.evidence_sessions == (session.session_id,))


# Every token's own text, one string per token, in one call.
DecodeEach = Callable[[Sequence[int]], list[str]]


def apply_to_copy(bank: MemoryBank, session: Session, response: ParsedResponse,
                  encoder: Encoder, memory: MemoryConfig,
                  editors: MemoryEditors = MemoryEditors(),
                  stats: collections.Counter[str] | None = None
                  ) -> MemoryBank:
  """`M_t` = Apply(M_{t-1}, response); the input bank is never mutated.
  What the model rewrites did is added to `stats`."""
  bank, report = apply_response(
      bank, response, encoder, session_index=session.index,
      turn_ids=tuple(t.turn_id for t in session.turns),
      core_config=core_config(memory), editors=editors,
      update_match_threshold=memory.update_match_threshold)
  if stats is not None:
    count_model_edits(stats, report)
  return bank


class RolloutScorer:
  """Scores one step's rollouts with every endpoint call in flight.

  `add` parses each response, applies it to a copy of its episode's state
  and sends its QA calls (`QAReward.submit`: answers at once, each judged
  as it arrives) before taking the next; it may be called several times
  (e.g. once per decoding wave). `finish` waits for the calls and scores
  the whole step with one CMI-kernel call. Parsing, applying (with its
  core compressions and MERGE summaries) and retrieval run on the calling
  thread in row order, so the memory editors' calls keep their order; only
  the answer and judge calls overlap, each endpoint under its own
  `concurrency`. The result equals scoring the rows one after another.
  """

  def __init__(self, encoder: Encoder, memory: MemoryConfig, qa: QAReward,
               computer: RewardComputer,
               editors: MemoryEditors = MemoryEditors(),
               stats: collections.Counter[str] | None = None):
    self.encoder, self.memory, self.qa = encoder, memory, qa
    self.computer, self.editors, self.stats = computer, editors, stats
    self._rows: list[tuple[Episode, ParsedResponse, MemoryBank | None,
                           PendingQA | None]] = []

  def add(self, episodes: Sequence[Episode], texts: Sequence[str],
          group_size: int) -> None:
    """`group_size` responses per episode (row `e·N + i` is rollout i of
    episode e), appended after the rows already added."""
    if len(texts) != len(episodes) * group_size:
      raise ValueError(f"{len(texts)} responses for {len(episodes)} episodes "
                       f"x {group_size}")
    for row, text in enumerate(texts):
      episode = episodes[row // group_size]
      response = parse(text)
      after = pending = None
      if response.valid:
        after = apply_to_copy(episode.bank, episode.session, response,
                              self.encoder, self.memory, self.editors,
                              self.stats)
        pending = self.qa.submit(after, episode)
      self._rows.append((episode, response, after, pending))

  def finish(self) -> tuple[list[ParsedResponse], list[RewardTerms]]:
    """Waits for every row's QA calls; the parsed responses and reward
    terms of the rows in the order they were added."""
    rows, self._rows = self._rows, []
    rollouts = []
    for episode, response, after, pending in rows:
      qa_reward, counts = (0.0, None) if pending is None else pending.wait()
      rollouts.append(RolloutInput(episode.bank, episode.session.format(),
                                   response, qa_reward, counts, after,
                                   episode.session.user_turns(),
                                   episode.expert))
    return [r[1] for r in rows], self.computer(rollouts)


def score_rollouts(episodes: Sequence[Episode], texts: Sequence[str],
                   group_size: int, encoder: Encoder, memory: MemoryConfig,
                   qa: QAReward, computer: RewardComputer,
                   editors: MemoryEditors = MemoryEditors(),
                   stats: collections.Counter[str] | None = None
                   ) -> tuple[list[ParsedResponse], list[RewardTerms]]:
  """Parses, applies and scores `group_size` responses per episode (row
  `e·N + i` is rollout i of episode e) with a `RolloutScorer`: every QA
  call in flight together; the CMI terms of the whole batch go through the
  kernel in one call. Core compressions and MERGE summaries are counted in
  `stats`."""
  scorer = RolloutScorer(encoder, memory, qa, computer, editors, stats)
  scorer.add(episodes, texts, group_size)
  return scorer.finish()


def token_char_offsets(decode: Callable[[list[int]], str],
                       tokens: Sequence[int],
                       decode_each: DecodeEach | None = None
                       ) -> list[tuple[int, int]]:
  """Character span of each token in `decode(tokens)`: where the text of
  `decode(tokens[:t + 1])` ends, never moving back (a multi-byte piece
  gets the span where its text appears), as `prefix_char_offsets`
  computes it, in time linear in the response.

  Incremental detokenization: the text since the last token boundary where
  the text was complete (no trailing U+FFFD, the mark of a character
  whose bytes are still arriving) is decoded alone and appended to the
  length up to there, so a token costs a decode of a few tokens, or
  nothing where `decode_each` (every token's own text, in one call:
  `ChatPolicy.decode_each`) already has it. Exact for a decoder that
  concatenates at those boundaries (byte-level BPE without clean-up:
  Qwen3's, SmolLM2's); the total length is checked against one whole
  decode, and another decoder gets `prefix_char_offsets`.
  """
  pieces = decode_each(tokens) if decode_each is not None and tokens else None
  spans, previous = [], 0
  anchor, anchor_chars = 0, 0  # tokens[:anchor] decode to anchor_chars.
  for t in range(len(tokens)):
    piece = (pieces[t] if pieces is not None and anchor == t
             else decode(list(tokens[anchor:t + 1])))
    end = anchor_chars + len(piece)
    spans.append((previous, max(previous, end)))
    previous = max(previous, end)
    if not piece.endswith("\ufffd"):
      anchor, anchor_chars = t + 1, end
  if tokens and anchor_chars + len(decode(list(tokens[anchor:]))) != len(
      decode(list(tokens))):
    return prefix_char_offsets(decode, tokens)
  return spans


def prefix_char_offsets(decode: Callable[[list[int]], str],
                        tokens: Sequence[int]) -> list[tuple[int, int]]:
  """`token_char_offsets` by decoding every prefix (quadratic: 7 s for
  6,000 tokens): for any decoder, and the tests' oracle."""
  spans, previous = [], 0
  for t in range(len(tokens)):
    end = len(decode(list(tokens[:t + 1])))
    spans.append((previous, max(previous, end)))
    previous = max(previous, end)
  return spans


def attribution_weights(terms: RewardTerms, decode: Callable[[list[int]], str],
                        tokens: Sequence[int], width: int,
                        decode_each: DecodeEach | None = None) -> np.ndarray:
  """`[width]` loss weights of a completion's tokens (1 past its end);
  `decode_each` as in `token_char_offsets`."""
  weights = np.ones(width, np.float32)
  if tokens:
    weights[:len(tokens)] = token_weights(
        token_char_offsets(decode, tokens, decode_each), terms.line_weights)
  return weights
