"""The CMI-Mem reward a GRPO step is given (paper §3.3, Eq. 10-12, App. D;
SPEC §4.3-4.4), composed from the CMI estimate (`cmi.estimator`) and the
QA term (`task.qa_reward`).

Per rollout (one DSL response for a session `C_t` on a bank `M_{t-1}`):

1. Score every writing operation with the residual CMI of its fragment given
   its local conditioning set: add-like (ADD, MERGE, core APPEND)
   `s = max(0, rho(new))`; update-like (UPDATE, core REPLACE, core REWRITE)
   `s = rho(new) - rho(old)` (Eq. 10).
2. Shape `g(s) = exp(-(s - mu)^2 / (2 sigma^2))` (Eq. 11) and average
   (multi-item aggregation: mean). No scored operation: the empty-action
   value; malformed response: the format penalty.
3. `r = alpha·cmi + (1 - alpha)·r_QA` (Eq. 12), times the length, intra- and
   cross-duplication and core-specificity factors, plus the semantic-SKIP
   bonus; malformed responses get reward 0 (validity gate). The length
   factor is MemBuilder's (`length_penalty`): relative to the expert's
   response where fixed expert states give one, and only on a positive
   reward.
4. Attribution: the DSL lines of the memory type retrieved most while
   answering the session's QA get loss weight `attribution_weight`
   (`token_weights` turns them into per-token loss weights).

All operations of all rollouts go through one estimator call (one
`banked_rho` call). Every term is returned separately for logging.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import ml_collections
import numpy as np

from cmimem_jax.cmi.conditioning import ConditioningConfig
from cmimem_jax.cmi.estimator import (BankOperations, CMIEstimator,
                                      OperationTexts)
from cmimem_jax.cmi.logprob import ProfileLM, profile_messages
from cmimem_jax.config import Section, need
from cmimem_jax.data.fragments import user_statements
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.bank import MemoryBank, embed_texts
from cmimem_jax.memory.dsl import ParsedResponse
from cmimem_jax.memory.types import (ENTRY_TYPES, UPDATE_LIKE, Action,
                                     MemoryType, Operation)

DEFAULT_GENERIC_CORE_PATTERNS = (
    r"lifelong learner", r"enjoys? learning", r"loves? (to )?learn",
    r"curious (person|individual|mind)", r"open[- ]minded",
    r"values? (personal )?growth", r"passionate about life",
    r"likes? (helping|to help) others", r"friendly and helpful",
    r"positive attitude",
)


ESTIMATORS = ("residual", "cosine", "logprob")
LENGTH_REFERENCES = ("expert", "absolute")


@dataclasses.dataclass(frozen=True)
class RewardConfig(Section):
  """Every constant of SPEC §4.3-4.4 (defaults: Table 7, App. D)."""
  alpha: float = 0.3
  shaping: str = "gaussian"  # "gaussian" | "none" (ablation: raw s)
  # "residual": ρ on the local conditioning set (§3.3, the method);
  # "cosine": unconditional cos(e_C, e_new) for every operation (Table 9
  # "w. emb", our reading of it): both `cmi.estimator`; "logprob": App. E
  # (`cmi.logprob`), one Δ per rollout from a reference LM's Listing 8
  # profile.
  estimator: str = "residual"
  profile_max_new_tokens: int = 256  # Listing 8 profile length (logprob).
  mu: float = 0.35
  sigma: float = 0.15
  lam: float = 1e-4
  min_memories: int = 2
  conditioning: ConditioningConfig = ConditioningConfig()
  empty_action_value: float = -0.5
  format_penalty: float = -0.5
  length_weight: float = 0.8
  # What an entry type's length is judged against (`length_penalty`):
  # "expert": MemBuilder's ratio to the session's expert response where
  # one is known (fixed expert states), the absolute band otherwise;
  # "absolute": the band always.
  length_reference: str = "expert"
  core_tokens_low: float = 150.0
  core_tokens_high: float = 400.0
  chars_per_token: float = 4.0
  entry_chars_low: float = 300.0
  entry_chars_high: float = 900.0
  # MemBuilder's ratio bands (gamma_l, gamma_u, full penalty at the floor /
  # ceiling) and the smallest difference from the expert that counts.
  entry_ratio_low: float = 0.5
  entry_ratio_high: float = 1.3
  entry_ratio_floor: float = 0.2
  entry_ratio_ceiling: float = 2.0
  entry_min_diff_tokens: float = 200.0
  duplicate_cosine: float = 0.95
  intra_duplicate_weight: float = 0.3
  cross_duplicate_weight: float = 0.5
  core_specificity_weight: float = 0.3
  generic_core_patterns: tuple[str, ...] = DEFAULT_GENERIC_CORE_PATTERNS
  semantic_skip_bonus: float = 0.1
  # A semantic SKIP is justified when the session's user statements are
  # covered by the semantic store: at least `semantic_skip_coverage` of
  # them have a stored entry at cosine >= `semantic_skip_cosine` (their
  # nearest neighbour), or the user states nothing. Both are the encoder's
  # own, chosen by tools/skip_calibration.py on LoCoMo training
  # conversations (RESULTS.md "Semantic SKIP by coverage") and read from
  # the table `skip_calibration` names ("": the packaged one) by
  # `skip_table.calibrated`; None = not calibrated (no SKIP can be judged,
  # and training refuses to start).
  semantic_skip_cosine: float | None = None
  semantic_skip_coverage: float | None = None
  skip_calibration: str = ""
  attribution_weight: float = 4.0

  SECTION: ClassVar[str] = "reward"

  def invalid(self) -> Iterator[str]:
    for key in ("length_weight", "intra_duplicate_weight",
                "cross_duplicate_weight", "core_specificity_weight",
                "semantic_skip_bonus", "attribution_weight"):
      yield from need(self, key, lambda v: v >= 0,
                      ">= 0 (a penalty, bonus or attribution weight)")
    yield from need(self, "shaping", lambda v: v in ("gaussian", "none"),
                    "'gaussian' or 'none'")
    yield from need(self, "estimator", lambda v: v in ESTIMATORS,
                    f"one of {ESTIMATORS}")
    yield from need(self, "alpha", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
    for key in ("sigma", "lam", "chars_per_token"):
      yield from need(self, key, lambda v: v > 0, "> 0")
    yield from need(self, "entry_min_diff_tokens", lambda v: v >= 0, ">= 0")
    yield from need(self, "length_reference",
                    lambda v: v in LENGTH_REFERENCES,
                    f"one of {LENGTH_REFERENCES}")
    if not (0 < self.entry_ratio_floor < self.entry_ratio_low
            <= self.entry_ratio_high < self.entry_ratio_ceiling):
      yield ("entry_ratio_floor, entry_ratio_low, entry_ratio_high, "
             "entry_ratio_ceiling: must satisfy 0 < floor < low <= high < "
             "ceiling")
    if (self.semantic_skip_cosine is None) != (
        self.semantic_skip_coverage is None):
      yield ("semantic_skip_cosine, semantic_skip_coverage: set together (a "
             "calibration) or not at all")
    elif self.semantic_skip_cosine is not None:
      yield from need(self, "semantic_skip_cosine",
                      lambda v: 0 < v <= 1, "in (0, 1]")
      yield from need(self, "semantic_skip_coverage",
                      lambda v: 0 <= v <= 1, "in [0, 1]")

  @property
  def skip_calibrated(self) -> bool:
    return self.semantic_skip_cosine is not None


def reward_defaults() -> ml_collections.ConfigDict:
  """The `reward` config section with Table 7 / App. D values."""
  defaults = dataclasses.asdict(RewardConfig())
  defaults["conditioning"] = dataclasses.asdict(ConditioningConfig())
  defaults["generic_core_patterns"] = list(DEFAULT_GENERIC_CORE_PATTERNS)
  return ml_collections.ConfigDict(defaults)


def gaussian_shaping(score: np.ndarray | float, mu: float, sigma: float
                     ) -> np.ndarray:
  """Eq. 11: `exp(-(s - mu)^2 / (2 sigma^2))`, peak 1 at `s = mu`."""
  score = np.asarray(score, np.float64)
  return np.exp(-((score - mu) ** 2) / (2.0 * sigma * sigma))


def operation_score(action: Action, rho_new: float,
                    rho_old: float | None = None) -> float:
  """Eq. 9-10 routing. r̂ is clamped to [0, 1] (§3.3: a negative partial
  correlation is "actively misleading", not negative information); an
  update-like action with a target scores the net gain
  clamp(ρ_new) − clamp(ρ_old) ∈ [−1, 1]; add-like actions, and updates of
  an empty target (`rho_old` None: nothing was known before), clamp(ρ_new).
  """
  new = min(max(float(rho_new), 0.0), 1.0)
  if action in UPDATE_LIKE and rho_old is not None:
    return new - min(max(float(rho_old), 0.0), 1.0)
  return new


def length_excess(chars: int, memory_type: MemoryType,
                  config: RewardConfig) -> float:
  """ℓ of one written text in [0, 1] (App. D length penalty)."""
  if memory_type is MemoryType.CORE:
    value, low, high = (chars / config.chars_per_token, config.core_tokens_low,
                        config.core_tokens_high)
  else:
    value, low, high = chars, config.entry_chars_low, config.entry_chars_high
  return float(np.clip((value - low) / (high - low), 0.0, 1.0))


def written_chars(response: ParsedResponse) -> dict[MemoryType, int]:
  """Characters each memory type's writing operations put into memory
  (MemBuilder counts an operation's `memory` / `new_memory` text)."""
  chars = {memory_type: 0 for memory_type in MemoryType}
  for op in response.operations:
    if op.writes:
      chars[op.memory_type] += len(op.new_text)
  return chars


def relative_excess(chars: int, expert_chars: int,
                    config: RewardConfig) -> float:
  """MemBuilder's ℓ in [0, 1] of one entry type's written text against the
  expert's for the same session (`_compute_agent_length_penalty`,
  training/reward_server/reward_function.py L1021-1063 of
  Zh1yuShen/MemBuilder@422d053): 0 when the expert wrote nothing, when
  the two differ by fewer than `entry_min_diff_tokens` tokens, or when the
  ratio is within [gamma_l, gamma_u] = [0.5, 1.3]; rising linearly to 1 at
  the ceiling 2.0 (too long) or the floor 0.2 (too short).

  Both sides are counted in tokens ≈ characters / `chars_per_token`.
  MemBuilder counts the policy's text as characters // 4 (L1066-1093) but
  the expert's as characters (L1045), which judges equal texts of more
  than ~270 characters "too short" (ratio 0.25); we do not copy the mixed
  units.
  """
  if expert_chars <= 0:
    return 0.0
  tokens = chars / config.chars_per_token
  expert = expert_chars / config.chars_per_token
  if abs(tokens - expert) < config.entry_min_diff_tokens:
    return 0.0
  ratio = tokens / expert
  if ratio > config.entry_ratio_high:
    excess = ((ratio - config.entry_ratio_high)
              / (config.entry_ratio_ceiling - config.entry_ratio_high))
  elif ratio < config.entry_ratio_low:
    excess = ((config.entry_ratio_low - ratio)
              / (config.entry_ratio_low - config.entry_ratio_floor))
  else:
    return 0.0
  return float(min(1.0, excess))


# The expert response of a session that a run with fixed expert states has
# none for (each dialogue's last session, whose next state is never built;
# a session whose teacher response was rejected): scored as MemBuilder's
# reward scores a sample without `expert_output` (reward_function.py
# L1043-1048: no entry-type penalty; the core by its band), not by the
# absolute band, so one run's sessions share one formula.
NO_EXPERT_RESPONSE = ParsedResponse("", (), ())


def length_penalty(response: ParsedResponse, expert: ParsedResponse | None,
                   config: RewardConfig) -> float:
  """ℓ(M) of Eq. 15 for a valid response.

  With `length_reference="expert"` and an expert response (a run with
  fixed expert states; `NO_EXPERT_RESPONSE` for a session the teacher did
  not answer): MemBuilder's per-agent penalty averaged over the four
  agents (our one rollout is MemBuilder's four agent responses, and the
  mean of their rewards `r(1 - λ ℓ_τ)` is `r(1 - λ mean ℓ_τ)`; its
  `_compute_length_penalty`, L426-474, averages the same four): core by
  the absolute token band on what it writes (L1031-1040), each entry type
  by `relative_excess` (0 where the expert wrote nothing). Otherwise (a
  run without expert states, or "absolute"): the mean over the writing
  operations of `length_excess` (characters 300-900 for entries).
  """
  if config.length_reference == "expert" and expert is not None:
    chars = written_chars(response)
    expert_chars = written_chars(expert)
    per_type = [length_excess(chars[MemoryType.CORE], MemoryType.CORE, config)]
    per_type += [relative_excess(chars[t], expert_chars[t], config)
                 for t in ENTRY_TYPES]
    return float(np.mean(per_type))
  writes = [op for op in response.operations if op.writes]
  return (float(np.mean([length_excess(len(op.new_text), op.memory_type,
                                       config) for op in writes]))
          if writes else 0.0)


def skip_coverage(statement_cosines: np.ndarray, cosine: float) -> float:
  """The share of statements `[U]` whose nearest semantic entry is at
  cosine >= `cosine` (1.0 for none: the user states nothing)."""
  if not len(statement_cosines):
    return 1.0
  return float(np.mean(np.asarray(statement_cosines) >= cosine))


def normalize_text(text: str) -> str:
  """Lowercased words only: the "verbatim" test of the duplication rules."""
  return " ".join(re.findall(r"\w+", text.lower()))


@dataclasses.dataclass
class RolloutInput:
  """One rollout to score.

  Attributes:
    bank: `M_{t-1}` (shared object for the rollouts of one session).
    context: The session text `C_t` (embedded for `e_C`).
    response: The parsed DSL response.
    qa_reward: `r_QA` in [0, 1] from the QA judge (an input here).
    retrieval_counts: Per memory type, how often it was retrieved while
      answering the session's QA on `M_t` (for attribution); None = no
      attribution.
    bank_after: `M_t` (valid responses; the log-prob estimator needs it).
    user_turns: The session's user utterances, whose statements the
      semantic-SKIP judgement weighs; None = every line of `context`.
    expert: The expert's (teacher's) response for this session, from the
      fixed expert states (`snapshots.expert_responses`): the length
      reference; `NO_EXPERT_RESPONSE` for a session of such a run that
      the teacher did not answer; None = a run without expert states.
  """
  bank: MemoryBank
  context: str
  response: ParsedResponse
  qa_reward: float = 0.0
  retrieval_counts: Mapping[MemoryType, int] | None = None
  bank_after: MemoryBank | None = None
  user_turns: tuple[str, ...] | None = None
  expert: ParsedResponse | None = None

  def statements(self) -> list[str]:
    """What the user states in the session (`user_statements`)."""
    turns = (self.user_turns if self.user_turns is not None
             else _session_lines(self.context))
    return user_statements(turns)


@dataclasses.dataclass
class ScoredOperation:
  operation: Operation
  rho_new: float
  rho_old: float | None
  score: float
  shaped: float


@dataclasses.dataclass
class RewardTerms:
  """Every reward term of one rollout (all logged)."""
  valid: bool
  cmi: float
  qa: float
  base: float
  length_excess: float
  length_factor: float
  intra_duplicate_fraction: float
  intra_duplicate_factor: float
  cross_duplicate_fraction: float
  cross_duplicate_factor: float
  core_generic: bool
  core_specificity_factor: float
  semantic_skip_justified: bool | None
  # What the judgement compared (SKIPs): the share of the session's user
  # statements covered by the semantic store (1 when it states nothing).
  semantic_skip_coverage: float | None
  # Per user statement of the session (SKIPs): the cosine of its nearest
  # semantic entry (0 with an empty store).
  semantic_skip_statement_cosines: tuple[float, ...] | None
  semantic_skip_bonus: float
  total: float
  reward: float  # `total` gated by validity: what the advantage uses.
  empty: bool
  operations: list[ScoredOperation]
  line_weights: list[tuple[tuple[int, int], float]]
  dominant_type: MemoryType | None

  def scalars(self) -> dict[str, float]:
    """Numeric terms for metrics logging."""
    out = {}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, (bool, int, float)) and value is not None:
        out[field.name] = float(value)
    out["num_scored_operations"] = float(len(self.operations))
    out["semantic_skip"] = float(self.semantic_skip_justified is not None)
    return out


