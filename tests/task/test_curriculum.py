"""Eq. 14 curriculum: tiers, ordering, coverage of every tier."""

import pytest

from cmimem_jax.task.curriculum import (Curriculum, SessionRef,
                                        candidate_fragments, difficulty)


def refs(n):
  # Difficulty = session index * 1 + turns * 1 + questions * 1.
  return [SessionRef(i % 4, i, difficulty(i, 3, i % 5)) for i in range(n)]


def test_difficulty_formula():
  assert difficulty(2, 10, 5, (1.0, 0.5, 2.0)) == 2 + 5 + 10
  with pytest.raises(ValueError):
    difficulty(1, 1, 1, (1.0, -1.0, 1.0))


def test_tiers_are_percentiles_sorted_ascending():
  curriculum = Curriculum(refs(20), batch_size=6, tiers=3)
  sizes = [len(t) for t in curriculum.tiers]
  assert sorted(sizes) == [6, 7, 7]
  flat = [s.difficulty for t in curriculum.tiers for s in t]
  assert flat == sorted(flat)  # Tier i is entirely easier than tier i+1.


def _tier_of(curriculum):
  return {(s.dialogue, s.session): i for i, t in enumerate(curriculum.tiers)
          for s in t}


def _key(s):
  return (s.dialogue, s.session)


def test_an_epoch_is_a_pass_over_every_session():
  """The issue's setting: 60 sessions, batch 6, 3 tiers, 5 epochs (as
  verl's 5 passes over the sorted data): every epoch's batches hold each
  session exactly once, every batch holds every tier, each tier is walked
  ascending again in every pass, and no session is in two consecutive
  batches."""
  sessions = [SessionRef(i % 7, i, float((i * 37) % 60)) for i in range(60)]
  curriculum = Curriculum(sessions, batch_size=6, tiers=3, epochs=5)
  assert curriculum.planned_steps == 50 and curriculum.steps_per_epoch == 10
  tier_of = _tier_of(curriculum)
  batches = [curriculum.batch(step) for step in range(50)]
  for epoch in range(5):
    picks = [_key(s) for b in batches[10 * epoch:10 * epoch + 10] for s in b]
    assert sorted(picks) == sorted(_key(s) for s in sessions)  # Once each.
    assert {curriculum.epoch(s) for s in range(10 * epoch, 10 * epoch + 10)
            } == {epoch}
    for tier in range(3):  # Ascending within the tier, again each pass.
      walked = [s.difficulty for b in batches[10 * epoch:10 * epoch + 10]
                for s in b if tier_of[_key(s)] == tier]
      assert walked == sorted(walked) and len(walked) == 20
  for previous, batch in zip(batches, batches[1:]):
    assert not {_key(s) for s in previous} & {_key(s) for s in batch}
    assert {tier_of[_key(s)] for s in batch} == {0, 1, 2}
  # Epoch 2 starts from the easiest sessions of every tier again.
  assert batches[20] == batches[0]


@pytest.mark.parametrize("num_sessions,batch_size,tiers", [
    (20, 6, 3), (23, 6, 3), (41, 8, 4), (13, 4, 2), (50, 32, 3)])
def test_uneven_sizes_keep_every_property_a_pass_allows(num_sessions,
                                                        batch_size, tiers):
  """Sessions that do not fill whole batches: a batch straddles two passes
  (nothing dropped or doubled); with batch >= 2 x tiers every batch still
  holds every tier; with >= 2 batches of sessions none repeats on
  consecutive steps."""
  curriculum = Curriculum(refs(num_sessions), batch_size, tiers, epochs=3)
  tier_of = _tier_of(curriculum)
  stream = [_key(s) for step in range(curriculum.planned_steps)
            for s in curriculum.batch(step)]
  for epoch in range(3):
    one_pass = stream[epoch * num_sessions:(epoch + 1) * num_sessions]
    assert sorted(one_pass) == sorted(_key(s) for s in refs(num_sessions))
  batches = [curriculum.batch(step)
             for step in range(curriculum.planned_steps)]
  for previous, batch in zip(batches, batches[1:]):
    assert len({_key(s) for s in batch}) == batch_size
    assert {tier_of[_key(s)] for s in batch} == set(range(tiers))
    if num_sessions >= 2 * batch_size:
      assert not {_key(s) for s in previous} & {_key(s) for s in batch}


def test_candidate_fragments_count_sentences_that_carry_facts():
  assert candidate_fragments([
      "I adopted a beagle named Rex. He is three years old! ok.",
      "Thanks a lot!", "We moved to Oslo in May\nand I started a new job"]
  ) == 4
  assert candidate_fragments([]) == 0


def test_batches_are_a_pure_function_of_the_step():
  a, b = Curriculum(refs(11), 3), Curriculum(list(reversed(refs(11))), 3)
  assert [a.batch(s) for s in range(9)] == [b.batch(s) for s in range(9)]
  # 11 sessions in batches of 3: step 3's batch starts at position 9, still
  # in pass 0; step 4 starts pass 1.
  assert (a.epoch(3), a.epoch(4), a.planned_steps) == (0, 1, 4)


def test_rejects_impossible_settings():
  with pytest.raises(ValueError, match="tiers"):
    Curriculum(refs(5), batch_size=2, tiers=3)
  with pytest.raises(ValueError, match="distinct"):
    Curriculum(refs(5), batch_size=6, tiers=3)
  with pytest.raises(ValueError, match="at least one"):
    Curriculum([], batch_size=3)
  with pytest.raises(ValueError, match="epoch"):
    Curriculum(refs(5), batch_size=3, epochs=0)
