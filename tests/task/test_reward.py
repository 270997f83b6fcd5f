import math

import ml_collections
import numpy as np
import pytest

from cmimem_jax.cmi import banked_rho
from cmimem_jax.task.reward import (NO_EXPERT_RESPONSE, RewardComputer,
                                    RewardConfig, RolloutInput,
                                    gaussian_shaping, operation_score,
                                    reward_defaults, token_weights)
from cmimem_jax.task.skip_table import calibrated
from cmimem_jax.data.fragments import user_statements
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.encoders.neural import MiniLMEncoder, minilm_directory
from cmimem_jax.memory import (Action, MemoryBank, MemoryType, Operation,
                               apply_operations, parse)

ENCODER = HashingEncoder(256)
# Coverage thresholds for the tests' hashing encoder (not a calibration:
# configs read theirs from task.skip_table).
SKIP_RULE = {"semantic_skip_cosine": 0.5, "semantic_skip_coverage": 0.5}
CALIBRATED = RewardConfig(**SKIP_RULE)
CONTEXT = "user: I adopted a beagle named Rex and I walk him every morning"
SKIPS = "EPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP"


def _cos(a, b):
  va, vb = ENCODER.encode([a, b])
  return float(va @ vb)


def _g(s):
  return float(gaussian_shaping(s, 0.35, 0.15))


def _score(text, bank=None, qa=0.0, counts=None, config=CALIBRATED):
  bank = bank if bank is not None else MemoryBank("u", ENCODER.dim)
  rollout = RolloutInput(bank, CONTEXT, parse(text), qa, counts)
  (terms,) = RewardComputer(ENCODER, config)([rollout])
  return terms


def _bank(*texts, memory_type=MemoryType.SEMANTIC):
  bank = MemoryBank("u", ENCODER.dim)
  bank, _ = apply_operations(bank, [Operation(memory_type, Action.ADD, (t,))
                                    for t in texts], ENCODER, session_index=0)
  return bank


def test_shaping_and_routing():
  assert _g(0.35) == 1.0
  assert _g(0.5) == pytest.approx(math.exp(-0.5))
  assert _g(0.05) == pytest.approx(math.exp(-2.0))
  assert operation_score(Action.ADD, -0.4, 0.9) == 0.0
  assert operation_score(Action.MERGE, 0.6, 0.9) == 0.6
  assert operation_score(Action.APPEND, 0.6, 0.0) == 0.6
  assert operation_score(Action.UPDATE, 0.3, 0.5) == pytest.approx(-0.2)
  assert operation_score(Action.REPLACE, 0.5, 0.1) == pytest.approx(0.4)
  assert operation_score(Action.REWRITE, 0.5, 0.5) == 0.0
  # §3.3 clamps r̂ to [0, 1] before Eq. 10, so a net gain is in [-1, 1].
  assert operation_score(Action.UPDATE, -0.8, 0.9) == pytest.approx(-0.9)
  assert operation_score(Action.UPDATE, 0.5, -0.7) == pytest.approx(0.5)
  assert operation_score(Action.REPLACE, -1.0, 1.0) == -1.0
  # No old target (a REWRITE of an empty core): scored as an add.
  assert operation_score(Action.REWRITE, 0.4, None) == pytest.approx(0.4)
  assert operation_score(Action.REWRITE, -0.4, None) == 0.0


def test_rewrite_of_an_empty_core_is_scored_as_new_information():
  terms = _score("CORE:REWRITE|Owns a beagle named Rex\nEPISODIC:SKIP\n"
                 "SEMANTIC:SKIP\nPROCEDURAL:SKIP")
  (scored,) = terms.operations
  assert scored.rho_old is None
  assert scored.score == pytest.approx(
      max(0.0, _cos(CONTEXT, "Owns a beagle named Rex")), abs=1e-6)


