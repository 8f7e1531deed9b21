"""propose_dense / propose_sparse: the three ops they fuse, bit for bit.

Each case compares the one-op proposal row with draft_weights ->
allocate_dense (or allocate_sparse) -> sample_counts on the same inputs
(random, masked, one-live-id, all-equal and refused rows; temperatures
that are refused; a bias), in both row modes; a few rows also against the
exact oracle. The two-level top-k the sparse path uses is held to
`lax.top_k` on rows built to tie across block boundaries. Sharded forms:
tests/sharding/test_ops.py.
"""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import allocation, reference
from dyadic_jax.constants import Status
from dyadic_jax.testing import adversarial

M = dj.M


def _inputs(v, seed=0):
  """Logit rows (the adversarial four plus NaN, +inf and spiky rows), a
  temperature per row (two refused), a bias and draws."""
  gen = np.random.default_rng(seed)
  x = adversarial.logit_rows(v)
  extra = (gen.normal(size=(4, v)) * 8).astype(np.float32)
  extra[0, v // 3] = np.nan
  extra[1, 0] = np.inf
  extra[2, : v // 2] = 40.0                    # many equal maxima
  x = np.concatenate([x, extra])
  t = np.array([1.0, 0.7, 1.3, 2.0, 1.0, 1.0, 0.0, -1.0])
  t[3] = 5e-324                                # subnormal: refused
  bias = np.linspace(-2, 2, v, dtype=np.float32)
  draws = gen.integers(0, M, len(x)).astype(np.uint32)
  draws[5] = M - 1
  return x, t, bias, draws


def _separate_dense(x, t, bias, u):
  w, ws = dj.draft_weights(x, temperature=t, bias=bias)
  counts, cs = dj.allocate_dense(w)
  status = np.where(np.asarray(ws) != 0, ws, cs)
  token = np.where(status == 0, dj.sample_counts(counts, u), -1)
  return np.asarray(counts), token, status


def _separate_sparse(x, t, bias, u, k):
  w, ws = dj.draft_weights(x, temperature=t, bias=bias)
  ids, counts, n, cs = (np.asarray(a) for a in dj.allocate_sparse(w, k))
  status = np.where(np.asarray(ws) != 0, ws, cs)
  slot = np.asarray(dj.sample_counts(counts, u))
  token = ids[np.arange(len(ids)), np.minimum(slot, k - 1)]
  return ids, counts, n, np.where(status == 0, token, -1), status


def _assert_equal(a, b):
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.qualify
# By default one block and several, the last partial; whole blocks (4096)
# under --runslow.
@pytest.mark.parametrize("v", [7, 1001,
                               pytest.param(4096, marks=pytest.mark.slow)])
def test_dense_equals_the_three_ops(row_mode, v):
  del row_mode
  x, t, bias, u = _inputs(v)
  got = dj.propose_dense(x, u, temperature=t, bias=bias)
  _assert_equal(got, _separate_dense(x, t, bias, u))
  status = np.asarray(got[2])
  assert set(status[4:]) >= {Status.NAN, Status.INF, Status.BAD_TEMPERATURE}
  assert np.all(np.asarray(got[1])[status != 0] == -1)
  assert np.all(np.asarray(got[0])[status == 0].sum(-1) == M)


@pytest.mark.qualify
# By default k = 1 and a top-k across partial blocks; k = V and the other
# sizes under --runslow.
@pytest.mark.parametrize("v,k", [
    (7, 1), (1001, 32),
    *(pytest.param(v, k, marks=pytest.mark.slow)
      for v, k in [(7, 7), (1001, 3), (4096, 8), (4096, 32)])])
def test_sparse_equals_the_three_ops(row_mode, v, k):
  del row_mode
  x, t, bias, u = _inputs(v, seed=k)
  got = dj.propose_sparse(x, u, k, temperature=t, bias=bias)
  _assert_equal(got, _separate_sparse(x, t, bias, u, k))
  status = np.asarray(got[4])
  assert np.all(np.asarray(got[3])[status != 0] == -1)
  assert np.all(np.asarray(got[2])[status != 0] == 0)


def test_batch_shapes_and_no_temperature():
  x, _, _, u = _inputs(1001)
  x, u = x[:6].reshape(2, 3, -1), u[:6].reshape(2, 3)
  counts, token, status = dj.propose_dense(x, u)
  assert counts.shape == x.shape and token.shape == status.shape == (2, 3)
  flat = _separate_dense(x.reshape(6, -1), 1.0, None, u.reshape(6))
  _assert_equal((counts.reshape(6, -1), token.reshape(6),
                 status.reshape(6)), flat)
  one = dj.propose_sparse(x[0, 0], u[0, 0], 5)
  assert one[0].shape == (5,) and one[3].shape == ()


def test_rows_against_the_oracle():
  x, t, bias, u = _inputs(1001, seed=3)
  w, _ = dj.draft_weights(x, temperature=t, bias=bias)
  counts, token, status = dj.propose_dense(x, u, temperature=t, bias=bias)
  for i in np.flatnonzero(np.asarray(status) == 0):
    ref_counts, ref_status = reference.allocate_dense(np.asarray(w[i]))
    assert ref_status == Status.OK
    np.testing.assert_array_equal(np.asarray(counts[i]), ref_counts)
    assert int(token[i]) == reference.sample_counts(ref_counts, int(u[i]))
  ids, s_counts, n, s_token, s_status = dj.propose_sparse(
      x, u, 16, temperature=t, bias=bias)
  for i in np.flatnonzero(np.asarray(s_status) == 0):
    ref_ids, ref_counts, ref_n, ref_status = reference.allocate_sparse(
        np.asarray(w[i]), 16)
    assert ref_status == Status.OK and ref_n == int(n[i])
    np.testing.assert_array_equal(np.asarray(ids[i]), ref_ids)
    np.testing.assert_array_equal(np.asarray(s_counts[i]), ref_counts)
    slot = reference.sample_counts(ref_counts, int(u[i]))
    assert int(s_token[i]) == ref_ids[slot]


def _tie_rows(n, k):
  """Key rows (float32 >= 0) that tie within and across blocks of 64."""
  gen = np.random.default_rng(n + k)
  rows = [gen.random(n), np.zeros(n), np.full(n, 0.5)]
  spread = np.zeros(n)
  spread[::97] = 1.0                        # k-th key tied far apart
  rows.append(spread)
  edge = gen.random(n) * 0.1
  edge[63:66] = 1.0                         # a tie across a block edge
  edge[[5, min(640, n - 2), n - 1]] = 2.0
  rows.append(edge)
  few = np.zeros(n)
  few[[3, 200, n - 2]] = 1.0                # fewer positive keys than k
  rows.append(few)
  return np.asarray(rows, np.float32)


def _block_max(x):
  b = allocation.CANDIDATE_BLOCK
  pad = (-x.shape[-1]) % b
  return jnp.pad(x, [(0, 0), (0, pad)]).reshape(x.shape[0], -1, b).max(-1)


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("n,k", [(256, 1), (1001, 3), (4096, 8),
                                 (129280, 32)])
def test_two_level_top_k_is_lax_top_k(n, k, given):
  # given: the block maxima come from an earlier pass (what
  # weights.softmax64_block_parts hands propose_sparse); the key is then
  # applied to them, which is the max of the keys for a monotone key.
  keys = jnp.asarray(_tie_rows(n, k))
  top_k = jax.jit(lambda x, m: allocation._top_k(
      x, lambda v: v, k, m if given else None))
  vals, idx, unique = top_k(keys, _block_max(keys))
  want_vals, want_idx = lax.top_k(keys, k)
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  kth = np.asarray(want_vals).min(-1, keepdims=True)
  np.testing.assert_array_equal(
      np.asarray(unique), (np.asarray(keys) >= kth).sum(-1) == k)


@pytest.mark.parametrize("n,k", [(4096, 8), (129280, 32)])
def test_top_k_keys_block_maxima_of_the_raw_weights(n, k):
  # propose_sparse keys float64 weights fl(e * scale) rounded down to
  # float32 and takes the block maxima of e itself: the same ids as the
  # top k of the keys of the whole product row, ties included (weights
  # that differ in float64 share a key; equal e share a product).
  gen = np.random.default_rng(n)
  with jax.enable_x64(True):
    e = gen.random((4, n)) ** 8
    e[1, ::7] = e[1, 3]                      # ties in e
    e[2] = 1.0 + gen.integers(0, 3, n) * 2.0 ** -40   # one float32 key
    e[3, 100:] = 0.0                         # fewer positive than k
    e = jnp.asarray(e)
    scale = jnp.asarray([1 / 3, 0.7, 1.0, 2.0 ** -20])
    ok = jnp.ones(4, bool)
    key = lambda v: allocation._round_down_f32(v * scale[:, None], ok)
    _, idx, _ = jax.jit(lambda e, m: allocation._top_k(e, key, k, m))(
        e, _block_max(e))
    _, want = lax.top_k(key(e), k)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))


def test_bad_inputs_are_refused():
  x, _, _, u = _inputs(7)
  with pytest.raises(ValueError, match="draw shape"):
    dj.propose_dense(x, u[:3])
  with pytest.raises(ValueError, match="k=8"):
    dj.propose_sparse(x, u, 8)
  with pytest.raises(ValueError, match="0-d"):
    dj.propose_dense(np.float32(1.0), np.uint32(0))
