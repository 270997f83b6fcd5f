"""Eq. 14 curriculum: tiers, ordering, coverage of every tier."""

import pytest

from cmimem_jax.task.curriculum import Curriculum, SessionRef, difficulty


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
    assert len(batch) == 6
    tiers = [tier_of[id(s)] for s in batch]
    assert sorted(set(tiers)) == [0, 1, 2]
    for s, tier in zip(batch, tiers):
      seen[tier].append(s.difficulty)
  # Within each tier, sessions are consumed in ascending difficulty (until
  # the tier wraps around).
  for tier, values in zip(curriculum.tiers, seen):
    first_pass = values[:len(tier)]
    assert first_pass == sorted(first_pass)


def test_batches_are_a_pure_function_of_the_step():
  a, b = Curriculum(refs(11), 3), Curriculum(list(reversed(refs(11))), 3)
  assert [a.batch(s) for s in range(9)] == [b.batch(s) for s in range(9)]
  assert a.steps_per_epoch == 4 and a.epoch(4) == 1


def test_rejects_impossible_settings():
  with pytest.raises(ValueError, match="tiers"):
    Curriculum(refs(5), batch_size=2, tiers=3)
  with pytest.raises(ValueError, match="at least one"):
    Curriculum([], batch_size=3)
