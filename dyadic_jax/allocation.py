"""Integer ticket allocation: dyadic counts c_v with sum exactly M.

Dense: floor plus largest remainders over the whole vocabulary; sparse: exact
global top-k support, renormalized, then the same allocation on the support.

No sort touches a vocabulary-sized row. The R leftover tickets go to the R
largest remainders (ties to the lowest id), found by an exact bisection on
the remainders' int64 bit patterns (a nonnegative float64 orders like its
bits): each step is one comparison-and-count pass, and counts are integers,
so the answer is the same for any reduction order or sharding.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dyadic_jax import reducer
from dyadic_jax import rowwise
from dyadic_jax import x64
from dyadic_jax.weights import exact_sums, reciprocal
from dyadic_jax.constants import M, Status

_FIXED_REMAINDER_BITS = 32
_INT64_MAX = (1 << 63) - 1
_REMAINDER_COARSE_BITS = 20
_SMALL = 64  # tie-set size ranked exactly after the coarse bisection
_TINY32 = 2.0 ** -126  # smallest normal float32: the key of every tiny w > 0


def threshold_search(count_at_least, r, lo, hi, steps):
  """Largest t in [lo, hi) with count_at_least(t) >= r, by bisection.

  Preconditions: count_at_least is non-increasing, count_at_least(lo) >= r
  and count_at_least(hi) < r; `steps` >= log2(hi - lo). `r` is int64 with
  the batch shape; the result too.
  """
  def body(_, lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    take = count_at_least(mid) >= r
    return jnp.where(take, mid, lo), jnp.where(take, hi, mid)

  lo = jnp.full_like(r, lo, jnp.int64)
  hi = jnp.full_like(r, hi, jnp.int64)
  lo, _ = lax.fori_loop(0, steps, body, (lo, hi))
  return lo


def _counter(red):
  # int32 lanes vectorize twice as wide as int64; counts are <= V < 2^31.
  return lambda mask: red.sum(mask.astype(jnp.int32)).astype(jnp.int64)


def _global_ids(shape, red, dtype=jnp.int64):
  return lax.broadcasted_iota(dtype, shape, len(shape) - 1) + red.offset


def _select_top_exact(key, r, red):
  """`select_top` by bisection on the full 63-bit keys (any tie pattern)."""
  count = _counter(red)
  # Finite float64 >= 0 have bit patterns below the NaN pattern 2^63 - 1.
  t = threshold_search(lambda t: count(key >= t[..., None]), r,
                       0, _INT64_MAX, 63)[..., None]
  above = key > t
  tie = key == t
  need = r - count(above)
  ids = _global_ids(key.shape, red)
  # Smallest cut j with #{ties below j} >= need: the lowest-id ties win.
  n = red.vocab
  cut = threshold_search(lambda j: count(tie & (ids >= j[..., None])),
                         count(tie) - need + 1, 0, n + 1,
                         max(1, (n + 1).bit_length()))
  cut = jnp.where(need > 0, cut + 1, 0)[..., None]
  return above | (tie & (ids < cut))


def _select_top_refined(key, r, above, tied, red):
  """`select_top` when at most _SMALL keys share the coarse threshold.

  Each shard gathers its tied keys (ascending id); all tied keys of the row
  are then ranked exactly by (key desc, global id asc); `need` of them win,
  and each shard marks the winners it owns.
  """
  n = key.shape[-1]
  need = r - _counter(red)(above)
  local = lax.broadcasted_iota(jnp.int32, key.shape, key.ndim - 1)
  # Top-_SMALL of n - id over the tied entries: their ids, ascending.
  rank_key = jnp.where(tied, n - local, 0).astype(jnp.float32)  # n < 2^24
  small = min(_SMALL, n)
  vals, _ = lax.top_k(rank_key, small)
  valid = vals > 0
  tie_local = n - vals.astype(jnp.int32)
  tie_keys = jnp.take_along_axis(key, jnp.minimum(tie_local, n - 1), -1)
  tie_ids = tie_local.astype(jnp.int64) + red.offset
  keys, ids, valid = (red.gather(x) for x in (tie_keys, tie_ids, valid))
  ki, kj = keys[..., :, None], keys[..., None, :]
  ii, ij = ids[..., :, None], ids[..., None, :]
  beats = valid[..., None, :] & ((kj > ki) | ((kj == ki) & (ij < ii)))
  chosen = valid & (jnp.sum(beats, -1) < need[..., None])
  mine = (ids - red.offset).astype(jnp.int32)
  mine = jnp.where(chosen & (mine >= 0) & (mine < n), mine, n)
  batch = key.shape[:-1]
  width = mine.shape[-1]
  scatter = lambda i: jnp.zeros((n,), bool).at[i].set(True, mode="drop")
  picked = jax.vmap(scatter)(mine.reshape((-1, width))).reshape(batch + (n,))
  return above | picked


def select_top(key, r, coarse=None, coarse_bits=32, red=None):
  """Mask of the r largest keys per row, ties to the lowest (global) id.

  key: int64[..., N], bit patterns of finite float64 >= 0 (which order like
  the values); r: int[...] in [0, V]. Exactly r entries are selected: every
  key above the r-th largest key, then the lowest-indexed keys equal to it.

  coarse: optional int32[..., N] in [0, 2^coarse_bits), non-decreasing in
  key (default: the top 32 bits of key). A coarse_bits-step bisection on it
  (int32, half the bytes of a pass) finds the coarse threshold; the few keys
  sharing it are ranked exactly. When more than _SMALL keys of a row share
  it (e.g. all-equal weights), an exact 63-step bisection on the full keys
  decides instead. Every count is an integer: the result is layout-invariant.
  """
  red = reducer.of(key, red)
  count = _counter(red)
  r = r.astype(jnp.int64)
  if coarse is None:
    coarse = ((key >> 31) - (1 << 31)).astype(jnp.int32)
    lo, hi = -(1 << 31), (1 << 31) - 1
  else:
    lo, hi = 0, 1 << coarse_bits
  tc = threshold_search(lambda t: count(coarse >= t[..., None]), r,
                        lo, hi, coarse_bits)
  tc = tc.astype(jnp.int32)[..., None]
  above = coarse > tc
  tied = coarse == tc
  small = jnp.all(count(tied) <= _SMALL)
  return lax.cond(
      small, lambda: _select_top_refined(key, r, above, tied, red),
      lambda: _select_top_exact(key, r, red))


_NAN_BIT, _INF_BIT, _NEGATIVE_BIT, _POSITIVE_BIT = 8, 4, 2, 1


def weight_status(w, red=None):
  """Status of raw weight rows: NAN, INF, NEGATIVE, ZERO_MASS in that order.

  One OR-reduction of per-entry class bits (sibling reductions would fuse
  into a slow multi-output reduction on XLA CPU).
  """
  bits = (jnp.where(jnp.isnan(w), _NAN_BIT, 0)
          | jnp.where(jnp.isinf(w), _INF_BIT, 0)
          | jnp.where(w < 0, _NEGATIVE_BIT, 0)
          | jnp.where(w > 0, _POSITIVE_BIT, 0)).astype(jnp.int32)
  seen = reducer.of(w, red).bit_or(bits)
  return jnp.select(
      [(seen & _NAN_BIT) > 0, (seen & _INF_BIT) > 0,
       (seen & _NEGATIVE_BIT) > 0, (seen & _POSITIVE_BIT) == 0],
      [Status.NAN, Status.INF, Status.NEGATIVE, Status.ZERO_MASS],
      Status.OK).astype(jnp.int32)


def _scaled_parts(w, total):
  """(f, r): floor and exact fractional part of w * total, w clamped to 4.

  A weight above 2 can never be part of a consistent row (its floor alone
  exceeds the total, so R < 0); clamping keeps every conversion in range.
  """
  s = jnp.minimum(w, 4.0) * jnp.float64(total)  # exact: a power of two
  f = jnp.floor(s)
  return f, s - f


def largest_remainder(w, total, red=None):
  """Floor + largest remainders of w * total (see `allocate_dense`)."""
  red = reducer.of(w, red)
  status = weight_status(w, red)
  w = jnp.where((status == Status.OK)[..., None], w, 0.0)
  # Integer-valued float64 terms whose partial sums stay below 2^53: exact
  # in any order (a float64 -> int64 conversion per entry does not
  # vectorize on CPU, so the terms stay float64).
  f_sum, r_fixed = exact_sums(
      w, lambda w: _scaled_parts(w, total)[0],
      lambda w: jnp.floor(_scaled_parts(w, total)[1]
                          * 2.0 ** _FIXED_REMAINDER_BITS), red=red)
  leftover = total - f_sum.astype(jnp.int64)
  # One ticket of slack, measured with integers so every layout agrees. It
  # implies leftover <= #{r > 0}, since every remainder is below 1.
  slack = jnp.abs((leftover << _FIXED_REMAINDER_BITS)
                  - r_fixed.astype(jnp.int64))
  consistent = (leftover >= 0) & (slack < (1 << _FIXED_REMAINDER_BITS))
  status = jnp.where((status == Status.OK) & ~consistent,
                     Status.INCONSISTENT_MASS, status).astype(jnp.int32)
  ok = status == Status.OK
  f, r = _scaled_parts(w, total)
  # r < 1, so floor(r 2^20) orders remainders on a uniform 2^-20 grid; ties
  # on that grid are ranked exactly on the full bits by select_top.
  coarse = (r * 2.0 ** _REMAINDER_COARSE_BITS).astype(jnp.int32)
  tickets = select_top(lax.bitcast_convert_type(r, jnp.int64),
                       jnp.where(ok, leftover, 0), coarse,
                       _REMAINDER_COARSE_BITS, red)
  counts = f.astype(jnp.int32) + tickets
  return jnp.where(ok[..., None], counts, 0), status


_allocate_dense = jax.jit(rowwise.row_op(
    lambda w: largest_remainder(w, M), (1,)))


@x64.scoped
def allocate_dense(weights):
  """Dense dyadic allocation: int32 counts with an exact sum of M per row.

  c_v = floor(w_v M) + [v holds one of the R largest remainders], where
  R = M - sum_v floor(w_v M) and ties between equal remainders go to the
  lowest id. Consequences: |c_v - w_v M| < 1, a zero weight never gets a
  ticket, and sum_v c_v == M exactly.

  Args:
    weights: float[..., V] (float64 expected; float32 is widened exactly),
      normalized to 1.

  Returns:
    (counts int32[..., V], status int32[...]). Refused rows (all counts zero):
    Status.NAN, INF, NEGATIVE, ZERO_MASS, and INCONSISTENT_MASS when the
    weights do not sum to 1 within one ticket: precisely when R < 0, when R
    exceeds the number of nonzero remainders, or when
    |R * 2^32 - sum_v floor(r_v 2^32)| >= 2^32. Never clipped or renormalized.
  """
  w = jnp.asarray(weights).astype(jnp.float64)
  return _allocate_dense(w)


def _round_down_f32(w):
  """Monotone float32 key for w >= 0: round toward zero, positives >= 2^-126."""
  y = w.astype(jnp.float32)
  y = jnp.where(y.astype(jnp.float64) > w, jnp.nextafter(y, jnp.float32(0)), y)
  return jnp.where(w > 0, jnp.maximum(y, jnp.float32(_TINY32)), jnp.float32(0))


def top_k_ids(w, k, red=None):
  """Ascending global ids of the exact top-k of w by (weight desc, id asc).

  Fast path: `lax.top_k` on monotone float32 keys (per shard, then merged
  over the gathered k candidates of every shard), exact whenever the k-th
  key is not tied with an unselected one (or is zero: zero weights are
  dropped later anyway). Otherwise the exact int64-key selection decides.
  """
  red = reducer.of(w, red)
  n = w.shape[-1]
  local_k = min(k, n)
  vals, idx = lax.top_k(_round_down_f32(w), local_k)
  ids = idx.astype(jnp.int32) + red.offset
  if red.collective:
    # Candidates of every shard in shard (= id) order; top_k keeps the
    # lower position first among equal keys, so ties go to the lower id.
    cand_vals, cand_ids = red.gather(vals), red.gather(ids)
    vals, pos = lax.top_k(cand_vals, k)
    ids = jnp.take_along_axis(cand_ids, pos, -1)
  # min, not vals[..., -1]: XLA CPU keeps its fast TopK kernel only for a
  # sort whose users slice [0, k); a folded [k-1, k) slice makes it a full
  # sort. For the same reason #{key32 >= kth} is counted on w itself.
  kth = jnp.min(vals, -1, keepdims=True).astype(jnp.float64)
  at_least = jnp.where(kth > _TINY32, w >= kth, w > 0)
  exact = (_counter(red)(at_least) == k) | (kth[..., 0] == 0)
  fast = jnp.sort(ids, axis=-1)

  def slow(_):
    mask = select_top(lax.bitcast_convert_type(w, jnp.int64),
                      jnp.full(w.shape[:-1], k, jnp.int64), red=red)
    local = lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)
    rank = jnp.where(mask, n - local, -1)
    top, _ = lax.top_k(rank.astype(jnp.float32), local_k)  # exact: n < 2^24
    big = jnp.iinfo(jnp.int32).max
    chosen = jnp.where(top > 0, n - top.astype(jnp.int32) + red.offset, big)
    # Exactly k entries are selected over all shards: the k smallest ids.
    chosen = jnp.sort(red.gather(chosen), axis=-1)[..., :k]
    return jnp.where(exact[..., None], fast, chosen)

  return lax.cond(jnp.all(exact), lambda _: fast, slow, None)


def ordered_sum(x):
  """Sum over the last (small) axis in index order: a fixed rounding sequence."""
  def body(i, acc):
    return acc + lax.dynamic_index_in_dim(x, i, x.ndim - 1, keepdims=False)

  return lax.fori_loop(0, x.shape[-1], body, jnp.zeros(x.shape[:-1], x.dtype))


def sparse_from_support(ids, ws, row_status):
  """Renormalize support weights, allocate M, drop zero counts, pad with -1."""
  k = ids.shape[-1]
  total = ordered_sum(ws)
  ok = row_status == Status.OK
  wn = ws * reciprocal(jnp.where(ok, total, 1.0))[..., None]
  counts, status = largest_remainder(jnp.where(ok[..., None], wn, 0.0), M)
  status = jnp.where(ok, status, row_status).astype(jnp.int32)
  pos = lax.broadcasted_iota(jnp.int32, counts.shape, counts.ndim - 1)
  order = jnp.argsort(jnp.where(counts > 0, pos, k + pos), axis=-1)
  ids = jnp.take_along_axis(ids, order, -1)
  counts = jnp.take_along_axis(counts, order, -1)
  n = jnp.sum(counts > 0, -1, dtype=jnp.int32)
  keep = (pos < n[..., None]) & (status == Status.OK)[..., None]
  return (jnp.where(keep, ids, -1).astype(jnp.int32),
          jnp.where(keep, counts, 0).astype(jnp.int32),
          jnp.where(status == Status.OK, n, 0), status)


@functools.partial(jax.jit, static_argnums=1)
def _allocate_sparse(w, k):
  return rowwise.row_op(lambda w: allocate_sparse_rows(w, k), (1,))(w)


def allocate_sparse_rows(w, k, red=None):
  """The body of `allocate_sparse` on weight rows (local or one shard)."""
  red = reducer.of(w, red)
  status = weight_status(w, red)
  w = jnp.where((status == Status.OK)[..., None], w, 0.0)
  ids = top_k_ids(w, k, red)
  return sparse_from_support(ids, red.lookup(w, ids), status)


@x64.scoped
def allocate_sparse(weights, k):
  """Sparse dyadic allocation on the exact global top-k support.

  The support is the k largest weights, ties to the lowest id. Its weights
  are renormalized in float64 (w_i * fl(1 / W), W summed in ascending-id
  order), then
  allocated exactly as `allocate_dense` does on those k values; entries left
  with zero tickets are dropped.

  Args:
    weights: float[..., V] nonnegative weights (any positive scale).
    k: static int in [1, V].

  Returns:
    (ids int32[..., k], counts int32[..., k], n int32[...], status int32[...]):
    the first n entries hold strictly ascending ids with positive counts
    summing to M; the rest are padding (id -1, count 0). Refused rows have
    n = 0 and status NAN, INF, NEGATIVE or ZERO_MASS.
  """
  w = jnp.asarray(weights).astype(jnp.float64)
  k = int(k)
  if not 1 <= k <= w.shape[-1]:
    raise ValueError(f"allocate_sparse: k={k} not in [1, {w.shape[-1]}]")
  return _allocate_sparse(w, k)