def test_empty_bank_uses_cosine_and_composes_exactly():
  core, event = "Owns a beagle named Rex", "2024-03-01: adopted Rex the beagle"
  terms = _score(f"CORE:APPEND|{core}\nEPISODIC:ADD|{event}\n"
                 "SEMANTIC:SKIP\nPROCEDURAL:SKIP", qa=0.6)
  scores = [max(0.0, _cos(CONTEXT, core)), max(0.0, _cos(CONTEXT, event))]
  assert [o.score for o in terms.operations] == pytest.approx(scores, abs=1e-6)
  cmi = np.mean([_g(s) for s in scores])
  assert terms.cmi == pytest.approx(cmi, abs=1e-6)
  assert terms.base == pytest.approx(0.3 * cmi + 0.7 * 0.6, abs=1e-6)
  # No semantic store: the session is fully novel, so SKIP is unjustified.
  assert terms.semantic_skip_justified is False
  assert terms.semantic_skip_bonus == -0.1
  assert (terms.length_factor, terms.intra_duplicate_factor,
          terms.cross_duplicate_factor, terms.core_specificity_factor) == (
              1.0, 1.0, 1.0, 1.0)
  assert terms.total == pytest.approx(terms.base - 0.1, abs=1e-6)
  assert terms.reward == terms.total and terms.valid


def test_format_penalty_and_validity_gate():
  terms = _score("CORE:APPEND|x\nEPISODIC:ADD|y", qa=1.0)
  assert not terms.valid and terms.cmi == -0.5
  assert terms.total == pytest.approx(0.3 * -0.5 + 0.7 * 1.0)
  assert terms.reward == 0.0 and terms.operations == []


def test_empty_action_value():
  bank = _bank("Rex - Pet: beagle")
  bank.core = "Likes tea"
  terms = _score(f"CORE:REPLACE|Likes coffee|Likes water\n{SKIPS}", bank=bank,
                 qa=0.5, config=RewardConfig(semantic_skip_bonus=0.0, **SKIP_RULE))
  assert terms.empty and terms.cmi == -0.5 and terms.operations == []
  assert terms.total == pytest.approx(0.3 * -0.5 + 0.7 * 0.5)


def test_update_like_scores_net_gain_on_the_local_set():
  old = "Rex - Pet: a dog"
  bank = _bank(old, "Rex - Walks: every morning", "Ana - Job: nurse",
               "Ana - City: Oslo")
  new = "Rex - Pet: a three year old beagle adopted in March"
  terms = _score(f"CORE:APPEND|Has a dog\nEPISODIC:SKIP\n"
                 f"SEMANTIC:UPDATE|{old}|{new}\nPROCEDURAL:SKIP", bank=bank)
  update = terms.operations[1]
  # Recompute rho(new), rho(old) directly with the banked kernel.
  vectors = bank.stores[MemoryType.SEMANTIC].vectors
  ctx, e_new, e_old = ENCODER.encode([CONTEXT, new, old])
  rho_new, rho_old, _, mask = banked_rho(
      vectors[None], np.ones((1, 4), bool), -np.ones((1, 2), int), ctx[None],
      e_new[None, None], e_old[None, None], np.ones((1, 1), bool))
  assert int(np.asarray(mask).sum()) == 4  # All four entries, no episodic.
  assert update.rho_new == pytest.approx(float(rho_new[0, 0]), abs=1e-6)
  assert update.rho_old == pytest.approx(float(rho_old[0, 0]), abs=1e-6)
  assert update.score == pytest.approx(update.rho_new - update.rho_old)
  assert update.shaped == pytest.approx(_g(update.score))


def test_rewrite_scores_against_previous_block():
  bank = MemoryBank("u", ENCODER.dim)
  bank.core = "Ana is a nurse in Oslo"
  terms = _score(f"CORE:REWRITE|Ana, nurse in Oslo, owns Rex the beagle\n{SKIPS}",
                 bank=bank)
  (op,) = terms.operations
  # Empty entry store: cosine fallback for both texts.
  assert op.rho_new == pytest.approx(
      _cos(CONTEXT, "Ana, nurse in Oslo, owns Rex the beagle"), abs=1e-6)
  assert op.rho_old == pytest.approx(_cos(CONTEXT, "Ana is a nurse in Oslo"),
                                     abs=1e-6)


