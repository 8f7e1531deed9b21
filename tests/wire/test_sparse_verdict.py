"""The sparse verdict's compiled host pass is the kernel, code for code.

`sparse_host.verdict` (one numba loop; `SparseFormat.validate(...,
device=True)` on CPU) must give, on every row, the counts and the `Code`
of the numpy kernel (`qrows.sparse` -> `status.codes`, then `base.audit`
-> `base.with_audit`: `validate(device=False)`), of the jitted kernel
(`kernels.sparse_verdict`), of the numpy host pass it replaced (frozen
below as `_previous`) and of the oracle (`reference.sparse_q_counts` and
the audit in Python integers): every refusal class, first failing class
first (several classes in one row), padding past n never read, zero q at
the token, draws at both ends of the token's interval and above 2^31; on
random valid batches (a property test, fixed seeds) and on random
mutations of them (bits, ids, n, tokens and draws: a small fuzz); on
read-only, strided and unaligned views, with one compiled signature.
"""

# pylint: disable=protected-access
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import qrows
from dyadic_jax import reference as ref
from dyadic_jax.wire import qformats, status
from dyadic_jax.wire.layouts import Representation
from dyadic_jax.wire.qformats import base, kernels, sparse, sparse_host
from dyadic_jax.wire.refusals import Code
from tests.wire import test_qformats as cases

M = dj.M
SPARSE = qformats.get(Representation.SPARSE)
_BAD_ENTRY = M + 1


def _previous(rows, draws, vocab):
  """`sparse.host_verdict` before the compiled pass, verbatim but for
  names: validity in numpy, refused rows through the kernel."""
  tokens = np.asarray(rows.tokens)
  shape, k = tokens.shape, rows.ids.shape[-1]
  t = tokens.reshape(-1)
  n = np.asarray(rows.n).reshape(-1).astype(np.int32, copy=False)
  ids = np.asarray(rows.ids).reshape(-1, k).astype(np.int32, copy=False)
  bits = np.asarray(rows.values).reshape(-1, k).view(np.uint32)
  index = np.arange(t.size)
  live = np.arange(k) < n[:, None]
  e = np.where(live, qrows.fine_counts(bits, _BAD_ENTRY, np),
               np.int32(0)).astype(np.int32, copy=False)
  cum = np.cumsum(e, -1, dtype=np.int64)
  hit = live & (ids == t.astype(np.int32)[:, None])
  at_token = hit.argmax(-1)
  at = e[index, at_token]
  ok = ((n >= 1) & (n <= k) & (t >= 0) & (t < vocab) & (ids[:, 0] >= 0)
        & (ids[index, (n - 1) % k] < vocab)
        & ((ids[:, 1:] > ids[:, :-1]) | ~live[:, 1:]).all(-1)
        & (cum[:, -1] == M) & hit[index, at_token] & (at > 0))
  codes = np.zeros(t.size, np.int32)
  u = None
  if draws is not None:
    u = np.asarray(draws, np.uint32).reshape(-1).astype(np.int32)
    before = cum[index, at_token] - at
    codes[ok & ~((before <= u) & (u < before + at))] = Code.SAMPLING_MISMATCH
  if not ok.all():
    bad = np.flatnonzero(~ok)
    counts, row_status = qrows.sparse(bits[bad], ids[bad], n[bad], t[bad],
                                      vocab=int(vocab), xp=np)
    sub = status.codes(row_status)
    if u is not None:
      sub = base.with_audit(sub, base.audit(
          counts, base.support_position(ids[bad], n[bad], t[bad], np),
          u[bad], np))
    codes[bad] = sub
    e[bad] = counts
  return base.Verdict(e.reshape(shape + (k,)), codes.reshape(shape))


def _assert_same(rows, draws, vocab):
  """The compiled verdict against the kernel (numpy and jitted) and the
  previous host pass; returns its codes."""
  got = sparse_host.verdict(rows, draws, vocab)
  assert got.counts.dtype == np.int32 and got.codes.dtype == np.int32
  assert got.counts.shape == rows.values.shape
  assert got.codes.shape == rows.tokens.shape
  loose = SPARSE.validate(rows, vocab=vocab, draws=draws)
  np.testing.assert_array_equal(got.codes, loose.codes)
  np.testing.assert_array_equal(got.counts, loose.counts)
  old = _previous(rows, draws, vocab)
  np.testing.assert_array_equal(got.codes, old.codes)
  np.testing.assert_array_equal(got.counts, old.counts)
  jit = kernels.sparse_verdict(rows, draws, vocab)
  jit_codes = base.with_audit(status.codes(np.asarray(jit[1])),
                              np.asarray(jit[2]))
  np.testing.assert_array_equal(got.codes, jit_codes)
  np.testing.assert_array_equal(got.counts, np.asarray(jit[0]))
  staged = SPARSE.validate(rows, vocab=vocab, draws=draws, device=True)
  np.testing.assert_array_equal(staged.codes, got.codes)
  return got.codes


