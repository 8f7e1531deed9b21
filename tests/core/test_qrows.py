"""The q row kernels (`dyadic_jax.qrows`): bit patterns, both namespaces, oracle.

Every verdict is checked three ways: the numpy kernel, the jax.numpy kernel
(jitted, so XLA CPU's flush-to-zero would show) and the exact oracle
`reference.q_to_counts` / `reference.sparse_q_counts`, which judges the
exact value of each float (Python never flushes subnormals).
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import qrows
from dyadic_jax import reference as ref

M = dj.M
S = dj.Status


def _bits(values):
  return np.asarray(values, np.float32).view(np.uint32)


@functools.lru_cache(maxsize=None)
def _jnp_dense(has_token):
  with jax.enable_x64(True):
    if has_token:
      fn = lambda b, t, v: qrows.dense(b, t, vocab=v, xp=jnp)
    else:
      fn = lambda b, v: qrows.dense(b, vocab=v, xp=jnp)
    return jax.jit(fn)


def dense_both(bits, token=None, vocab=None):
  """(counts, status) from numpy and jitted jax.numpy; asserts they agree."""
  bits = np.asarray(bits, np.uint32)
  vocab = bits.shape[-1] if vocab is None else vocab
  want = qrows.dense(bits, token, vocab=vocab, xp=np)
  with jax.enable_x64(True):
    if token is None:
      got = _jnp_dense(False)(bits, np.int64(vocab))
    else:
      got = _jnp_dense(True)(bits, np.asarray(token, np.int32),
                             np.int64(vocab))
  np.testing.assert_array_equal(np.asarray(got[0]), want[0])
  np.testing.assert_array_equal(np.asarray(got[1]), want[1])
  return want


@functools.lru_cache(maxsize=None)
def _jnp_sparse():
  return jax.jit(lambda b, i, n, t, v: qrows.sparse(b, i, n, t, vocab=v,
                                                    xp=jnp))


def sparse_both(bits, ids, n, token=None, *, vocab):
  bits = np.asarray(bits, np.uint32)
  args = (bits, np.asarray(ids, np.int32), np.asarray(n, np.int32))
  want = qrows.sparse(*args, token, vocab=vocab, xp=np)
  with jax.enable_x64(True):
    got = _jnp_sparse()(
        *args, None if token is None else np.asarray(token, np.int32),
        np.int32(vocab))
  np.testing.assert_array_equal(np.asarray(got[0]), want[0])
  np.testing.assert_array_equal(np.asarray(got[1]), want[1])
  return want


# ---------------------------------------------------------------------------
# Every class of float32 bit pattern, entry by entry.


def _patterns():
  """Both signs x every exponent x mantissas at every bit boundary."""
  mantissas = {0, 1, 0x7FFFFF, 0x400000, 0x3FFFFF}
  for j in range(23):
    mantissas.update({1 << j, (1 << j) - 1, (1 << (j + 1)) - 1 - (1 << j)})
  rng = np.random.default_rng(0)
  mantissas.update(int(m) for m in rng.integers(0, 1 << 23, 8))
  out = [(sign << 31) | (e << 23) | m for sign in (0, 1) for e in range(256)
         for m in sorted(mantissas)]
  return np.asarray(out, np.uint32)


def test_every_bit_class_entry_by_entry():
  bits = _patterns()
  assert len(bits) > 20000
  values = bits.view(np.float32)
  want = [ref.q_entry(x) for x in values]
  for xp in (np, jnp):
    with jax.enable_x64(True):
      cls, count = jax.jit(lambda b: qrows.classify(b, jnp))(bits) if (
          xp is jnp) else qrows.classify(bits, np)
    cls, count = np.asarray(cls), np.asarray(count)
    # A single-entry row of the pattern, judged by the row kernel, too.
    statuses = [qrows._CLASS_STATUS[c] for c in cls]
    assert statuses == [w[0] for w in want], xp.__name__
    assert count.tolist() == [w[1] for w in want], xp.__name__
  kinds = {s for s, _ in want}
  assert kinds == {S.OK, S.NAN, S.INF, S.NEGATIVE, S.WRONG_MASS, S.NON_DYADIC}
  # fine_counts: the count of a fine entry, `bad` of any other.
  bad = M + 1
  fine = [c if s == S.OK else bad for s, c in want]
  for xp in (np, jnp):
    got = (jax.jit(lambda b: qrows.fine_counts(b, bad, jnp))(bits)
           if xp is jnp else qrows.fine_counts(bits, bad, np))
    assert np.asarray(got).dtype == np.int32
    assert np.asarray(got).tolist() == fine, xp.__name__


@pytest.mark.parametrize("pattern,status", [
    (0x00000001, S.NON_DYADIC),   # smallest subnormal
    (0x007FFFFF, S.NON_DYADIC),   # largest subnormal
    (0x80000001, S.NEGATIVE),     # negative subnormal
    (0x807FFFFF, S.NEGATIVE),
    (0x80000000, S.OK),           # -0.0
    (0x00800000, S.NON_DYADIC),   # smallest normal, 2^-126
    (0x33000000, S.NON_DYADIC),   # 2^-25
    (0x33800000, S.OK),           # 2^-24: one ticket
    (0x33C00000, S.NON_DYADIC),   # 1.5 * 2^-24
    (0x3F800000, S.OK),           # 1.0
    (0x3F800001, S.WRONG_MASS),   # just above 1
    (0x7F800000, S.INF),
    (0xFF800000, S.INF),
    (0x7FC00000, S.NAN),
    (0xFFFFFFFF, S.NAN),
])
def test_corner_patterns_in_a_row(pattern, status):
  # Beside 1 - q (OK patterns) or 1.0, so that only the pattern can fail.
  value = np.array([pattern], np.uint32).view(np.float32)[0]
  partner = np.float32(1.0) - value if status == S.OK else np.float32(1.0)
  row = np.array([[_bits(partner), pattern]], np.uint32)
  want_counts, want_status = ref.q_to_counts(row[0].view(np.float32))
  assert want_status == status
  counts, got = dense_both(row)
  assert int(got[0]) == status and counts[0].tolist() == want_counts


# ---------------------------------------------------------------------------
# Whole rows: hypothesis over random and adversarial bit patterns.

_SPECIAL = [0x0, 0x80000000, 0x1, 0x7FFFFF, 0x80000001, 0x00800000,
            0x33000000, 0x33800000, 0x3F000000, 0x3F800000, 0x3F800001,
            0x7F800000, 0xFF800000, 0x7FC00000, 0xBF000000, 0x4B800000]


def _valid_row(draw, n):
  """A valid dyadic row of length n (counts summing to M) as bits."""
  cuts = sorted(draw(st.lists(st.integers(0, M), min_size=n - 1,
                              max_size=n - 1)))
  counts = np.diff([0] + cuts + [M])
  return (counts.astype(np.float32) * np.float32(2.0 ** -24)).view(np.uint32)


_N = 12  # one row length (one compilation); ids >= the row's n are zeros


@st.composite
def dense_rows(draw):
  n = draw(st.integers(1, _N))
  bits = np.zeros(_N, np.uint32)
  bits[:n] = _valid_row(draw, n)
  for _ in range(draw(st.integers(0, 3))):
    i = draw(st.integers(0, _N - 1))
    bits[i] = draw(st.one_of(st.sampled_from(_SPECIAL),
                             st.integers(0, 2 ** 32 - 1)))
  vocab = draw(st.integers(1, _N))
  token = draw(st.one_of(st.none(), st.integers(-1, _N)))
  return bits, vocab, token


@hypothesis.given(dense_rows())
def test_dense_numpy_jax_and_oracle_agree(case):
  bits, vocab, token = case
  counts, status = dense_both(bits[None], None if token is None
                              else np.array([token]), vocab)
  want_counts, want_status = ref.q_to_counts(bits.view(np.float32), vocab,
                                             token)
  assert int(status[0]) == want_status
  assert counts[0].tolist() == want_counts


def test_dense_batch_rows_are_independent():
  rng = np.random.default_rng(3)
  rows = []
  for s in _SPECIAL:
    row = np.zeros(6, np.uint32)
    row[:2] = 0x3F000000
    row[rng.integers(0, 6)] = s
    rows.append(row)
  bits = np.stack(rows).reshape(4, 4, 6)
  counts, status = dense_both(bits, vocab=5)
  for idx in np.ndindex(4, 4):
    want = ref.q_to_counts(bits[idx].view(np.float32), 5)
    assert (counts[idx].tolist(), int(status[idx])) == want


@st.composite
def sparse_rows(draw):
  k = 8  # one row length (one compilation)
  vocab = draw(st.integers(1, 20))
  n = draw(st.integers(-1, k + 1))
  live = max(0, min(n, k, vocab))
  ids = sorted(draw(st.lists(st.integers(0, vocab - 1), min_size=live,
                             max_size=live, unique=True)))
  ids = ids + draw(st.lists(st.integers(-3, vocab + 3), min_size=k - live,
                            max_size=k - live))
  ids = np.asarray(ids, np.int32)
  for _ in range(draw(st.integers(0, 2))):  # duplicates, disorder, range
    i = draw(st.integers(0, k - 1))
    ids[i] = draw(st.integers(-2, vocab + 2))
  bits = np.zeros(k, np.uint32)
  bits[:max(live, 1)] = _valid_row(draw, max(live, 1))
  for _ in range(draw(st.integers(0, 2))):
    bits[draw(st.integers(0, k - 1))] = draw(st.one_of(
        st.sampled_from(_SPECIAL), st.integers(0, 2 ** 32 - 1)))
  token = draw(st.one_of(st.none(), st.integers(-1, vocab),
                         st.sampled_from(ids.tolist())))
  return bits, ids, n, vocab, token


@hypothesis.given(sparse_rows())
def test_sparse_numpy_jax_and_oracle_agree(case):
  bits, ids, n, vocab, token = case
  counts, status = sparse_both(bits[None], ids[None], [n],
                               None if token is None else [token],
                               vocab=vocab)
  want_counts, want_status = ref.sparse_q_counts(bits.view(np.float32), ids,
                                                 n, vocab, token)
  assert int(status[0]) == want_status
  assert counts[0].tolist() == want_counts


HALF = 0x3F000000
_SPARSE = {
    # name: (bits, ids, n, token, status); vocab 10
    "ok": ([HALF, HALF, 0], [2, 5, -1], 2, 5, S.OK),
    "token_first": ([0x7FC00000, HALF, 0], [5, 5, 0], 2, 10,
                    S.TOKEN_OUT_OF_RANGE),
    "missing": ([HALF, HALF], [1, 2], 0, 1, S.MISSING_Q),
    "n_beyond_k": ([HALF, HALF], [1, 2], 3, 1, S.MISSING_Q),
    "id_out_before_duplicate": ([HALF, HALF, 0], [10, 10, 3], 3, 3,
                                S.ID_OUT_OF_RANGE),
    "negative_id": ([HALF, HALF], [-1, 3], 2, 3, S.ID_OUT_OF_RANGE),
    "duplicate_zero_q": ([0x3F800000, 0, 0], [1, 4, 4], 3, 1,
                         S.DUPLICATE_ID),
    "duplicate_unsorted": ([HALF, HALF, 0], [4, 1, 4], 3, 1, S.DUPLICATE_ID),
    "unsorted": ([HALF, HALF], [4, 1], 2, 1, S.UNSORTED_IDS),
    "unsorted_before_nan": ([0x7FC00000, HALF], [4, 1], 2, 1,
                            S.UNSORTED_IDS),
    "nan": ([0x7FC00000, HALF], [1, 4], 2, 1, S.NAN),
    "negative_subnormal": ([0x3F800000, 0x80000001], [1, 4], 2, 1,
                           S.NEGATIVE),
    "subnormal": ([0x3F800000, 0x00000001], [1, 4], 2, 1, S.NON_DYADIC),
    "above_one": ([0x40000000, 0x33000000], [1, 4], 2, 1, S.WRONG_MASS),
    "sum": ([HALF, 0x3E800000], [1, 4], 2, 1, S.WRONG_MASS),
    "token_absent": ([HALF, HALF], [1, 4], 2, 3, S.ZERO_Q_AT_TOKEN),
    "token_zero": ([0x3F800000, 0], [1, 4], 2, 4, S.ZERO_Q_AT_TOKEN),
    "token_in_padding": ([0x3F800000, HALF], [1, 4], 1, 4,
                         S.ZERO_Q_AT_TOKEN),
    "padding_ignored": ([0x3F800000, 0x7FC00000], [1, 1], 1, 1, S.OK),
}


@pytest.mark.parametrize("name", sorted(_SPARSE))
def test_sparse_classes_and_order(name):
  bits, ids, n, token, status = _SPARSE[name]
  counts, got = sparse_both(np.asarray([bits], np.uint32), [ids], [n],
                            [token], vocab=10)
  want = ref.sparse_q_counts(np.asarray(bits, np.uint32).view(np.float32),
                             ids, n, 10, token)
  assert int(got[0]) == want[1] == status
  assert counts[0].tolist() == want[0]


def test_jax_kernel_needs_x64_inside_a_32_bit_jit():
  if jax.config.jax_enable_x64:
    pytest.skip("the process runs with x64 on")
  with pytest.raises(dj.X64Required, match="qrows.dense"):
    jax.jit(lambda b: qrows.dense(b, xp=jnp))(np.zeros((1, 2), np.uint32))
  # Outside a jit the kernel scopes x64 itself.
  counts, status = qrows.dense(jnp.asarray(_bits([[1.0, 0.0]])), xp=jnp)
  assert int(status[0]) == S.OK and counts.dtype == jnp.int32


def test_input_errors():
  with pytest.raises(TypeError, match="uint32"):
    qrows.dense(np.zeros((1, 2), np.float32))
  with pytest.raises(ValueError, match="trailing row axis"):
    qrows.dense(np.uint32(0))
  with pytest.raises(ValueError, match="vocab=3"):
    qrows.dense(np.zeros((1, 2), np.uint32), vocab=3)
  with pytest.raises(ValueError, match="token shape"):
    qrows.dense(np.zeros((1, 2), np.uint32), np.zeros(2, np.int32))
  with pytest.raises(ValueError, match="need ids"):
    qrows.sparse(np.zeros((1, 2), np.uint32), np.zeros((1, 3), np.int32),
                 np.ones(1, np.int32), vocab=4)
  with pytest.raises(ValueError, match="2\\^31"):
    qrows.sparse(np.zeros((1, 2), np.uint32), np.zeros((1, 2), np.int32),
                 np.ones(1, np.int32), vocab=2 ** 31 - 2)