def test_core_lines_are_in_the_conditioning_set():
  # §3.3: M_local ⊂ M_{t-1} includes the core, so re-appending a core fact
  # is discounted (no entries here: without the core it was the cosine
  # fallback).
  lines = ["Owns a beagle named Rex", "Walks Rex every morning",
           "Works as a nurse in Oslo"]
  bank = MemoryBank("u", ENCODER.dim)
  bank.core = "\n".join(lines) + "\n"
  (op,) = _score(f"CORE:APPEND|{lines[0]}\n{SKIPS}", bank=bank).operations
  pool = ENCODER.encode(lines)
  ctx, e_new = ENCODER.encode([CONTEXT, lines[0]])
  rho_new, _, _, mask = banked_rho(
      pool[None], np.ones((1, 3), bool), -np.ones((1, 2), int), ctx[None],
      e_new[None, None], e_new[None, None], np.zeros((1, 1), bool))
  assert int(np.asarray(mask).sum()) == 3
  assert op.rho_new == pytest.approx(float(rho_new[0, 0]), abs=1e-6)
  assert op.rho_new == pytest.approx(0.0, abs=1e-3)  # Fully explained.
  assert _cos(CONTEXT, lines[0]) > 0.3  # What the fallback gave.


def test_cosine_estimator_ignores_the_bank():
  """Table 9 "w. emb": ρ = cos(e_C, e_new) even with a conditioning set."""
  bank = _bank("Rex - Pet: a dog", "Rex - Walks: every morning",
               "Ana - Job: nurse")
  new = "Rex - Pet: a three year old beagle"
  text = f"CORE:APPEND|Owns Rex\nEPISODIC:SKIP\nSEMANTIC:ADD|{new}\n" \
         "PROCEDURAL:SKIP"
  cosine = _score(text, bank=bank, config=RewardConfig(estimator="cosine", **SKIP_RULE))
  residual = _score(text, bank=bank)
  assert [o.rho_new for o in cosine.operations] == pytest.approx(
      [_cos(CONTEXT, "Owns Rex"), _cos(CONTEXT, new)], abs=1e-6)
  assert cosine.operations[1].rho_new != pytest.approx(
      residual.operations[1].rho_new, abs=1e-3)
  with pytest.raises(ValueError, match="estimator"):
    RewardConfig(estimator="kde")


def test_shaping_ablation_uses_raw_scores():
  terms = _score(f"CORE:APPEND|Owns Rex\n{SKIPS}",
                 config=RewardConfig(shaping="none", **SKIP_RULE))
  assert terms.operations[0].shaped == terms.operations[0].score
  assert terms.cmi == pytest.approx(terms.operations[0].score)


def test_length_penalty():
  long_entry = "Rex " + "x" * 596  # 600 chars: halfway between 300 and 900.
  terms = _score(f"CORE:APPEND|Owns Rex\nEPISODIC:ADD|{long_entry}\n"
                 "SEMANTIC:SKIP\nPROCEDURAL:SKIP")
  assert terms.length_excess == pytest.approx(0.25)  # mean(0, 0.5)
  assert terms.length_factor == pytest.approx(1 - 0.8 * 0.25)
  core = "y" * 1100  # 275 tokens: halfway between 150 and 400.
  terms = _score(f"CORE:APPEND|{core}\n{SKIPS}")
  assert terms.length_excess == pytest.approx(0.5)


def _with_expert(text, expert, qa=0.5, **overrides):
  rollout = RolloutInput(MemoryBank("u", ENCODER.dim), CONTEXT, parse(text),
                         qa, expert=None if expert is None else parse(expert))
  (terms,) = RewardComputer(ENCODER, RewardConfig(**SKIP_RULE, **overrides))(
      [rollout])
  return terms