@pytest.mark.parametrize("vocab,k", [(1000, 8), (40, 32), (5000, 3)])
def test_every_class_is_the_kernels_and_the_oracles(vocab, k):
  """test_qformats' sparse cases (each refusal class, padding past n),
  with and without the audit, against the kernels and the oracle."""
  rng = np.random.default_rng(11)
  values, ids, n, tokens = cases._sparse_cases(rng, vocab, k, 340)
  if k > 1:
    extra = cases._sparse_padding_cases(rng, vocab, k)
    values, ids, n, tokens = (np.concatenate([a, b]) for a, b in zip(
        (values, ids, n, tokens), extra))
  draws = cases.edge_draws(rng, values, ids, n, tokens)
  rows = qformats.Rows(tokens, n, ids, np.ascontiguousarray(values))
  _assert_same(rows, None, vocab)
  codes = _assert_same(rows, draws, vocab)
  got = sparse_host.verdict(rows, draws, vocab)
  for b in range(len(values)):
    want, st = ref.sparse_q_counts(values[b], ids[b], int(n[b]), vocab,
                                   token=int(tokens[b]))
    code = int(status.codes([int(st)])[0])
    if code == 0:
      assert got.counts[b].tolist() == want, b
      at = int(np.flatnonzero(ids[b, :n[b]] == tokens[b])[0])
      if not cases._audit_oracle(want, at, draws[b].astype(np.int32)):
        code = int(Code.SAMPLING_MISMATCH)
    assert codes[b] == code, (b, codes[b], code)
  seen = set(codes.tolist())
  want_seen = {0, Code.SAMPLING_MISMATCH, Code.NON_FINITE, Code.NEGATIVE,
               Code.NON_DYADIC, Code.WRONG_MASS, Code.ID_OUT_OF_RANGE,
               Code.TOKEN_OUT_OF_RANGE, Code.MISSING_Q, Code.ZERO_Q_AT_TOKEN}
  if k > 1:
    want_seen |= {Code.DUPLICATE_ID, Code.UNSORTED_IDS}
  assert want_seen <= seen, want_seen - seen


def _valid_rows(rng, vocab, k, count):
  """Random valid rows: n in [1, k] live entries (some q = 0), garbage
  past n, tokens a live id of positive count."""
  values = rng.integers(0, 2 ** 32, (count, k), dtype=np.uint32).view(
      np.float32)                                    # garbage past n
  ids = rng.integers(-5, vocab + 5, (count, k)).astype(np.int32)
  n = rng.integers(1, k + 1, count).astype(np.int32)
  tokens = np.zeros(count, np.int32)
  for b in range(count):
    m = int(n[b])
    ids[b, :m] = np.sort(rng.choice(vocab, m, replace=False))
    zeros = rng.random(m) < 0.2
    zeros[rng.integers(m)] = False
    weights = np.where(zeros, 0.0, rng.exponential(size=m))
    c = np.floor(weights / weights.sum() * M).astype(np.int64)
    c[np.argmax(c)] += M - c.sum()
    values[b, :m] = (c * 2.0 ** -24).astype(np.float32)
    tokens[b] = ids[b, rng.choice(np.flatnonzero(c > 0))]
  return values, ids, n, tokens