def _scored_operations(rollout: RolloutInput
                       ) -> list[tuple[Operation, str, str | None]]:
  """(op, new text, old text or None) for every operation the CMI scores."""
  scored = []
  for op in rollout.response.operations:
    if op.memory_type is MemoryType.CORE:
      if op.action is Action.APPEND:
        scored.append((op, op.new_text, None))
      elif op.action is Action.REPLACE:
        old, new = op.fields
        if old in rollout.bank.core:  # A REPLACE with no match is a no-op.
          scored.append((op, new, old))
      else:  # REWRITE: old is the previous block (none when it is empty).
        scored.append((op, op.new_text, rollout.bank.core or None))
    elif op.action in (Action.ADD, Action.MERGE):
      scored.append((op, op.new_text, None))
    elif op.action is Action.UPDATE:
      scored.append((op, op.new_text, op.old_texts[0]))
  return scored


def _operation_texts(scored: list[tuple[Operation, str, str | None]]
                     ) -> list[OperationTexts]:
  """What the estimator scores of each `_scored_operations` item: an entry
  UPDATE's or a core REPLACE's old text also steers its retrieval query
  (Eq. 17); a REWRITE's previous block is only scored."""
  return [OperationTexts(new, old, old is not None and op.action in (
      Action.UPDATE, Action.REPLACE)) for op, new, old in scored]