def test_length_penalty_relative_to_the_expert():
  """MemBuilder's rule where the expert's response is known: an entry
  type's text against the expert's (ratio bands, >= 200 tokens apart),
  averaged over the four agents; the absolute band is not used."""
  expert = "CORE:APPEND|Owns Rex\nEPISODIC:SKIP\nSEMANTIC:ADD|{}\nPROCEDURAL:SKIP"
  short = "Rex " + "x" * 396  # 100 tokens.
  terms = _with_expert(expert.format("Rex " + "y" * 3996), expert.format(short))
  # 1000 / 100 tokens: past the ceiling, 1 for semantic, 0 for the others.
  assert terms.length_excess == pytest.approx(0.25)
  assert terms.length_factor == pytest.approx(1 - 0.8 * 0.25)
  # As long as the expert's: no penalty, though the absolute band (300-900
  # characters) would give 1 to a 4000-character entry.
  same = "Rex " + "z" * 3996
  terms = _with_expert(expert.format(same), expert.format(same))
  assert terms.length_excess == 0.0 and terms.length_factor == 1.0
  assert _with_expert(expert.format(same), expert.format(same),
                      length_reference="absolute").length_excess == 0.5
  # 2x the expert's but only 100 tokens apart: under the minimum difference.
  assert _with_expert(expert.format(short + short),
                      expert.format(short)).length_excess == 0.0
  # 480 / 1000 tokens (ratio 0.48, just under gamma_l = 0.5): too short.
  terms = _with_expert(expert.format("x" * 1920), expert.format(same))
  assert terms.length_excess == pytest.approx((0.5 - 0.48) / 0.3 / 4)
  # A run without expert states: the absolute band (600 chars: 0.5).
  assert _with_expert(expert.format(same), None).length_excess == 0.5
  # A session of a run with expert states that the teacher did not
  # answer (a dialogue's last): MemBuilder's formula without
  # `expert_output`: no entry-type penalty, the core by its band.
  assert _with_expert(expert.format(same),
                      NO_EXPERT_RESPONSE).length_excess == 0.0
  long_core = "CORE:APPEND|" + "y" * 1100 + "\n" + SKIPS  # ℓ_core = 0.5.
  assert _with_expert(long_core, NO_EXPERT_RESPONSE).length_excess == (
      pytest.approx(0.5 / 4))


def test_length_penalty_spares_a_non_positive_reward():
  """A negative reward times (1 - λℓ) would pay for verbosity: MemBuilder
  applies the factor to positive rewards only (both references)."""
  long_core = "y" * 1100  # 275 tokens: ℓ = 0.5 on the core band.
  text = f"CORE:REPLACE|absent|{long_core}\n{SKIPS}"  # No match: unscored.
  for reference, expected in (("expert", 0.125), ("absolute", 0.5)):
    terms = _with_expert(text, SKIPS.replace("EPISODIC", "CORE:APPEND|x\n"
                                             "EPISODIC"), qa=0.0,
                         length_reference=reference)
    assert terms.base < 0 and terms.length_excess == pytest.approx(expected)
    assert terms.length_factor == 1.0
    assert terms.total == pytest.approx(terms.base + terms.semantic_skip_bonus)


def test_intra_duplicates():
  terms = _score("CORE:APPEND|Owns Rex\nEPISODIC:ADD|Adopted Rex.\n"
                 "SEMANTIC:ADD|adopted   REX\nPROCEDURAL:SKIP")
  # Three additions (core APPEND counts), one repeats another.
  assert terms.intra_duplicate_fraction == pytest.approx(1 / 3)
  assert terms.intra_duplicate_factor == pytest.approx(1 - 0.3 / 3)


def test_cross_duplicates():
  bank = _bank("Rex - Pet: beagle", "Ana - Job: nurse")
  terms = _score("CORE:APPEND|Owns Rex\nEPISODIC:SKIP\n"
                 "SEMANTIC:ADD|rex - pet: Beagle\nSEMANTIC:ADD|Ana - City: Oslo\n"
                 "PROCEDURAL:SKIP", bank=bank)
  assert terms.cross_duplicate_fraction == pytest.approx(1 / 3)
  assert terms.cross_duplicate_factor == pytest.approx(1 - 0.5 / 3)


