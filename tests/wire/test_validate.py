"""wire.validate_q_row: every rejection class, and valid rows pass exactly."""

import itertools

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import wire

M = dj.M
C = wire.Code
V = 16
HALF, QUARTER, TICK = 0.5, 0.25, 2.0 ** -24


def _dense(*pairs):
  q = np.zeros(V, np.float32)
  for i, x in pairs:
    q[i] = x
  return q


def _sparse(ids, values):
  return np.asarray(values, np.float32), np.asarray(ids, np.int32)


GOOD_DENSE = _dense((2, HALF), (5, QUARTER), (9, QUARTER))
GOOD_IDS, GOOD_VALUES = np.array([2, 5, 9], np.int32), np.array(
    [HALF, QUARTER, QUARTER], np.float32)


def test_valid_rows_return_exact_counts():
  counts = wire.validate_q_row(GOOD_DENSE, None, vocab_size=V, token=5)
  assert counts.dtype == np.int32 and counts.tolist() == (
      np.asarray(GOOD_DENSE, np.float64) * M).astype(int).tolist()
  counts = wire.validate_q_row(GOOD_VALUES, GOOD_IDS, vocab_size=V, token=9)
  assert counts.tolist() == [M // 2, M // 4, M // 4]


def test_library_allocations_validate_to_their_counts():
  rng = np.random.default_rng(0)
  w = rng.random((3, 1000)) ** 4
  w /= w.sum(-1, keepdims=True)
  counts, _ = dj.allocate_dense(w)
  ids, scounts, n, _ = dj.allocate_sparse(w, 32)
  q, sq = np.asarray(dj.counts_to_q(counts)), np.asarray(dj.counts_to_q(scounts))
  for r in range(3):
    token = int(np.argmax(np.asarray(counts[r])))
    np.testing.assert_array_equal(
        wire.validate_q_row(q[r], None, vocab_size=1000, token=token),
        counts[r])
    k = int(n[r])
    got = wire.validate_q_row(sq[r, :k], np.asarray(ids[r, :k]),
                              vocab_size=1000, token=int(ids[r, 0]))
    np.testing.assert_array_equal(got, scounts[r, :k])


_REFUSALS = {
    "token_negative": (GOOD_DENSE, None, -1, C.TOKEN_OUT_OF_RANGE),
    "token_beyond_vocab": (GOOD_DENSE, None, V, C.TOKEN_OUT_OF_RANGE),
    "token_not_int": (GOOD_DENSE, None, 2.0, C.TOKEN_OUT_OF_RANGE),
    "missing_q": (None, None, 2, C.MISSING_Q),
    "empty_sparse": (*_sparse([], []), 2, C.MISSING_Q),
    "float64_values": (GOOD_DENSE.astype(np.float64), None, 2, C.WRONG_DTYPE),
    "int64_ids": (GOOD_VALUES, GOOD_IDS.astype(np.int64), 2, C.WRONG_DTYPE),
    "dense_too_short": (GOOD_DENSE[:-1], None, 2, C.LENGTH_MISMATCH),
    "ids_values_differ": (GOOD_VALUES[:2], GOOD_IDS, 2, C.LENGTH_MISMATCH),
    "absurd_support": (*_sparse(range(V + 1), [1.0] + [0.0] * V), 0,
                       C.ABSURD_LENGTH),
    "id_negative": (*_sparse([-1, 2], [HALF, HALF]), 2, C.ID_OUT_OF_RANGE),
    "id_padding": (*_sparse([2, V], [HALF, HALF]), 2, C.ID_OUT_OF_RANGE),
    "duplicate_id": (*_sparse([2, 2], [HALF, HALF]), 2, C.DUPLICATE_ID),
    "duplicate_zero": (*_sparse([2, 5, 5], [1.0, 0.0, 0.0]), 2,
                       C.DUPLICATE_ID),
    "duplicate_unsorted": (*_sparse([5, 2, 5], [HALF, HALF, 0.0]), 2,
                           C.DUPLICATE_ID),
    "unsorted": (*_sparse([5, 2], [HALF, HALF]), 2, C.UNSORTED_IDS),
    "nan": (_dense((2, HALF), (3, np.nan)), None, 2, C.NON_FINITE),
    "inf": (_dense((2, np.inf)), None, 2, C.NON_FINITE),
    "negative": (_dense((2, 1.5), (3, -HALF)), None, 2, C.NEGATIVE),
    "non_dyadic": (_dense((2, HALF), (3, HALF - 2.0 ** -25), (4, 2.0 ** -25)),
                   None, 2, C.NON_DYADIC),
    "count_above_M": (_dense((2, 2.0)), None, 2, C.WRONG_MASS),
    "sum_short": (_dense((2, HALF), (3, HALF - TICK)), None, 2, C.WRONG_MASS),
    "sum_long": (*_sparse([2, 3], [HALF, HALF + TICK]), 2, C.WRONG_MASS),
    "all_zero": (_dense(), None, 2, C.WRONG_MASS),
    "zero_q_at_token": (GOOD_DENSE, None, 3, C.ZERO_Q_AT_TOKEN),
    "token_not_in_support": (GOOD_VALUES, GOOD_IDS, 3, C.ZERO_Q_AT_TOKEN),
    "token_with_zero_entry": (*_sparse([2, 3], [1.0, 0.0]), 3,
                              C.ZERO_Q_AT_TOKEN),
}


@pytest.mark.parametrize("name", sorted(_REFUSALS))
def test_every_rejection_class(name):
  values, ids, token, code = _REFUSALS[name]
  with pytest.raises(wire.ProtocolError) as info:
    wire.validate_q_row(values, ids, vocab_size=V, token=token)
  assert info.value.code == code


def test_every_row_code_is_exercised():
  row_codes = {C.MISSING_Q, C.WRONG_DTYPE, C.LENGTH_MISMATCH, C.NON_FINITE,
               C.NEGATIVE, C.NON_DYADIC, C.WRONG_MASS, C.ID_OUT_OF_RANGE,
               C.DUPLICATE_ID, C.UNSORTED_IDS, C.TOKEN_OUT_OF_RANGE,
               C.ZERO_Q_AT_TOKEN, C.ABSURD_LENGTH}
  assert row_codes <= {case[3] for case in _REFUSALS.values()}


def test_negative_zero_is_zero():
  q = GOOD_DENSE.copy()
  q[0] = -0.0
  assert wire.validate_q_row(q, None, vocab_size=V, token=2)[0] == 0


def test_every_single_and_double_bit_flip_of_a_row():
  """Flips of the row's bytes: a ProtocolError or valid counts, nothing else."""
  raw = bytearray(GOOD_VALUES.tobytes() + GOOD_IDS.tobytes())
  nbits = len(raw) * 8
  outcomes = {"valid": 0, "refused": 0}

  def check(buf):
    values = np.frombuffer(bytes(buf[:12]), np.float32)
    ids = np.frombuffer(bytes(buf[12:]), np.int32)
    try:
      counts = wire.validate_q_row(values, ids, vocab_size=V, token=2)
    except wire.ProtocolError:
      outcomes["refused"] += 1
      return
    assert counts.sum(dtype=np.uint64) == M and np.all(counts >= 0)
    outcomes["valid"] += 1

  for i, j in itertools.combinations_with_replacement(range(nbits), 2):
    buf = bytearray(raw)
    buf[i // 8] ^= 1 << (i % 8)
    if j != i:
      buf[j // 8] ^= 1 << (j % 8)
    check(buf)
  assert outcomes["refused"] > 0 and sum(outcomes.values()) == (
      nbits * (nbits + 1) // 2)


@hypothesis.given(st.binary(min_size=0, max_size=64),
                  st.integers(-2, V + 1), st.booleans())
def test_arbitrary_bytes_never_raise_anything_else(data, token, sparse):
  data = data[: len(data) // 8 * 8]
  half = len(data) // 2
  values = np.frombuffer(data[:half] if sparse else data, np.float32)
  ids = np.frombuffer(data[half:], np.int32) if sparse else None
  try:
    counts = wire.validate_q_row(values, ids, vocab_size=V, token=token)
  except wire.ProtocolError:
    return
  assert counts.sum(dtype=np.uint64) == M
