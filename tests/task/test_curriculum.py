"""Eq. 14 curriculum: tiers, ordering, coverage of every tier."""

import collections

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


def test_every_batch_covers_every_tier_in_ascending_order():
  curriculum = Curriculum(refs(20), batch_size=6, tiers=3)
  tier_of = {id(s): i for i, t in enumerate(curriculum.tiers) for s in t}
  seen = [[] for _ in curriculum.tiers]
  for step in range(curriculum.steps_per_epoch):
    batch = curriculum.batch(step)
    assert len(batch) == 6 and len({id(s) for s in batch}) == 6
    tiers = [tier_of[id(s)] for s in batch]
    assert sorted(set(tiers)) == [0, 1, 2]
    for j, (s, tier) in enumerate(zip(batch, tiers)):
      seen[tier].append((j, s))
  # One epoch (24 picks for 20 sessions) visits every session.
  for tier, visits in zip(curriculum.tiers, seen):
    assert {id(s) for _, s in visits} == {id(s) for s in tier}


def test_difficulty_rises_across_epochs_not_per_epoch():
  """Eq. 14 across the run: each tier is walked once over all epochs, a
  session's visits on consecutive steps, so the mean difficulty of a batch
  never falls (per-epoch cycling fell back to the easiest at each epoch)."""
  curriculum = Curriculum(refs(30), batch_size=6, tiers=3, epochs=3)
  assert curriculum.planned_steps == 15
  means = [sum(s.difficulty for s in curriculum.batch(step)) / 6
           for step in range(curriculum.planned_steps)]
  assert means == sorted(means) and means[-1] > means[0]
  visits = collections.Counter(
      (s.dialogue, s.session) for step in range(15)
      for s in curriculum.batch(step))
  assert set(visits.values()) == {3}  # Every session once per epoch.
  # Past the plan it starts again; the plan does not depend on max_steps.
  assert curriculum.batch(15) == curriculum.batch(0)


def test_candidate_fragments_count_sentences_that_carry_facts():
  assert candidate_fragments([
      "I adopted a beagle named Rex. He is three years old! ok.",
      "Thanks a lot!", "We moved to Oslo in May\nand I started a new job"]
  ) == 4
  assert candidate_fragments([]) == 0


def test_batches_are_a_pure_function_of_the_step():
  a, b = Curriculum(refs(11), 3), Curriculum(list(reversed(refs(11))), 3)
  assert [a.batch(s) for s in range(9)] == [b.batch(s) for s in range(9)]
  assert a.steps_per_epoch == 4 and a.epoch(4) == 1


def test_rejects_impossible_settings():
  with pytest.raises(ValueError, match="tiers"):
    Curriculum(refs(5), batch_size=2, tiers=3)
  with pytest.raises(ValueError, match="at least one"):
    Curriculum([], batch_size=3)
  with pytest.raises(ValueError, match="epoch"):
    Curriculum(refs(5), batch_size=3, epochs=0)
