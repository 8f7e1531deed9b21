"""The integer categorical scan: first index whose cumulative weight is > u.

    token = first index v whose inclusive cumulative weight C_v is > u

The scan is two-level (block sums, then one block), so a row is read about
once instead of paying a full-row cumulative sum. A row's weights enter as
a `Blocked`: its inclusive block cumsum and a way to get one block's
weights. `blocked` makes one from int weights; `blocked_limbs` from
weights W = a 2^s - b held as two float64 integer rows (verification's
residual, which never forms an int64 row: XLA CPU does not vectorize the
float64 -> int64 conversion). Integers throughout: the answer depends only
on the weights and u, never on a summation order. The local `Reducer`
scans with `first_cum_greater`; a mesh's scans each shard with `scan`
(sharding/collectives.py).
"""

import typing

import jax
import jax.numpy as jnp

_BLOCK = 256


class Blocked(typing.NamedTuple):
  """Nonnegative integer weights [..., n] prepared for the two-level scan."""
  cum: jax.Array            # int64[..., nb]: inclusive cumsum of block sums
  block: typing.Callable    # int32 blk[...] -> int64 weights[..., b] of blk
  n: int                    # weights per row (padding to nb * b is zero)


def _as_blocks(x: jax.Array) -> jax.Array:
  """x[..., n] -> [..., nb, b], zero-padded to whole blocks."""
  n = x.shape[-1]
  b = min(_BLOCK, n)
  pad = (-n) % b
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(x.shape[:-1] + ((n + pad) // b, b))


def _take(blocks: jax.Array, blk: jax.Array) -> jax.Array:
  return jnp.take_along_axis(blocks, blk[..., None, None], -2)[..., 0, :]


def blocked(weights: jax.Array) -> Blocked:
  """`Blocked` of nonnegative int weights[..., n] (row totals below 2^63)."""
  blocks = _as_blocks(weights.astype(jnp.int64))
  return Blocked(jnp.cumsum(jnp.sum(blocks, -1), -1),
                 lambda blk: _take(blocks, blk), weights.shape[-1])


def blocked_limbs(a: jax.Array, b: jax.Array | None, shift: int,
                  fallback: jax.Array | None = None,
                  use_fallback: typing.Callable | None = None) -> Blocked:
  """`Blocked` of W = a 2^shift - b from float64 integer rows a, b[..., n].

  b = None is a zero row (not summed). Every row total of a and of b
  (hence every block sum) must be an integer below 2^53, and W's row
  totals below 2^63: the block sums are then exact in float64 and W's in
  int64. With `fallback` (float64 integers, weights fallback 2^shift),
  `use_fallback(local W totals)` -> bool[...] picks the fallback's weights
  instead (a mesh passes a function that sums the shards' totals).
  """
  if (fallback is None) != (use_fallback is None):
    raise ValueError("blocked_limbs: fallback and use_fallback go together")
  rows = [r for r in (a, b, fallback) if r is not None]
  blocks = tuple(_as_blocks(r) for r in rows)
  # One plain reduction per row: on XLA CPU a variadic reduce over these
  # rows made the residual draw about 1.5-2x slower (unlike one_pass's
  # sibling reductions of a single input, where variadic is faster).
  sums = [jnp.sum(x, -1) for x in blocks]
  scale = jnp.int64(1) << shift

  def ints(x):
    return x.astype(jnp.int64)

  def limb_weights(limbs, blk=None):
    # W of (a, b) from their block sums, or from one block of them.
    values = limbs if blk is None else [_take(x, blk) for x in limbs]
    w = ints(values[0]) * scale
    return w - ints(values[1]) if len(values) > 1 else w

  n_ab = 1 if b is None else 2
  ab_sums, ab_blocks = sums[:n_ab], blocks[:n_ab]
  cum = jnp.cumsum(limb_weights(ab_sums), -1)
  if use_fallback is None:
    return Blocked(cum, lambda blk: limb_weights(ab_blocks, blk), a.shape[-1])
  use = use_fallback(cum[..., -1])
  return Blocked(
      jnp.where(use[..., None], jnp.cumsum(limb_weights(sums[-1:]), -1), cum),
      lambda blk: jnp.where(use[..., None], limb_weights(blocks[-1:], blk),
                            limb_weights(ab_blocks, blk)),
      a.shape[-1])


def scan(w: Blocked, u: jax.Array) -> jax.Array:
  """First index < w.n whose inclusive cumulative weight is > u (n if none)."""
  nb = w.cum.shape[-1]
  u = u.astype(jnp.int64)[..., None]
  blk = jnp.sum(w.cum <= u, -1, dtype=jnp.int32)            # [...]
  blk_c = jnp.minimum(blk, nb - 1)
  prev = jnp.take_along_axis(w.cum, jnp.maximum(blk_c - 1, 0)[..., None], -1)
  before = jnp.where(blk_c[..., None] > 0, prev, 0)
  row = w.block(blk_c)
  inner = jnp.sum(jnp.cumsum(row, -1) <= u - before, -1, dtype=jnp.int32)
  idx = jnp.minimum(blk_c * row.shape[-1] + inner, w.n)
  return jnp.where(blk >= nb, w.n, idx).astype(jnp.int32)


def first_cum_greater(weights: jax.Array | Blocked,
                      u: jax.Array | typing.Callable) -> jax.Array:
  """First index whose inclusive cumulative weight is > u, per row.

  weights: nonnegative int[..., N] with row totals below 2^63, or a
  `Blocked`; u: int[...], or a function of the row totals (int64[...])
  that returns it (a categorical draw below the total). Returns int32[...]
  in [0, N); N when u >= the row total. An index with zero weight is
  never returned.
  """
  w = weights if isinstance(weights, Blocked) else blocked(weights)
  return scan(w, u(w.cum[..., -1]) if callable(u) else u)