def _mutate(rng, values, ids, n, tokens, draws, vocab):
  """One random edit per row: a bit of q, an id, n, the token or the
  draw, or a value from the classes' edges."""
  values, ids, n, tokens, draws = (a.copy() for a in (values, ids, n, tokens,
                                                      draws))
  r, k = values.shape
  bits = values.view(np.uint32)
  specials = np.array([0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000,
                       0x80000001, 0x00000001, 0x33800000, 0x33000000,
                       0x3F800000, 0x3F800001, 0x40000000, 0x33800001,
                       0x34000001], np.uint32)
  for b in range(r):
    j = int(rng.integers(k))
    what = int(rng.integers(9))
    if what == 0:
      bits[b, j] ^= np.uint32(1 << int(rng.integers(32)))
    elif what == 1:
      bits[b, j] = specials[rng.integers(len(specials))]
    elif what == 2:
      ids[b, j] = [-1, vocab, vocab - 1, 0, ids[b, max(j - 1, 0)],
                   ids[b, min(j + 1, k - 1)], 2 ** 31 - 1,
                   -2 ** 31][int(rng.integers(8))]
    elif what == 3:
      n[b] = [0, -1, k, k + 1, int(n[b]) - 1, int(n[b]) + 1, 2 ** 31 - 1,
              -2 ** 31][int(rng.integers(8))]
    elif what == 4:
      tokens[b] = [-1, vocab, ids[b, j], int(rng.integers(vocab)),
                   2 ** 31 - 1][int(rng.integers(5))]
    elif what == 5:
      draws[b] = rng.integers(0, 2 ** 32, dtype=np.uint32)
    elif what == 6 and j:
      ids[b, [j - 1, j]] = ids[b, [j, j - 1]]
    elif what == 7:        # mass moved between two live entries
      i, j = (int(x) for x in rng.integers(max(int(n[b]), 1), size=2))
      if i != j and 0 < values[b, i] <= 1 and 0 < values[b, j] < 1:
        ci, cj = (int(round(float(values[b, x]) * M)) for x in (i, j))
        if ci > 1:
          values[b, i] = np.float32((ci - 1) * 2.0 ** -24)
          values[b, j] = np.float32((cj + 1) * 2.0 ** -24)
    # what == 8: unchanged
  return values, ids, n, tokens, draws


@pytest.mark.parametrize("vocab,k,seed", [(64, 32, 0), (129280, 32, 1),
                                          (300, 5, 2), (4096, 256, 3)])
def test_random_valid_batches_and_their_mutations(vocab, k, seed):
  """Property test (fixed seeds): random valid rows are accepted with
  their counts, the audit passes exactly where the draw lands in the
  token's interval; random mutations of them get the kernel's code."""
  rng = np.random.default_rng(seed)
  count = 240 if k <= 32 else 60
  values, ids, n, tokens = _valid_rows(rng, vocab, k, count)
  draws = cases.edge_draws(rng, values, ids, n, tokens)
  rows = qformats.Rows(tokens, n, ids, values)
  assert not _assert_same(rows, None, vocab).any()
  codes = _assert_same(rows, draws, vocab)
  assert set(codes.tolist()) == {0, int(Code.SAMPLING_MISMATCH)}
  seen = set()
  for _ in range(6):
    mutated = _mutate(rng, values, ids, n, tokens, draws, vocab)
    rows = qformats.Rows(*mutated[3::-1])
    seen |= set(_assert_same(rows, mutated[4], vocab).tolist())
  assert len(seen) >= 8, seen


def test_several_classes_in_one_row_report_the_first():
  """Each row breaks two or more checks; the code is the kernel's first."""
  vocab, k = 100, 4
  good_ids = np.array([3, 10, 20, 30], np.int32)
  good_q = np.full(k, 0.25, np.float32)
  nan, inf, neg = np.float32(np.nan), np.float32(np.inf), np.float32(-0.25)
  edits = [  # (values, ids, n, token, code)
      (good_q, good_ids, 0, 200, Code.TOKEN_OUT_OF_RANGE),
      (good_q, [3, 3, -1, 200], 5, 3, Code.MISSING_Q),
      ([nan, .25, .25, .25], [3, 3, 200, 30], 4, 3, Code.ID_OUT_OF_RANGE),
      ([nan, .25, .25, .25], [30, 3, 3, 20], 4, 3, Code.DUPLICATE_ID),
      ([nan, .25, .25, .25], [30, 3, 10, 20], 4, 3, Code.UNSORTED_IDS),
      ([neg, inf, .3, .25], good_ids, 4, 3, Code.NON_FINITE),
      ([.3, neg, 2.0, .25], good_ids, 4, 3, Code.NEGATIVE),
      ([.3, 2.0, .25, .25], good_ids, 4, 3, Code.WRONG_MASS),
      ([.3, .25, .25, .25], good_ids, 4, 3, Code.NON_DYADIC),
      ([.5, 2.0, .25, .25], good_ids, 4, 3, Code.WRONG_MASS),
      ([0., .5, .25, .5], good_ids, 4, 3, Code.WRONG_MASS),
      ([0., .5, .25, .25], good_ids, 4, 3, Code.ZERO_Q_AT_TOKEN),
      (good_q, good_ids, 3, 30, Code.WRONG_MASS),
      ([.5, .5, nan, nan], [3, 10, 3, 3], 2, 11, Code.ZERO_Q_AT_TOKEN),
      ([.5, .5, nan, nan], [3, 10, 3, 3], 2, 10, 0),
  ]
  values = np.array([np.asarray(e[0], np.float32) for e in edits])
  values[7:9, 0].view(np.uint32)[:] |= 1   # 0.3 + 2^-25: off the grid
  ids = np.array([np.asarray(e[1], np.int32) for e in edits])
  n = np.array([e[2] for e in edits], np.int32)
  tokens = np.array([e[3] for e in edits], np.int32)
  rows = qformats.Rows(tokens, n, ids, values)
  codes = _assert_same(rows, None, vocab)
  assert codes.tolist() == [int(e[4]) for e in edits]


