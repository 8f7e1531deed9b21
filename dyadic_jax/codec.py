"""The exact dyadic codec between int32 counts and float32 q = c / M.

Every c in [0, M] is exact in float32 and so is c * 2^-24; the decoder
inverts that exactly and refuses anything else. It never renormalizes.
"""

import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax import x64
from dyadic_jax.constants import LOG2_M, M, Status


@jax.jit
def _counts_to_q(counts):
  return counts.astype(jnp.float32) * jnp.float32(2.0 ** -LOG2_M)


def counts_to_q(counts):
  """q(v) = c_v / M as float32; exact for every count in [0, M]."""
  return _counts_to_q(jnp.asarray(counts, jnp.int32))


@jax.jit
def _q_to_counts(q, limit):
  s = q * jnp.float32(M)  # exact scaling by a power of two
  ids = jnp.arange(q.shape[-1])
  status = jnp.select(
      [jnp.any(jnp.isnan(q), -1),
       jnp.any(jnp.isinf(q), -1),
       jnp.any(q < 0, -1),
       jnp.any(jnp.floor(s) != s, -1),
       jnp.any(s > M, -1),
       jnp.any((ids >= limit) & (q != 0), -1)],
      [Status.NAN, Status.INF, Status.NEGATIVE, Status.NON_INTEGER,
       Status.OUT_OF_RANGE, Status.PADDING_NONZERO], Status.OK)
  fine = status == Status.OK
  counts = jnp.where(fine[..., None], s, 0).astype(jnp.int32)
  total = jnp.sum(counts.astype(jnp.uint64), -1)
  status = jnp.where(fine & (total != M), Status.WRONG_SUM, status)
  counts = jnp.where((status == Status.OK)[..., None], counts, 0)
  return counts, status.astype(jnp.int32)


@x64.scoped
def q_to_counts(q, *, vocab_size=None):
  """Decodes float32 q[..., N] into int32 counts, refusing any non-dyadic row.

  Checks, in this order, per row: NaN (Status.NAN), +-inf (INF), negative
  values (NEGATIVE), q * M not an integer (NON_INTEGER), q * M > M
  (OUT_OF_RANGE), non-zero q at an index >= vocab_size when the row is
  padded beyond the vocabulary (PADDING_NONZERO), and a uint64 sum other
  than exactly M (WRONG_SUM). -0.0 decodes as 0. Refused rows decode to
  all-zero counts.

  Returns:
    (counts int32[..., N], status int32[...]).
  """
  q = jnp.asarray(q)
  if q.dtype != jnp.float32:
    raise TypeError(f"q_to_counts: q must be float32, got {q.dtype}")
  n = q.shape[-1]
  limit = n if vocab_size is None else int(vocab_size)
  if not 1 <= limit <= n:
    raise ValueError(f"q_to_counts: vocab_size={limit} not in [1, {n}]")
  return _q_to_counts(q, np.int64(limit))
