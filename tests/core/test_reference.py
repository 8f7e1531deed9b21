"""The oracle itself, against hand-computed answers."""

from fractions import Fraction

import pytest

import dyadic_jax as dj
from dyadic_jax import reference as ref

M = dj.M


def test_thirds_by_hand():
  third = M // 3  # 5592405, R = 1 goes to the lowest id
  assert ref.allocate_dense([1 / 3] * 3) == ([third + 1, third, third],
                                             dj.Status.OK)


def test_largest_remainder_ordering_by_hand():
  # s = [1.75, 1.25, 0.5, 0.5] * ... with total 4: floors [1, 1, 0, 0],
  # R = 2: remainders .75, .25, .5, .5 -> ids 0 and 2 (tie 2 vs 3 -> 2).
  counts, status = ref.largest_remainder([0.4375, 0.3125, 0.125, 0.125], 4)
  assert status == dj.Status.OK and counts == [2, 1, 1, 0]


def test_sparse_by_hand():
  # Support {1, 3}, W = 0.9; s = (4/9, 5/9) M = 7456540.44.., 9320675.55..:
  # floors sum to M - 1 and the one ticket goes to the larger remainder.
  ids, counts, n, status = ref.allocate_sparse([0.1, 0.4, 0.0, 0.5], 2)
  assert (ids, counts, n, status) == ([1, 3], [M * 4 // 9, M * 5 // 9 + 1],
                                      2, dj.Status.OK)


def test_draw_map_by_hand():
  assert [ref.sample_counts([2, 0, 3], u) for u in range(5)] == [0, 0, 2, 2, 2]
  assert ref.sample_counts([2, 0, 3], 5) == 3


def test_draw_below_cdf_by_hand():
  # n = 3: u = floor(U * 3 / 2^64) < 1 iff U < 2^64 / 3, i.e. ceil(2^64/3).
  assert ref.draw_below_cdf(1, 3) == Fraction(-(-(2 ** 64) // 3), 2 ** 64)
  assert ref.draw_below_cdf(3, 3) == 1 and ref.draw_below_cdf(0, 3) == 0
  assert sum(ref.categorical_int_distribution([1, 1, 1])) == 1


@pytest.mark.parametrize("p,q", [
    ([Fraction(1, 2), Fraction(1, 2)], [Fraction(1, 4), Fraction(3, 4)]),
    ([Fraction(1), Fraction(0)], [Fraction(0), Fraction(1)]),
    ([Fraction(1, 3)] * 3, [Fraction(1, 3)] * 3),
])
def test_ideal_rule_reproduces_p(p, q):
  assert ref.ideal_step_distribution(p, q) == p


def test_acceptance_probability_by_hand():
  # p_x = 1/4 (P = 1, T = 4), q_x = 1/2: accept with probability 1/2.
  a = ref.acceptance_probability(1, 4, M // 2)
  assert abs(a - Fraction(1, 2)) < Fraction(1, 2 ** 64)
  assert ref.acceptance_probability(3, 4, M // 2) == 1
  assert ref.acceptance_probability(3, 4, 0) == 0


def test_quantize_target_by_hand():
  # round(p 2^38), ties to even (docs/numerics.md 6.1).
  assert ref.quantize_target(
      [0.5, 0.25, 2.0 ** -39, 0.25 - 2.0 ** -39, 3 * 2.0 ** -39,
       2.0 ** -39 + 2.0 ** -60]) == [2 ** 37, 2 ** 36, 0, 2 ** 36, 2, 1]
