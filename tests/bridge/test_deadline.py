"""`AdaptiveDeadline`: the exchange deadline follows answered round times.

Issue 29: a healthy rank-link run on a loaded machine (rounds of ~1.2 s
against a fixed 2 s deadline) timed out and fell back. No clock here: the
policy only sees the seconds it is told.
"""

import pytest

from dyadic_jax import bridge


def test_a_session_starts_generous_then_the_floor_until_answered():
  """The issue's run timed out its first round: a fresh session's first
  exchange has nothing measured to go by, and does one-off work."""
  d = bridge.AdaptiveDeadline(2.0, 30.0)
  assert d.seconds() == 8.0                     # factor x the floor
  assert d.seconds() == 2.0 and d.seconds() == 2.0   # a dead link: floor
  assert d.figures()["min_s"] == 2.0 and d.figures()["max_s"] == 8.0
  d.new_session()                               # e.g. a restarted worker
  assert d.seconds() == 8.0 and d.seconds() == 2.0
  assert bridge.AdaptiveDeadline(2.0, 5.0).seconds() == 5.0   # the ceiling
  assert bridge.AdaptiveDeadline(2.0, 30.0, first_s=1.0).seconds() == 2.0


def test_follows_the_median_within_floor_and_ceiling():
  d = bridge.AdaptiveDeadline(2.0, 30.0, factor=4.0, window=5, first_s=2.0)
  for seconds in (1.0, 1.2, 1.1, 9.0, 1.3):    # one slow outlier
    d.observe(seconds)
  assert d.seconds() == pytest.approx(4 * 1.2)  # the median, not the max
  for _ in range(5):
    d.observe(0.01)                             # the window moves on
  assert d.seconds() == 2.0                     # never below the floor
  for _ in range(5):
    d.observe(20.0)
  assert d.seconds() == 30.0                    # nor above the ceiling
  assert d.figures() == {"floor_s": 2.0, "ceiling_s": 30.0, "first_s": 2.0,
                         "factor": 4.0, "min_s": 2.0, "max_s": 30.0}


def test_a_fixed_deadline_when_floor_equals_ceiling():
  d = bridge.AdaptiveDeadline(1.5, 1.5)
  d.observe(10.0)
  assert d.seconds() == 1.5


@pytest.mark.parametrize("floor,ceiling", [(0.0, 1.0), (2.0, 1.0),
                                           (1.0, float("inf"))])
def test_bounds_are_checked(floor, ceiling):
  with pytest.raises(ValueError):
    bridge.AdaptiveDeadline(floor, ceiling)
