"""models.pool: one slab per group of requests in flight, each call routed
to the slab that holds its requests (tests/models/test_batched.py holds
the slabs' rows to the one-request forward; tests/bridge/test_generate.py
the tokens of two groups in flight to those of one process)."""

import pytest

from dyadic_jax.models import pool


class _Slab:
  """A stand-in slab: the requests it holds, and its calls."""

  def __init__(self):
    self.held, self.calls = set(), []

  def holds(self, rid):
    return rid in self.held

  def drop(self, rid):
    self.held.discard(rid)

  def rows(self, rids, *args):
    self.held.update(rids)
    self.calls.append((list(rids), args))
    return len(self.calls)


def test_two_groups_taking_turns_keep_a_slab_each():
  made = []
  p = pool.TargetPool(lambda: made.append(_Slab()) or made[-1], 2)
  for _ in range(3):
    p.rows([0, 1], "a")
    p.rows([2, 3], "b")
  assert len(made) == 2
  assert [c[0] for c in made[0].calls] == [[0, 1]] * 3
  assert [c[0] for c in made[1].calls] == [[2, 3]] * 3


def test_a_request_follows_its_group_and_leaves_the_other_slab():
  made = []
  p = pool.TargetPool(lambda: made.append(_Slab()) or made[-1], 2)
  p.rows([0, 1])
  p.rows([2, 3])
  p.rows([2, 3, 1])         # 1 joins the group of 2 and 3
  assert made[1].held == {1, 2, 3} and made[0].held == {0}
  p.drop(3)
  assert not any(s.holds(3) for s in made)


def test_one_slot_per_flight_at_most_and_lazily():
  made = []
  p = pool.TargetPool(lambda: made.append(_Slab()) or made[-1], 1)
  p.rows([0])
  p.rows([5])               # a new group: the one slab serves it
  assert len(made) == 1 and made[0].held == {0, 5}
  with pytest.raises(ValueError, match="count"):
    pool.SlabPool(_Slab, 0)
