"""The dyadic q codec: exact round trip and every refusal class."""

import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import reference as ref

M = dj.M
S = dj.Status


def test_round_trip_is_exact():
  rng = np.random.default_rng(0)
  w = rng.random((4, 1000))
  counts, _ = dj.allocate_dense(w / w.sum(-1, keepdims=True))
  q = dj.counts_to_q(counts)
  assert q.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(q, np.float64) * M, counts)
  back, status = dj.q_to_counts(q)
  np.testing.assert_array_equal(back, counts)
  assert np.all(np.asarray(status) == S.OK)


def test_extremes_round_trip():
  counts = np.array([[M, 0, 0], [1, M - 1, 0], [0, 0, M]], np.int32)
  back, status = dj.q_to_counts(dj.counts_to_q(counts))
  np.testing.assert_array_equal(back, counts)
  assert np.all(np.asarray(status) == S.OK)


def _row(*values, n=4):
  q = np.zeros(n, np.float32)
  q[:len(values)] = values
  return q


def _from_bits(*patterns, n=4):
  bits = np.zeros(n, np.uint32)
  bits[:len(patterns)] = patterns
  return bits.view(np.float32)


HALF = 0.5
TICK = 2.0 ** -24
HALF_BITS, ONE_BITS = 0x3F000000, 0x3F800000
_CASES = [
    ("nan", _row(HALF, np.nan, HALF), S.NAN),
    ("pos_inf", _row(HALF, np.inf), S.INF),
    ("neg_inf", _row(1.0, -np.inf), S.INF),
    ("negative", _row(1.0 + HALF, -HALF), S.NEGATIVE),
    ("non_dyadic", _row(HALF, HALF - 2.0 ** -25, 2.0 ** -25), S.NON_DYADIC),
    ("non_integer_small", _row(1.0 - TICK, 2.0 ** -30), S.NON_DYADIC),
    ("above_M", _row(2.0, -1.0), S.NEGATIVE),  # negative checked first
    ("above_M_alone", _row(2.0), S.WRONG_MASS),
    ("above_one_before_non_dyadic", _row(2.0, 2.0 ** -25), S.WRONG_MASS),
    ("sum_short", _row(HALF, HALF - TICK), S.WRONG_MASS),
    ("sum_long", _row(HALF, HALF + TICK), S.WRONG_MASS),
    ("all_zero", _row(), S.WRONG_MASS),
    ("negative_zero_ok", _row(1.0, -0.0), S.OK),
    # Subnormals are judged on their bits: XLA CPU flushes them to zero in
    # float compares, which made every one of these rows OK before.
    ("subnormal_min", _from_bits(ONE_BITS, 0x00000001), S.NON_DYADIC),
    ("subnormal_max", _from_bits(ONE_BITS, 0x007FFFFF), S.NON_DYADIC),
    ("negative_subnormal", _from_bits(ONE_BITS, 0x80000001), S.NEGATIVE),
    ("negative_zero_bits", _from_bits(ONE_BITS, 0x80000000), S.OK),
    ("smallest_normal", _from_bits(ONE_BITS, 0x00800000), S.NON_DYADIC),
    ("one_tick", _from_bits(0x3F7FFFFF, 0x33800000), S.OK),
]


@pytest.mark.parametrize("name,q,status", _CASES, ids=[c[0] for c in _CASES])
def test_refusal_classes_match_oracle(name, q, status):
  del name
  counts, got = dj.q_to_counts(q[None])
  assert int(got[0]) == status
  want_counts, want_status = ref.q_to_counts(q)
  assert want_status == status
  assert np.asarray(counts[0]).tolist() == want_counts
  if status != S.OK:
    assert not np.any(np.asarray(counts))


def test_subnormal_in_padding_is_refused():
  q = _from_bits(HALF_BITS, HALF_BITS, 0, 0x00000001)
  _, status = dj.q_to_counts(q[None], vocab_size=3)
  assert int(status[0]) == S.NON_DYADIC == ref.q_to_counts(q, 3)[1]
  q = _from_bits(HALF_BITS, HALF_BITS, 0, 0x80000000)  # -0.0 padding is zero
  _, status = dj.q_to_counts(q[None], vocab_size=3)
  assert int(status[0]) == S.OK == ref.q_to_counts(q, 3)[1]


def test_token_checks():
  q = np.stack([_row(HALF, HALF)] * 4)
  token = np.array([1, 2, 4, -1], np.int32)
  counts, status = dj.q_to_counts(q, vocab_size=4, token=token)
  want = [ref.q_to_counts(r, 4, int(t)) for r, t in zip(q, token)]
  assert np.asarray(status).tolist() == [w[1] for w in want] == [
      S.OK, S.ZERO_Q_AT_TOKEN, S.TOKEN_OUT_OF_RANGE, S.TOKEN_OUT_OF_RANGE]
  assert np.asarray(counts).tolist() == [w[0] for w in want]
  # The token is checked first: a NaN row with a bad token is out of range.
  _, status = dj.q_to_counts(_row(np.nan)[None], token=np.array([9]))
  assert int(status[0]) == S.TOKEN_OUT_OF_RANGE


def test_status_aliases_are_one_member():
  assert S.NON_INTEGER is S.NON_DYADIC and S.NON_DYADIC.name == "NON_DYADIC"
  assert S.OUT_OF_RANGE is S.TOKEN_OUT_OF_RANGE
  assert S.WRONG_SUM is S.WRONG_MASS
  assert [int(s) for s in S] == list(range(16))


def test_padding_beyond_vocab():
  q = _row(HALF, HALF, 0, 0, n=6)
  counts, status = dj.q_to_counts(q[None], vocab_size=2)
  assert int(status[0]) == S.OK
  q[4] = TICK
  q[0] -= TICK
  counts, status = dj.q_to_counts(q[None], vocab_size=2)
  assert int(status[0]) == S.PADDING_NONZERO
  assert ref.q_to_counts(q, vocab_size=2)[1] == S.PADDING_NONZERO
  # Without the vocabulary bound the same row is a valid q over 6 ids.
  assert int(dj.q_to_counts(q[None])[1][0]) == S.OK


def test_sum_is_checked_in_64_bits():
  # Entries whose int32 sum would wrap around to exactly M.
  q = np.full(257, 1.0, np.float32)  # 257 * M = M mod 2^32
  q[1:] = 1.0
  _, status = dj.q_to_counts(q[None])
  assert int(status[0]) == S.WRONG_MASS


def test_input_validation():
  with pytest.raises(TypeError, match="float32"):
    dj.q_to_counts(np.ones((1, 2), np.float64))
  with pytest.raises(ValueError, match="vocab_size"):
    dj.q_to_counts(np.ones((1, 2), np.float32), vocab_size=3)
  with pytest.raises(ValueError, match="vocabulary axis"):
    dj.q_to_counts(np.float32(1.0))
  with pytest.raises(ValueError, match="token shape"):
    dj.q_to_counts(np.ones((2, 2), np.float32), token=np.zeros(3, np.int32))
