"""Categorical draws by exact integer cumulative mass.

    token = first index v whose inclusive cumulative weight C_v is > u

`sample_counts` (the proposal draw) scans with the reducer's
`first_cum_greater` (`dyadic_jax.cumulative` on one device); `draw_below`
maps 64 random bits to an integer below n for the verifier's draws.
"""

import functools

import jax
import jax.numpy as jnp

from dyadic_jax import rowops, x64


def _sample_row(counts, draw, red):
  return red.first_cum_greater(counts, draw.astype(jnp.int64))


@functools.partial(jax.jit, static_argnames="executor")
def _sample_counts(counts, draw, executor):
  return executor.run(
      rowops.declare(_sample_row, (rowops.Arg(1, 0), rowops.Arg(0)), False,
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
