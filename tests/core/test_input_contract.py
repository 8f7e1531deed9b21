"""The core's input contract (issue 28): exact integer q checks, canonical
sparse rows, and a temperature path that no FMA contraction changes.

Four holes, each with a case that the code before the fix got wrong:

1. a sparse count of M + 1 was verified with status OK: the counts were
   judged as float32(c) 2^-24, and float32(2^24 + 1) is 2^24;
2. int64 dense counts passed the status check wrapped to int32
   (2^32 + 2^22 -> 2^22) while the rule used the int64 values;
3. `draft_weights` gave NaN weights with status OK on [1e20, 0] at T = 0.7
   (a fused multiply-add at the argmax), and `propose_dense` /
   `propose_sparse` disagreed with it;
4. a SparseQ with a live count of 0, or padding other than (id -1,
   count 0), was accepted although its live counts are positive. Decided:
   a SparseQ is canonical (MISSING_Q, PADDING_NONZERO); a wire row may
   still list ids with q = 0, and the sparse format's `to_q` drops them.

Each case runs in both row modes, dense and sparse, on one device and on a
two-shard vocabulary mesh (V = 7 splits 4 + 3 with one padding id). The
property tests hold every status to `dyadic_jax.reference` on counts, ids
and n at and around every integer bound the checks use, stored in every
integer dtype, and the temperature path to the composition of its three
ops. Shapes are fixed, so each program compiles once per row mode (the
narrowing to int32 happens before the op's jit).
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import qrows, wire
from dyadic_jax import reference as ref
from dyadic_jax.wire import qformats
from dyadic_jax.wire.layouts import Representation
from dyadic_jax.wire.refusals import Code, ProtocolError
import sharding
from tests import meshes

pytestmark = pytest.mark.multidevice

M = dj.M
S = dj.Status
V, D, B, K = 7, 2, 4, 4          # vocabulary, depth, requests, sparse width
SHARDS = 2
# Every integer dtype, the wide ones first (hypothesis shrinks toward them).
DTYPES = (np.int32, np.int64, np.uint64, np.uint32,
          np.int16, np.uint16, np.int8, np.uint8)
_WITH_FIXTURE = hypothesis.settings(
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])


@functools.lru_cache(maxsize=None)
def _chain_inputs():
  """Target logits [B, D+1, V] (every row OK), tokens [B, D], keys [B]."""
  gen = np.random.default_rng(28)
  target = gen.normal(size=(B, D + 1, V)).astype(np.float32)
  tokens = np.tile(np.array([1, 3], np.int32), (B, 1))
  keys = jax.vmap(lambda r: dj.round_key(28, 0, r))(jnp.arange(B))
  return target, tokens, keys


def _verify(q):
  """(accepted, token, status) of the B chains: `verify_batch` on one
  device, held equal to the same call on the mesh."""
  target, tokens, keys = _chain_inputs()
  single = dj.verify_batch(target, q, tokens, keys)
  sharded = sharding.verify_batch(target, q, tokens, keys,
                                  mesh=meshes.vocab_mesh(SHARDS))
  for a, b in zip(single, sharded):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  accepted, token, status = (np.asarray(a) for a in single)
  refused = status != S.OK
  assert not accepted[refused].any() and (token[refused] == -1).all()
  assert (token[~refused] >= 0).all()
  return status.tolist()


def _dense_rows():
  """Valid dense counts int64[B, D, V]."""
  row = [M // 2, M // 4, 0, M // 8, M // 8, 0, 0]
  return np.tile(np.array(row, np.int64), (B, D, 1))


def _sparse_rows(full=False):
  """A valid SparseQ's (ids, counts, n), int64 [B, D, K] and [B, D]: two
  live entries, or with `full` all K (no -1 ids: an unsigned dtype holds
  them)."""
  if full:
    ids, counts, n = [1, 3, 4, 6], [M // 2 - 1, M // 2 - 1, 1, 1], K
  else:
    ids, counts, n = [1, 3, -1, -1], [M // 2, M // 2, 0, 0], 2
  return (np.tile(np.array(ids, np.int64), (B, D, 1)),
          np.tile(np.array(counts, np.int64), (B, D, 1)),
          np.full((B, D), n, np.int64))


def _chain_oracle(row_statuses):
  """A chain's status from its q rows' (the target rows are all OK)."""
  return next((s for s in row_statuses if s != S.OK), S.OK)


# -- 1. exact integer checks of a sparse q ------------------------------------


@pytest.mark.usefixtures("row_mode")
def test_a_sparse_count_above_m_is_refused():
  ids, counts, n = _sparse_rows()
  # The row: one live entry of M + 1 (float32 rounds it to M).
  ids[0, 0], counts[0, 0], n[0, 0] = [3, -1, -1, -1], [M + 1, 0, 0, 0], 1
  counts[1, 1, :2] = [M + 1, -1]       # the exact sum is M; NEGATIVE first
  counts[2, 1, :2] = [M // 2, M // 2 + 1]           # the sum is M + 1
  want = [S.WRONG_MASS, S.NEGATIVE, S.WRONG_MASS, S.OK]
  assert _verify(dj.SparseQ(ids, counts, n)) == want
  assert [_chain_oracle(ref.sparse_q_status(ids[r, i], counts[r, i], n[r, i],
                                            V) for i in range(D))
          for r in range(B)] == want
  # The dense twin of each row gets the same status.
  dense = np.zeros((B, D, V), np.int64)
  for r, i in np.ndindex(B, D):
    live = slice(0, int(n[r, i]))
    dense[r, i, ids[r, i, live]] = counts[r, i, live]
  assert _verify(dj.DenseQ(dense)) == want


# -- 2. the dtype contract ----------------------------------------------------


@pytest.mark.usefixtures("row_mode")
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_wide_integer_fields_are_judged_on_their_values(dtype):
  # A cast to int32 would wrap each edit below into a value that passes
  # (64-bit: + 2^32 wraps back to the valid value) or into another class
  # (uint32: + 2^31 wraps negative).
  wrap = 2 ** 32 if np.iinfo(dtype).bits == 64 else 2 ** 31
  counts = _dense_rows().astype(dtype)
  counts[0, 0] = [0, wrap + 2 ** 22, 2 ** 22, 2 ** 23, 0, 0, 0]  # the issue's
  counts[1, 1, 0] += wrap
  counts[2, 0, 1] = 2 ** 31 + M // 4
  want = [S.WRONG_MASS, S.WRONG_MASS, S.WRONG_MASS, S.OK]
  assert _verify(dj.DenseQ(counts)) == want
  ids, scounts, n = (a.astype(dtype) for a in _sparse_rows(
      full=np.iinfo(dtype).min == 0))
  scounts[0, 0, 0] += wrap
  ids[1, 1, 1] += wrap
  n[2, 0] += wrap
  want = [S.WRONG_MASS, S.ID_OUT_OF_RANGE, S.MISSING_Q, S.OK]
  assert _verify(dj.SparseQ(ids, scounts, n)) == want


def test_non_integer_fields_are_a_type_error():
  target, tokens, keys = _chain_inputs()
  ids, counts, n = _sparse_rows()
  for bad in (dj.DenseQ(_dense_rows().astype(np.float64)),
              dj.DenseQ(_dense_rows() > 0),
              dj.SparseQ(ids, counts.astype(np.float32), n),
              dj.SparseQ(ids.astype(np.float64), counts, n)):
    with pytest.raises(TypeError, match="verify_batch: .* must be integers"):
      dj.verify_batch(target, bad, tokens, keys)
  with pytest.raises(TypeError, match="verify_chain: DenseQ.counts"):
    dj.verify_chain(target[0], dj.DenseQ(_dense_rows()[0] * 1.0), tokens[0],
                    keys[0])
  # Python integers are integers (int64 on the host), judged exactly.
  assert _verify(dj.DenseQ(_dense_rows().tolist())) == [S.OK] * B


# -- 3. the temperature path --------------------------------------------------


def _logit_rows():
  """float64 [B, V] rows, scores up to 2^66, and their temperatures."""
  x = np.zeros((B, V))
  x[0, :2] = [1e20, 0.0]                  # the rows
  x[1, :2] = [1e19, -5.0]
  x[2] = [3e18, 3e18, -4e18, 1, 0, -np.inf, 2e18]      # two maxima
  x[3] = np.random.default_rng(3).normal(size=V) * 4
  return x, np.array([0.7, 0.3, 0.9, 0.7])


def _three_ops(x, t, u, bias=None, mesh=None):
  """draft_weights -> allocate_* -> sample_counts, and the proposal rows."""
  kw = {} if mesh is None else {"mesh": mesh}
  w, ws = sharding.draft_weights(x, temperature=t, bias=bias, **kw)
  counts, cs = sharding.allocate_dense(w, **kw)
  token = sharding.sample_counts(counts, u, **kw)
  ids, scounts, n, ss = sharding.allocate_sparse(w, K, **kw)
  # The support is replicated: its draw is the one-device scan.
  slot = np.minimum(np.asarray(dj.sample_counts(scounts, u)), K - 1)
  stoken = np.take_along_axis(np.asarray(ids), slot[:, None], -1)[:, 0]
  status = lambda s: np.where(np.asarray(ws) != S.OK, ws, s)
  ok = lambda s, tok: np.where(s == S.OK, tok, -1)
  dense = (counts, ok(status(cs), token), status(cs))
  sparse = (ids, scounts, n, ok(status(ss), stoken), status(ss))
  fused_dense = sharding.propose_dense(x, u, temperature=t, bias=bias, **kw)
  fused_sparse = sharding.propose_sparse(x, u, K, temperature=t, bias=bias,
                                         **kw)
  return w, ws, dense, sparse, fused_dense, fused_sparse


def _same(a, b, vocab=V):
  """Equal bits; vocabulary-sized mesh outputs compared on [..., :V]."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    if y.ndim and y.shape[-1] > vocab >= x.shape[-1] == vocab:
      assert not y[..., vocab:].any()
      y = y[..., :vocab]
    if x.ndim and x.shape[-1] > vocab >= y.shape[-1] == vocab:
      assert not x[..., vocab:].any()
      x = x[..., :vocab]
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


