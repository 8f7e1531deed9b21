"""The integer categorical scan: first index whose cumulative weight is > u.

    token = first index v whose inclusive cumulative weight C_v is > u

The scan is two-level (block sums, then one block), so a row is read about
once instead of paying a full-row cumulative sum. Integers throughout: the
answer depends only on the weights and u, never on a summation order. The
local `Reducer` scans with `first_cum_greater`; a mesh's scans each shard
with `cumulative_blocks` and `scan_blocks` (sharding/collectives.py).
"""

import jax
import jax.numpy as jnp

_BLOCK = 256


def cumulative_blocks(weights: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(blocks int64[..., nb, b], inclusive block cumsum int64[..., nb]).

  The row's exact total is block_cum[..., -1] (no extra pass).
  """
  w = weights.astype(jnp.int64)
  n = w.shape[-1]
  b = min(_BLOCK, n)
  pad = (-n) % b
  if pad:
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)])
  blocks = w.reshape(w.shape[:-1] + ((n + pad) // b, b))
  return blocks, jnp.cumsum(jnp.sum(blocks, -1), -1)


def scan_blocks(blocks: jax.Array, block_cum: jax.Array, u: jax.Array,
                n: int) -> jax.Array:
  """First index < n whose inclusive cumulative weight is > u (n if none)."""
  nb, b = blocks.shape[-2:]
  u = u.astype(jnp.int64)[..., None]
  blk = jnp.sum(block_cum <= u, -1, dtype=jnp.int32)       # [...]
  blk_c = jnp.minimum(blk, nb - 1)
  prev = jnp.take_along_axis(block_cum, jnp.maximum(blk_c - 1, 0)[..., None],
                             -1)
  before = jnp.where(blk_c[..., None] > 0, prev, 0)
  row = jnp.take_along_axis(blocks, blk_c[..., None, None], -2)[..., 0, :]
  inner = jnp.sum(jnp.cumsum(row, -1) <= u - before, -1, dtype=jnp.int32)
  idx = jnp.minimum(blk_c * b + inner, n)
  return jnp.where(blk >= nb, n, idx).astype(jnp.int32)


def first_cum_greater(weights: jax.Array, u: jax.Array) -> jax.Array:
  """First index whose inclusive cumulative weight is > u, per row.

  weights: nonnegative int[..., N] with row totals below 2^63; u: int[...].
  Returns int32[...] in [0, N); N when u >= the row total. An index with
  zero weight is never returned.
  """
  blocks, block_cum = cumulative_blocks(weights)
  return scan_blocks(blocks, block_cum, u, weights.shape[-1])