def test_any_layout_one_signature():
  """Read-only views of a message, strided and unaligned arrays and a
  [R, D, k] batch give the same verdict, through one compiled signature
  (no compile on a new layout)."""
  rng = np.random.default_rng(4)
  vocab, k = 500, 16
  values, ids, n, tokens = _valid_rows(rng, vocab, k, 20)
  draws = cases.edge_draws(rng, values, ids, n, tokens)
  want = sparse_host.verdict(qformats.Rows(tokens, n, ids, values), draws,
                             vocab)
  # A message: tokens | n | ids | values, one byte off alignment.
  blob = b"\0" + b"".join(a.tobytes() for a in (tokens, n, ids, values))
  r = len(tokens)
  at = [1, 1 + 4 * r, 1 + 8 * r, 1 + 8 * r + 4 * r * k]
  view = qformats.Rows(
      np.frombuffer(blob, np.int32, r, at[0]),
      np.frombuffer(blob, np.int32, r, at[1]),
      np.frombuffer(blob, np.int32, r * k, at[2]).reshape(r, k),
      np.frombuffer(blob, np.float32, r * k, at[3]).reshape(r, k))
  assert not view.values.flags.writeable and not view.values.flags.aligned
  wide = [np.repeat(a, 2, axis=-1) for a in (ids, values)]
  strided = qformats.Rows(tokens[::1], n, wide[0][:, ::2], wide[1][:, ::2])
  batch = qformats.Rows(*(a.reshape((4, 5) + a.shape[1:])
                          for a in (tokens, n, ids, values)))
  for rows, d in ((view, draws), (strided, draws),
                  (batch, draws.reshape(4, 5))):
    got = sparse_host.verdict(rows, d, vocab)
    np.testing.assert_array_equal(got.codes.reshape(-1), want.codes)
    np.testing.assert_array_equal(got.counts.reshape(r, k), want.counts)
  assert len(sparse_host._compiled.signatures) == 1 


def test_long_unsorted_rows_cost_a_sort_not_a_square():
  """A row of k = 4096 ids, unsorted or with one duplicate, is judged
  (sorted copy: the kernel's order) in well under a second."""
  vocab, k = 1 << 18, 4096
  rng = np.random.default_rng(9)
  ids = np.stack([rng.permutation(vocab)[:k] for _ in range(8)]).astype(
      np.int32)
  ids[1::2, -1] = ids[1::2, 0]                # a duplicate, far apart
  values = np.full((8, k), 2.0 ** -12, np.float32)
  rows = qformats.Rows(ids[:, 0].copy(), np.full(8, k, np.int32), ids,
                       values)
  codes = _assert_same(rows, None, vocab)
  assert codes.tolist() == [int(Code.UNSORTED_IDS),
                            int(Code.DUPLICATE_ID)] * 4


def test_shapes_and_dtypes_are_checked():
  rows = qformats.Rows(np.zeros(3, np.int32), np.ones(3, np.int32),
                       np.zeros((3, 4), np.int32),
                       np.zeros((3, 4), np.float32))
  with pytest.raises(ValueError, match="draws"):
    sparse_host.verdict(rows, np.zeros(2, np.uint32), 10)
  with pytest.raises(ValueError, match="shapes"):
    sparse_host.verdict(rows._replace(n=np.ones(2, np.int32)), None, 10)
  with pytest.raises(ValueError, match="shapes"):
    sparse_host.verdict(rows._replace(ids=np.zeros((3, 5), np.int32)), None,
                        10)
  for field, dtype in (("values", np.float64), ("ids", np.int64),
                       ("n", np.int64), ("tokens", np.uint32)):
    with pytest.raises(TypeError, match="int32"):
      sparse_host.verdict(rows._replace(**{field: getattr(rows, field).astype(
          dtype)}), None, 10)
  assert sparse.host_verdict(rows, None, 10).codes.tolist() == [
      int(Code.WRONG_MASS)] * 3