def _check_temperature_path(x, t, u, bias=None):
  local = _three_ops(x, t, u, bias)
  w, ws, dense, sparse, fused_dense, fused_sparse = local
  w = np.asarray(w)
  ok = np.asarray(ws) == S.OK
  # Draft weights of an OK row are finite, in [0, 1], sum to 1, and
  # allocate without a refusal.
  assert np.isfinite(w).all() and (w >= 0).all() and (w <= 1).all()
  np.testing.assert_allclose(w[ok].sum(-1), 1.0, rtol=2 ** -40)
  assert (dense[2] == ws).all() and (sparse[4] == ws).all()
  # The proposal rows are the three ops in sequence, bit for bit.
  _same(dense, fused_dense)
  _same(sparse, fused_sparse)
  # The same bits on the mesh.
  _same(local, _three_ops(x, t, u, bias, meshes.vocab_mesh(SHARDS)))
  return w, np.asarray(ws)


@pytest.mark.usefixtures("row_mode")
def test_huge_scores_at_a_temperature_give_the_one_hot_softmax():
  x, t = _logit_rows()
  u = np.array([0, M - 1, M // 2, 12345], np.uint32)
  w, ws = _check_temperature_path(x, t, u)
  assert ws.tolist() == [S.OK] * B
  # exp(x - max) underflows to 0 off the argmax: the exact weights.
  np.testing.assert_array_equal(w[:2], np.eye(V)[[0, 0]])
  assert w[2].tolist() == [0.5, 0.5, 0, 0, 0, 0, 0]
  # An ordinary row is the softmax of x / T (numpy, to 1e-12).
  z = x[3] / t[3]
  want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  np.testing.assert_allclose(w[3], want, rtol=1e-12)
  # The statuses of overflowing scaled scores are unchanged: INF.
  _, status = dj.draft_weights(np.array([[0.0, 100.0]]), temperature=1e-307)
  assert int(status[0]) == S.INF


_score = st.one_of(
    st.floats(-1e300, 1e300), st.sampled_from([-np.inf, 0.0, 1e20, -1e20]),
    st.builds(lambda m, e: m * 2.0 ** e, st.floats(-1, 1), st.integers(
        40, 70)))


@_WITH_FIXTURE
@pytest.mark.usefixtures("row_mode")
@hypothesis.given(
    st.lists(st.lists(_score, min_size=V, max_size=V), min_size=B,
             max_size=B),
    st.lists(st.floats(2.0 ** -20, 4.0), min_size=B, max_size=B),
    st.lists(st.integers(0, M - 1), min_size=B, max_size=B),
    st.booleans())
def test_temperature_path_property(x, t, u, with_bias):
  # |fl(x + bias)| < 2^998 and 1 / T <= 2^20: no scaled score overflows, so
  # every row with a finite score is OK.
  x = np.asarray(x)
  bias = np.linspace(-3, 3, V) * (1e18 if with_bias else 0.0)
  _, ws = _check_temperature_path(x, np.asarray(t), np.asarray(u, np.uint32),
                                  np.broadcast_to(bias, x.shape))
  want = np.where(np.isneginf(x).all(-1), S.ZERO_MASS, S.OK)
  assert ws.tolist() == want.tolist()


# -- 4. canonical sparse rows -------------------------------------------------


@pytest.mark.usefixtures("row_mode")
def test_sparse_rows_must_be_canonical():
  ids, counts, n = _sparse_rows()
  # A live entry of count 0 (n = 3 for a support of 2).
  ids[0, 0], counts[0, 0], n[0, 0] = [1, 3, 5, -1], [M // 2, 0, M // 2, 0], 3
  counts[1, 1, 2] = 7                              # a count in the padding
  ids[2, 0, 3] = 4                                 # an id in the padding
  want = [S.MISSING_Q, S.PADDING_NONZERO, S.PADDING_NONZERO, S.OK]
  assert _verify(dj.SparseQ(ids, counts, n)) == want
  assert [_chain_oracle(ref.sparse_q_status(ids[r, i], counts[r, i], n[r, i],
                                            V) for i in range(D))
          for r in range(B)] == want
  # An allocation's output is canonical.
  x, t = _logit_rows()
  w, _ = dj.draft_weights(x, temperature=t)
  stack = lambda a: np.repeat(np.asarray(a)[:, None], D, 1)
  allocated = dj.SparseQ(*(stack(a) for a in dj.allocate_sparse(w, K)[:3]))
  assert _verify(allocated) == [S.OK] * B
  # Dense rows: mass beyond V in the mesh's padded layout (ids 7).
  dense = np.zeros((B, D, SHARDS * 4), np.int32)
  dense[..., :V] = _dense_rows()
  dense[0, 1, 0] -= 1
  dense[0, 1, V] = 1
  target, tokens, keys = _chain_inputs()
  status = sharding.verify_batch(target, dj.DenseQ(dense), tokens, keys,
                                 mesh=meshes.vocab_mesh(SHARDS))[2]
  assert np.asarray(status).tolist() == [S.PADDING_NONZERO, S.OK, S.OK, S.OK]


def test_a_wire_row_with_zero_q_reaches_the_core_canonical():
  # On the wire a sparse row may list ids with q = 0 and its entries past n
  # are never read; `to_q` hands verification the canonical SparseQ.
  values = np.array([[0.5, 0, 0.25, 0.25, np.nan]], np.float32)
  ids = np.array([[1, 3, 4, 6, 2]], np.int32)
  n, token = np.array([4], np.int32), np.array([4], np.int32)
  for xp in (np, jnp):
    counts, status = qrows.sparse(values.view(np.uint32), ids, n, token,
                                  vocab=V, xp=xp)
    assert np.asarray(status).tolist() == [S.OK]
  assert ref.sparse_q_counts(values[0], ids[0], 4, V, 4)[1] == S.OK
  np.testing.assert_array_equal(
      wire.validate_q_row(values[0, :4], ids[0, :4], vocab_size=V, token=4),
      [M // 2, 0, M // 4, M // 4])
  fmt = qformats.get(Representation.SPARSE)
  rows = qformats.Rows(token, n, ids, values)
  for device in (False, True):
    verdict = fmt.validate(rows, vocab=V, device=device)
    assert verdict.codes.tolist() == [0]
    q = fmt.to_q(np.asarray(verdict.counts), rows)
    assert [np.asarray(a).tolist() for a in q] == [
        [[1, 4, 6, -1, -1]], [[M // 2, M // 4, M // 4, 0, 0]], [3]]
  # The same row as a SparseQ (padding (-1, 0)) is not canonical: a live
  # count of 0 is MISSING_Q.
  sq = (np.asarray(counts), np.where(np.arange(5) < 4, ids, -1), n)
  assert ref.sparse_q_status(sq[1][0], sq[0][0], 4, V) == S.MISSING_Q
  assert qrows.sparse_counts(*sq, vocab=V)[1].tolist() == [S.MISSING_Q]
  # A zero at the token is the wire's ZERO_Q_AT_TOKEN, before all else.
  with pytest.raises(ProtocolError) as info:
    wire.validate_q_row(values[0, :4], ids[0, :4], vocab_size=V, token=3)
  assert info.value.code == Code.ZERO_Q_AT_TOKEN


# -- every op's status against the oracle, at every integer bound -------------

_EDGES = (0, 1, M - 1, M, M + 1, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1,
          2 ** 32 - 1, 2 ** 32, 2 ** 32 + 1, 2 ** 32 + M, 2 ** 63 - 1)
_VALUES = st.sampled_from(_EDGES + tuple(-e for e in _EDGES if e) + (-1,))
_SHIFTS = st.sampled_from((1, -1, 2 ** 31, -2 ** 31, 2 ** 32, -2 ** 32))
_IDS = st.sampled_from((-1, 0, V - 1, V, -2, 2 ** 31 - 1, 2 ** 31,
                        2 ** 32 + 3, -2 ** 32 + 1, 2 ** 64 - 1))
_NS = st.sampled_from((-1, 0, 1, K, K + 1, 2 ** 31, 2 ** 32 + 1,
                       2 ** 64 - 1))


def _stored(values, dtype):
  """The integers a dtype array holds for `values` (modulo 2^bits)."""
  info = np.iinfo(dtype)
  span = 1 << info.bits
  out = [v % span for v in np.ravel(np.asarray(values, object)).tolist()]
  out = [v - span if v > info.max else v for v in out]
  return np.asarray(out, dtype).reshape(np.shape(values))


@st.composite
def _partition(draw, parts, positive):
  """`parts` counts summing to M (each >= 1 when positive)."""
  lo = 1 if positive else 0
  cuts = sorted(draw(st.lists(st.integers(lo, M - lo), min_size=parts - 1,
                              max_size=parts - 1, unique=positive)))
  edges = [0] + cuts + [M]
  return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def _edited(draw, row, positions):
  """row with up to two edits: a value set to a bound, shifted across one,
  or 2^32 moved from one entry to another (the sum kept)."""
  row = list(row)
  for _ in range(draw(st.integers(0, 2))):
    j = draw(st.integers(0, positions - 1))
    kind = draw(st.integers(0, 2))
    if kind == 0:
      row[j] = draw(_VALUES)
    elif kind == 1:
      row[j] += draw(_SHIFTS)
    else:
      other = draw(st.integers(0, positions - 1))
      row[j] += 2 ** 32
      row[other] -= 2 ** 32
  return row


@st.composite
def _dense_case(draw):
  return [[draw(_edited(draw(_partition(V, False)), V)) for _ in range(D)]
          for _ in range(B)]


@st.composite
def _sparse_row(draw):
  live = draw(st.integers(1, K))
  ids = sorted(draw(st.lists(st.integers(0, V - 1), min_size=live,
                             max_size=live, unique=True)))
  ids = ids + [-1] * (K - live)
  counts = draw(_partition(live, True)) + [0] * (K - live)
  n = live
  for _ in range(draw(st.integers(0, 2))):
    what = draw(st.integers(0, 2))
    if what == 0:
      counts = draw(_edited(counts, K))
    elif what == 1:
      ids[draw(st.integers(0, K - 1))] = draw(_IDS)
    else:
      n = draw(_NS)
  return ids, counts, n


@st.composite
def _sparse_case(draw):
  rows = [[draw(_sparse_row()) for _ in range(D)] for _ in range(B)]
  return tuple([[row[f] for row in request] for request in rows]
               for f in range(3))


@_WITH_FIXTURE
@pytest.mark.usefixtures("row_mode")
@hypothesis.given(st.sampled_from(DTYPES), _dense_case(), _sparse_case())
def test_statuses_equal_the_oracle_at_every_integer_bound(dtype, dense,
                                                          sparse):
  counts = _stored(dense, dtype)
  want = [_chain_oracle([ref.dense_q_status(counts[r, i], V)
                         for i in range(D)]) for r in range(B)]
  assert _verify(dj.DenseQ(counts)) == want
  ids, scounts, n = (_stored(a, dtype) for a in sparse)
  rows = [[ref.sparse_q_status(ids[r, i], scounts[r, i], n[r, i], V)
           for i in range(D)] for r in range(B)]
  assert _verify(dj.SparseQ(ids, scounts, n)) == [_chain_oracle(r)
                                                  for r in rows]
  for xp in (np, jnp):
    got = qrows.sparse_counts(scounts, ids, n, vocab=V, xp=xp)[1]
    assert np.asarray(got).tolist() == rows
