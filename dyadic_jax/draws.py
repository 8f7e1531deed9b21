"""Categorical draws by exact integer cumulative mass.

    token = first index v whose inclusive cumulative weight C_v is > u

The scan is two-level (block sums, then one block), so a row is read about
once instead of paying a full-row cumulative sum. Integers throughout: the
answer depends only on the weights and u, never on a summation order.
"""

import functools

import jax
import jax.numpy as jnp

from dyadic_jax import rowops, x64

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


def _sample_row(counts, draw, red):
  return red.first_cum_greater(counts, draw.astype(jnp.int64))


@functools.partial(jax.jit, static_argnames="executor")
def _sample_counts(counts, draw, executor):
  return executor.run(
      rowops.rows(_sample_row, (rowops.Arg(1, 0), rowops.Arg(0)), False,
                  counts.shape[-1]), counts, draw)


@x64.scoped
def sample_counts(counts: jax.typing.ArrayLike,
                  draw: jax.typing.ArrayLike, *,
                  executor: rowops.Executor = rowops.LOCAL) -> jax.Array:
  """Maps a 24-bit draw to an index by integer cumulative counts.

  Args:
    counts: int32[..., N] nonnegative counts summing to M per row (a dense
      row, or the counts of a sparse row).
    draw: uint32[...] in [0, M), e.g. `rng.draw24(key)`.

  Returns:
    int32[...]: the first index whose inclusive cumulative count is > draw
    (for a sparse row, the position within the row). With a valid row every
    index v is returned for exactly c_v of the M draws. N if draw >= sum.
  """
  counts, draw = jnp.asarray(counts), jnp.asarray(draw)
  if counts.ndim < 1:
    raise ValueError("sample_counts: expected count rows [..., N], got a 0-d "
                     "array")
  if draw.shape != counts.shape[:-1]:
    raise ValueError(f"sample_counts: draw shape {draw.shape} must be the "
                     f"batch shape {counts.shape[:-1]} of counts")
  return _sample_counts(counts, draw, executor)


def mulhi64(a: jax.Array, b: jax.Array) -> jax.Array:
  """floor(a * b / 2^64) for uint64 a, b, from 32-bit limbs (no overflow)."""
  mask = jnp.uint64(0xFFFFFFFF)
  a_lo, a_hi = a & mask, a >> jnp.uint64(32)
  b_lo, b_hi = b & mask, b >> jnp.uint64(32)
  t = a_lo * b_lo
  m1 = a_hi * b_lo + (t >> jnp.uint64(32))
  m2 = a_lo * b_hi + (m1 & mask)
  return a_hi * b_hi + (m1 >> jnp.uint64(32)) + (m2 >> jnp.uint64(32))


def draw_below(bits: jax.Array, n: jax.Array) -> jax.Array:
  """u = floor(bits * n / 2^64) in [0, n) from 64 uniform bits (uint64).

  P(u < a) = ceil(a * 2^64 / n) / 2^64 exactly, within 2^-64 of a / n for
  every a: the contiguous-interval map keeps each event's error below one
  part in 2^64 (a modulo would not).
  """
  return mulhi64(bits.astype(jnp.uint64), n.astype(jnp.uint64))