def test_only_additions_can_be_duplicates():
  """Table 7 "dup-add": an UPDATE or REPLACE restating its own target, or a
  MERGE repeating one of its sources, is a revision; an ADD of a stored
  entry, or an APPEND of a core line, is a copy."""
  bank = _bank("Rex - Pet: beagle", "Ana - Job: nurse")
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.EPISODIC, Action.ADD, (t,)) for t in
      ("Walked Rex in the park", "Took Rex to the vet")], ENCODER,
      session_index=0)
  bank.core = "Owns Rex"
  revision = _score("CORE:REPLACE|Owns Rex|owns rex\n"
                    "EPISODIC:MERGE|Walked Rex in the park|Took Rex to the "
                    "vet|Walked Rex in the park\n"
                    "SEMANTIC:UPDATE|Rex - Pet: beagle|rex - pet: Beagle\n"
                    "PROCEDURAL:SKIP", bank=bank)
  assert revision.valid and len(revision.operations) == 3
  assert revision.intra_duplicate_fraction == 0.0
  assert revision.cross_duplicate_fraction == 0.0
  assert revision.cross_duplicate_factor == 1.0
  copies = _score("CORE:APPEND|owns  REX\nEPISODIC:SKIP\n"
                  "SEMANTIC:ADD|rex - pet: Beagle\nPROCEDURAL:SKIP", bank=bank)
  assert copies.cross_duplicate_fraction == 1.0
  assert copies.cross_duplicate_factor == pytest.approx(0.5)


def test_the_dominant_type_is_counted_across_the_batch():
  """Eq. 16: one rollout retrieved episodic most, but over the batch
  semantic dominates, so semantic lines weigh 4 in both."""
  text = "CORE:APPEND|Owns Rex\nEPISODIC:ADD|a\nSEMANTIC:ADD|b\nPROCEDURAL:SKIP"
  rollouts = [RolloutInput(MemoryBank("u", ENCODER.dim), CONTEXT, parse(text),
                           0.0, counts)
              for counts in ({MemoryType.EPISODIC: 3, MemoryType.SEMANTIC: 1},
                             {MemoryType.SEMANTIC: 6})]
  first, second = RewardComputer(ENCODER, CALIBRATED)(rollouts)
  assert first.dominant_type is second.dominant_type is MemoryType.SEMANTIC
  assert [w for _, w in first.line_weights] == [1.0, 1.0, 4.0, 1.0]


def test_core_specificity():
  terms = _score(f"CORE:APPEND|She is a Lifelong Learner\n{SKIPS}")
  assert terms.core_generic and terms.core_specificity_factor == pytest.approx(0.7)
  assert not _score(f"CORE:APPEND|Works night shifts\n{SKIPS}").core_generic


DOG_SESSION = (
    "user: I finally adopted a beagle puppy last weekend, his name is Rex.",
    "assistant: Congratulations! How is Rex settling in?",
    "user: Great, I walk him every morning before my nursing shift at the "
    "hospital.",
    "assistant: Morning walks are a great routine for beagles.")
# What the user states in it (`user_statements` of the user's turns).
DOG_STATEMENTS = ("I finally adopted a beagle puppy last weekend,",
                  "his name is Rex.",
                  "I walk him every morning before my nursing shift at the "
                  "hospital.")
TRIVIA_SESSION = (
    "user: What is the capital of Australia?",
    "assistant: The capital of Australia is Canberra, not Sydney as many "
    "people assume; it was built as a compromise between Sydney and "
    "Melbourne.",
    "user: How many bones are in the adult human body?",
    "assistant: An adult human body has 206 bones.",
    "user: Who wrote Pride and Prejudice?",
    "assistant: Jane Austen wrote Pride and Prejudice, published in 1813.")


def _user_turns(session):
  return tuple(line.split(": ", 1)[1] for line in session
               if line.startswith("user: "))