def _estimator_items(rollouts: Sequence[RolloutInput],
                     scored: list[list[tuple[Operation, str, str | None]]]
                     ) -> list[BankOperations]:
  """The rollouts' scored operations as the CMI estimator takes them."""
  return [BankOperations(r.bank, r.context, _operation_texts(ops))
          for r, ops in zip(rollouts, scored)]


def _session_lines(context: str) -> list[str]:
  """The session's turns (`speaker: text` lines of `Session.format`)."""
  return [line for line in context.splitlines() if line.strip()]


class RewardComputer:
  """Scores batches of rollouts; one estimator (`banked_rho`) call per
  batch."""

  def __init__(self, encoder: Encoder, config: RewardConfig = RewardConfig(),
               profile_lm: ProfileLM | None = None):
    if config.estimator == "logprob" and profile_lm is None:
      raise ValueError("reward.estimator='logprob' needs a reference LM "
                       "(`profile_lm`)")
    self.encoder = encoder
    self.config = config
    self.profile_lm = profile_lm
    self.estimator = CMIEstimator(
        encoder.dim, "cosine" if config.estimator == "cosine" else "residual",
        config.lam, config.conditioning, config.min_memories)
    self._generic = [re.compile(p, re.IGNORECASE)
                     for p in config.generic_core_patterns]

  def __call__(self, rollouts: Sequence[RolloutInput]) -> list[RewardTerms]:
    return self.compute(rollouts)

  def operation_rhos(
      self, items: Sequence[tuple[MemoryBank, str, Sequence[Operation]]]
  ) -> list[list[tuple[float, float | None]]]:
    """`(rho(new), rho(old) or None)` of arbitrary operations, each on its
    bank `M_{t-1}` and session text, with this computer's estimator
    (residual or cosine), batched as in a training step (one kernel call):
    what a rollout writing that operation would be scored with, before
    shaping. Operations need not form a valid response."""
    if self.config.estimator == "logprob":
      raise ValueError("operation_rhos scores single operations; the "
                       "logprob estimator scores whole memory states")
    rollouts = [RolloutInput(bank, context, ParsedResponse("", tuple(ops), ()))
                for bank, context, ops in items]
    scored = [_scored_operations(r) for r in rollouts]
    estimated = _estimator_items(rollouts, scored)
    ordered = sorted(self.estimator.texts(estimated))
    embeddings = dict(zip(ordered, embed_texts(self.encoder, ordered)))
    rhos = self.estimator.rho(estimated, embeddings)
    return [[(new, old if old_text is not None else None)
             for (new, old), (_, _, old_text) in zip(rho, ops)]
            for rho, ops in zip(rhos, scored)]

  def _logprob_rho(self, rollouts: Sequence[RolloutInput],
                   scored: list[list[tuple[Operation, str, str | None]]]
                   ) -> list[list[tuple[float, float]]]:
    """App. E: the profile gain of each rollout with scored operations,
    given to each of its operations (one batched `profile_gain` call)."""
    which = [i for i, ops in enumerate(scored) if ops]
    results: list[list[tuple[float, float]]] = [[] for _ in rollouts]
    if not which:
      return results
    missing = [i for i in which if rollouts[i].bank_after is None]
    if missing:
      raise ValueError(f"rollouts {missing} lack bank_after (M_t), which "
                       "the logprob estimator scores")
    gains = self.profile_lm.profile_gain(
        [profile_messages(rollouts[i].bank, rollouts[i].context)
         for i in which],
        [profile_messages(rollouts[i].bank_after, rollouts[i].context)
         for i in which])
    for i, gain in zip(which, np.asarray(gains, np.float64)):
      results[i] = [(float(gain), float("nan"))] * len(scored[i])
    return results

  @staticmethod
  def _statement_cosines(rollouts: Sequence[RolloutInput],
                         embeddings: dict[str, np.ndarray], which: list[int]
                         ) -> dict[int, np.ndarray]:
    """For the rollouts `which` (those that SKIP semantic, SPEC §4.4): the
    cosine `[U]` of each statement u the user makes in the session to its
    nearest entry of the semantic store `M_{t-1}` (0 for an empty store).
    Statements are clauses of the user's turns that are not questions
    (App. B's SKIP is for content that is not user-specific, or already
    fully captured); a session of common-knowledge questions has none."""
    out = {}
    for i in which:
      statements = rollouts[i].statements()
      stored = rollouts[i].bank.vectors(MemoryType.SEMANTIC)
      if not statements or not len(stored):
        out[i] = np.zeros(len(statements), np.float32)
        continue
      vectors = np.stack([embeddings[u] for u in statements])
      unit = lambda x: x / np.maximum(  # noqa: E731
          np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
      out[i] = (unit(vectors) @ unit(stored).T).max(axis=1).astype(np.float32)
    return out

  # -- per-rollout terms ---------------------------------------------------

  def compute(self, rollouts: Sequence[RolloutInput]) -> list[RewardTerms]:
    """Reward terms for each rollout, in order."""
    scored = [_scored_operations(r) if r.response.valid else []
              for r in rollouts]
    items = _estimator_items(rollouts, scored)
    texts = self.estimator.texts(items)
    entry_texts = {op.new_text for r in rollouts if r.response.valid
                   for op in r.response.operations
                   if op.memory_type is not MemoryType.CORE and op.writes}
    texts |= entry_texts
    skips = [i for i, r in enumerate(rollouts) if r.response.valid and any(
        op.memory_type is MemoryType.SEMANTIC and not op.writes
        for op in r.response.operations)]
    for i in skips:
      texts.update(rollouts[i].statements())
    ordered = sorted(texts)
    embeddings = dict(zip(ordered, embed_texts(self.encoder, ordered)))
    if self.config.estimator == "logprob":
      # One Δ per rollout: scored as an addition (no per-op old text).
      scored = [[(op, new, None) for op, new, _ in ops] for ops in scored]
      rhos = self._logprob_rho(rollouts, scored)
    else:
      rhos = self.estimator.rho(items, embeddings)
    if skips and not self.config.skip_calibrated:
      raise ValueError("a semantic SKIP needs the encoder's calibration "
                       "(reward.semantic_skip_cosine / _coverage: "
                       "skip_table.calibrated)")
    skip_cosines = self._statement_cosines(rollouts, embeddings, skips)
    # Eq. 16: the slot retrieved most often while answering, counted over
    # the whole batch (valid rollouts), is dominant for every rollout.
    batch_counts: collections.Counter[MemoryType] = collections.Counter()
    for rollout in rollouts:
      if rollout.response.valid:
        batch_counts.update(rollout.retrieval_counts or {})
    dominant = self._dominant_type(batch_counts)
    return [self._terms(r, scored[i], rhos[i], embeddings,
                        skip_cosines.get(i), dominant)
            for i, r in enumerate(rollouts)]

  def _terms(self, rollout: RolloutInput,
             scored: list[tuple[Operation, str, str | None]],
             rhos: list[tuple[float, float]],
             embeddings: dict[str, np.ndarray],
             statement_cosines: np.ndarray | None,
             batch_dominant: MemoryType | None) -> RewardTerms:
    config = self.config
    response = rollout.response
    operations = []
    for (op, _, old_text), (rho_new, rho_old) in zip(scored, rhos):
      score = operation_score(op.action, rho_new,
                              None if old_text is None else rho_old)
      shaped = (float(gaussian_shaping(score, config.mu, config.sigma))
                if config.shaping == "gaussian" else score)
      operations.append(ScoredOperation(
          op, rho_new, None if old_text is None else rho_old, score, shaped))
    valid = response.valid
    empty = valid and not operations
    if not valid:
      cmi = config.format_penalty
    elif empty:
      cmi = config.empty_action_value
    else:
      cmi = float(np.mean([s.shaped for s in operations]))
    base = config.alpha * cmi + (1.0 - config.alpha) * rollout.qa_reward

    writes = [op for op in response.operations if op.writes] if valid else []
    excess = length_penalty(response, rollout.expert, config) if valid else 0.0
    # Table 7 "dup-add": only additions can duplicate (an UPDATE or MERGE
    # that restates its target is a revision, not a copy).
    adds = [op for op in writes if op.action in (Action.ADD, Action.APPEND)]
    intra = self._intra_duplicate_fraction(adds, embeddings)
    cross = self._cross_duplicate_fraction(rollout.bank, adds, embeddings)
    core_generic = any(pattern.search(op.new_text) for op in writes
                       if op.memory_type is MemoryType.CORE
                       for pattern in self._generic)
    # Justified when the store already covers what the user states.
    coverage = (None if statement_cosines is None else
                skip_coverage(statement_cosines, config.semantic_skip_cosine))
    justified = (None if coverage is None
                 else coverage >= config.semantic_skip_coverage)
    skip_bonus = (0.0 if justified is None else
                  config.semantic_skip_bonus if justified
                  else -config.semantic_skip_bonus)
    factors = {
        # MemBuilder shortens positive rewards only (reward_function.py
        # L714): a negative one times (1 - λℓ) would reward verbosity.
        "length": 1.0 - config.length_weight * excess if base > 0 else 1.0,
        "intra": 1.0 - config.intra_duplicate_weight * intra,
        "cross": 1.0 - config.cross_duplicate_weight * cross,
        "core": 1.0 - config.core_specificity_weight * core_generic,
    }
    total = base * math.prod(factors.values()) + skip_bonus
    dominant = batch_dominant if valid else None
    line_weights = [
        (op.span, config.attribution_weight if op.memory_type is dominant
         else 1.0) for op in response.operations if op.span is not None]
    return RewardTerms(
        valid=valid, cmi=cmi, qa=rollout.qa_reward, base=base,
        length_excess=excess, length_factor=factors["length"],
        intra_duplicate_fraction=intra, intra_duplicate_factor=factors["intra"],
        cross_duplicate_fraction=cross, cross_duplicate_factor=factors["cross"],
        core_generic=core_generic, core_specificity_factor=factors["core"],
        semantic_skip_justified=justified,
        semantic_skip_coverage=coverage,
        semantic_skip_statement_cosines=(
            None if statement_cosines is None
            else tuple(float(x) for x in statement_cosines)),
        semantic_skip_bonus=skip_bonus,
        total=total, reward=total if valid else 0.0, empty=empty,
        operations=operations, line_weights=line_weights,
        dominant_type=dominant)

  def _is_duplicate(self, text: str, vector: np.ndarray, others_text: set[str],
                    others: np.ndarray) -> bool:
    if normalize_text(text) in others_text:
      return True
    return bool(len(others) and np.max(others @ vector)
                >= self.config.duplicate_cosine)

  def _intra_duplicate_fraction(self, writes: list[Operation],
                                embeddings: dict[str, np.ndarray]) -> float:
    """Share of additions that repeat an earlier one of the response."""
    if not writes:
      return 0.0
    duplicates, seen_text, seen = 0, set(), []
    for op in writes:
      vector = embeddings[op.new_text]
      duplicates += self._is_duplicate(op.new_text, vector, seen_text,
                                       np.asarray(seen).reshape(-1, len(vector)))
      seen_text.add(normalize_text(op.new_text))
      seen.append(vector)
    return duplicates / len(writes)

  def _cross_duplicate_fraction(self, bank: MemoryBank,
                                writes: list[Operation],
                                embeddings: dict[str, np.ndarray]) -> float:
    """Share of additions that repeat what `M_{t-1}` holds: an entry (text
    or cosine) or, verbatim, a line of the core block."""
    if not writes:
      return 0.0
    stored_text = {normalize_text(e.text) for e in bank.entries()}
    stored_text |= {normalize_text(line) for line in bank.core.splitlines()}
    stored_text.discard("")
    stored = bank.vectors()
    return sum(self._is_duplicate(op.new_text, embeddings[op.new_text],
                                  stored_text, stored)
               for op in writes) / len(writes)

  @staticmethod
  def _dominant_type(counts: Mapping[MemoryType, int] | None
                     ) -> MemoryType | None:
    if not counts or max(counts.values()) <= 0:
      return None
    # Ties go to the earlier type (episodic, semantic, procedural).
    return max(ENTRY_TYPES, key=lambda t: (counts.get(t, 0),
                                           -ENTRY_TYPES.index(t)))


def token_weights(token_offsets: Sequence[tuple[int, int]],
                  line_weights: Sequence[tuple[tuple[int, int], float]]
                  ) -> np.ndarray:
  """Per-token loss weights from per-line weights.

  Args:
    token_offsets: `[T]` character spans of the response tokens.
    line_weights: `(span, weight)` per DSL line (`RewardTerms.line_weights`).

  Returns:
    `[T]` float32: a token takes the weight of the line it overlaps most
    (the first such line on a tie), 1.0 if none (blank lines, think
    blocks). Lines in text order (sorted, disjoint spans, as a response's
    lines are) are found by binary search, O(T log lines).
  """
  weights = np.ones(len(token_offsets), np.float32)
  if not len(token_offsets) or not line_weights:
    return weights
  lines = np.asarray([span for span, _ in line_weights], np.int64)
  values = np.asarray([w for _, w in line_weights], np.float32)
  starts, ends = lines[:, 0], lines[:, 1]
  if np.any(starts[1:] < ends[:-1]) or np.any(ends < starts):
    return _token_weights_any_order(token_offsets, line_weights)
  tokens = np.asarray(token_offsets, np.int64).reshape(-1, 2)
  # The lines a token can overlap: ending after its start, starting before
  # its end (a run of consecutive lines, usually one or two).
  first = np.searchsorted(ends, tokens[:, 0], side="right")
  stop = np.searchsorted(starts, tokens[:, 1], side="left")
  best = np.zeros(len(tokens), np.int64)
  for k in range(int((stop - first).max(initial=0))):
    line = first + k
    inside = line < stop
    line = np.minimum(line, len(lines) - 1)
    overlap = (np.minimum(tokens[:, 1], ends[line])
               - np.maximum(tokens[:, 0], starts[line]))
    better = inside & (overlap > best)
    best = np.where(better, overlap, best)
    weights = np.where(better, values[line], weights)
  return weights.astype(np.float32)


def _token_weights_any_order(
    token_offsets: Sequence[tuple[int, int]],
    line_weights: Sequence[tuple[tuple[int, int], float]]) -> np.ndarray:
  """`token_weights` for lines in any order: every (token, line) pair."""
  weights = np.ones(len(token_offsets), np.float32)
  for t, (start, end) in enumerate(token_offsets):
    best = 0
    for (line_start, line_end), weight in line_weights:
      overlap = min(end, line_end) - max(start, line_start)
      if overlap > best:
        best, weights[t] = overlap, weight
  return weights