def _skip_terms(encoder, semantic_texts, session=DOG_SESSION,
                config=CALIBRATED):
  bank = MemoryBank("u", encoder.dim)
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.SEMANTIC, Action.ADD, (t,)) for t in semantic_texts],
      encoder, session_index=0)
  rollout = RolloutInput(bank, "\n".join(session),
                         parse(f"CORE:APPEND|Owns Rex\n{SKIPS}"), 0.0,
                         user_turns=_user_turns(session))
  (terms,) = RewardComputer(encoder, config)([rollout])
  return terms


def test_semantic_skip_justified_when_store_explains_session():
  terms = _skip_terms(ENCODER, DOG_STATEMENTS)  # Every statement stored.
  assert terms.semantic_skip_justified is True
  assert terms.semantic_skip_bonus == 0.1
  assert terms.total == pytest.approx(terms.base + 0.1)
  no_skip = _score("CORE:APPEND|Owns Rex\nEPISODIC:SKIP\nSEMANTIC:ADD|Rex\n"
                   "PROCEDURAL:SKIP")
  assert no_skip.semantic_skip_justified is None
  assert no_skip.semantic_skip_bonus == 0.0


def test_user_statements_are_what_the_user_states():
  assert user_statements(_user_turns(DOG_SESSION)) == list(DOG_STATEMENTS)
  assert user_statements(_user_turns(TRIVIA_SESSION)) == []
  assert user_statements(["I'm vegetarian and hate spicy food, any dinner "
                          "ideas?"]) == ["I'm vegetarian and hate spicy food,"]


@pytest.fixture(scope="module")
def minilm():
  try:
    minilm_directory()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return MiniLMEncoder(batch_size=16)


def test_semantic_skip_on_real_sentence_embeddings(minilm):
  """SPEC §4.4 on all-MiniLM-L6-v2 vectors with MiniLM's own calibration
  (the packaged table, tools/skip_calibration.py): a SKIP is justified
  when the semantic store covers the user's statements. Stored verbatim
  or in other words (a store paraphrasing every statement, which the
  largest-ρ rule judged unjustified): justified; unrelated facts or an
  empty store: not. A session of common-knowledge questions states
  nothing about the user: justified whatever the store holds."""
  config = calibrated(RewardConfig(), ml_collections.ConfigDict(
      {"kind": "minilm", "dim": 384, "path": ""}))
  assert config.skip_calibrated and config.semantic_skip_cosine < 1
  paraphrases = ["User - Pets: adopted a beagle puppy named Rex last weekend",
                 "User - Routine: walks Rex every morning before work",
                 "User - Career: works nursing shifts at the hospital"]
  unrelated = ["User - Travel: visited Lisbon in 2019 and loved the trams",
               "User - Food: allergic to peanuts",
               "User - Music: plays jazz piano on weekends"]
  known = _skip_terms(minilm, DOG_STATEMENTS, config=config)
  paraphrased = _skip_terms(minilm, paraphrases, config=config)
  for terms in (known, paraphrased):
    assert terms.semantic_skip_justified is True
    assert terms.semantic_skip_bonus == 0.1
  assert min(known.semantic_skip_statement_cosines) > 0.999
  assert known.semantic_skip_coverage == 1.0
  # The adoption is stored in other words: its statement is covered.
  assert paraphrased.semantic_skip_statement_cosines[0] >= (
      config.semantic_skip_cosine)
  for store in ([], unrelated):
    terms = _skip_terms(minilm, store, config=config)
    assert terms.semantic_skip_justified is False, store
    assert terms.semantic_skip_coverage == 0.0
    assert terms.semantic_skip_bonus == -0.1
    trivia = _skip_terms(minilm, store, TRIVIA_SESSION, config=config)
    assert trivia.semantic_skip_justified is True
    assert trivia.semantic_skip_coverage == 1.0
    assert trivia.semantic_skip_bonus == 0.1


def test_attribution_weights_and_tokens():
  text = "CORE:APPEND|Owns Rex\nEPISODIC:ADD|a\nSEMANTIC:ADD|b\nPROCEDURAL:SKIP"
  terms = _score(text, counts={MemoryType.SEMANTIC: 5,
                               MemoryType.EPISODIC: 2})
  assert terms.dominant_type is MemoryType.SEMANTIC
  assert [w for _, w in terms.line_weights] == [1.0, 1.0, 4.0, 1.0]
  (span, _), = [lw for lw in terms.line_weights if lw[1] == 4.0]
  assert text[span[0]:span[1]] == "SEMANTIC:ADD|b"
  # Tokens map to the line they overlap most.
  offsets = [(0, 4), (span[0], span[0] + 8), (span[1] - 1, span[1] + 1)]
  assert token_weights(offsets, terms.line_weights).tolist() == [1.0, 4.0, 4.0]
  assert _score(text, counts={}).dominant_type is None
  assert _score(text).line_weights[2][1] == 1.0


def test_rollouts_of_one_session_share_a_bank_and_one_call():
  bank = _bank("Rex - Pet: beagle", "Ana - Job: nurse", "Ana - City: Oslo")
  texts = [f"CORE:APPEND|Owns Rex\nEPISODIC:ADD|{i} walked Rex\n"
           "SEMANTIC:SKIP\nPROCEDURAL:SKIP" for i in range(4)]
  batch = RewardComputer(ENCODER, CALIBRATED)([RolloutInput(bank, CONTEXT, parse(t), 0.5)
                                   for t in texts])
  single = [_score(t, bank=bank, qa=0.5) for t in texts]
  for a, b in zip(batch, single):
    assert a.reward == pytest.approx(b.reward, abs=1e-6)


def test_config_round_trip_and_validation():
  assert RewardConfig.from_config(reward_defaults()) == RewardConfig()
  with pytest.raises(ValueError, match="shaping"):
    RewardConfig(shaping="cubic")
  with pytest.raises(ValueError, match="alpha"):
    RewardConfig(alpha=1.5)


def test_skip_thresholds_are_the_encoders_own_calibration(tmp_path):
  """Keyed by encoder identity: the packaged table holds the CPU training
  configs' encoders, not Qwen3-Embedding (the 4B configs refuse to train
  until calibrated); a table the tool wrote supplies its encoder's, and
  a rewrite replaces that encoder's entry."""
  from cmimem_jax.task.skip_table import calibrated, read_table, write_entry
  from cmimem_jax.config import ConfigError
  from cmimem_jax.encoders import encoder_identity
  from configs import qwen3_4b, small_repro, tiny
  for module in (tiny, small_repro):
    config = module.get_config()
    reward = calibrated(RewardConfig.from_config(config.reward),
                        config.encoder)
    assert reward.skip_calibrated, module.__name__
  paper = qwen3_4b.get_config()
  with pytest.raises(ConfigError, match="no Semantic SKIP calibration for "
                     "encoder .*qwen3_embedding.*tools.skip_calibration"):
    calibrated(RewardConfig.from_config(paper.reward), paper.encoder)
  table = str(tmp_path / "table.json")
  identity = encoder_identity(paper.encoder)
  for cosine in (0.7, 0.6):
    write_entry(table, {"encoder": identity, "semantic_skip_cosine": cosine,
                        "semantic_skip_coverage": 0.4})
  assert len(read_table(table)) == 1
  paper.reward.skip_calibration = table
  reward = calibrated(RewardConfig.from_config(paper.reward), paper.encoder)
  assert (reward.semantic_skip_cosine, reward.semantic_skip_coverage) == (
      0.6, 0.4)
  # Thresholds a config sets itself are kept.
  assert calibrated(CALIBRATED, paper.encoder) is CALIBRATED
  with pytest.raises(ValueError, match="set together"):
    RewardConfig(semantic_skip_cosine=0.5)
  with pytest.raises(ValueError, match="needs the encoder's calibration"):
    _score(f"CORE:APPEND|Owns Rex\n{SKIPS}", config=RewardConfig())
