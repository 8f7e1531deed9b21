"""The exact dyadic codec between int32 counts and float32 q = c / M.

Every c in [0, M] is exact in float32 and so is c * 2^-24; the decoder
inverts that exactly and refuses anything else. It never renormalizes, and
it judges q on its bit patterns (`dyadic_jax.qrows`), so no backend's
flush-to-zero of subnormals can change a verdict.
"""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from dyadic_jax import qrows
from dyadic_jax import x64
from dyadic_jax.constants import LOG2_M


@jax.jit
def _counts_to_q(counts):
  return counts.astype(jnp.float32) * jnp.float32(2.0 ** -LOG2_M)


def counts_to_q(counts: jax.typing.ArrayLike) -> jax.Array:
  """q(v) = c_v / M as float32; exact for every count in [0, M]."""
  return _counts_to_q(jnp.asarray(counts, jnp.int32))


@jax.jit
def _q_to_counts(q, limit, token):
  return qrows.dense(lax.bitcast_convert_type(q, jnp.uint32), token,
                     vocab=limit, xp=jnp)


def _check_q(q, vocab_size, token):
  if q.dtype != jnp.float32:
    raise TypeError(f"q_to_counts: q must be float32, got {q.dtype}")
  if q.ndim < 1:
    raise ValueError(f"q_to_counts: q must have a vocabulary axis, got shape "
                     f"{q.shape}")
  n = q.shape[-1]
  limit = n if vocab_size is None else int(vocab_size)
  if not 1 <= limit <= n:
    raise ValueError(f"q_to_counts: vocab_size={limit} not in [1, {n}]")
  if token is not None and token.shape != q.shape[:-1]:
    raise ValueError(f"q_to_counts: token shape {token.shape} must be the "
                     f"batch shape {q.shape[:-1]}")
  return limit


@x64.scoped
def q_to_counts(q: jax.typing.ArrayLike, *, vocab_size: int | None = None,
                token: jax.typing.ArrayLike | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """Decodes float32 q[..., N] into int32 counts, refusing any non-dyadic row.

  Judged on the float32 bit patterns (`dyadic_jax.qrows.dense`). Checks, in
  this order, per row (the first failing class is reported):
  TOKEN_OUT_OF_RANGE (only with `token`), NAN, INF (either sign), NEGATIVE
  (any value with the sign bit and a nonzero magnitude, subnormals
  included), WRONG_MASS (a value above 1), NON_DYADIC (q * M not an
  integer; every float32 subnormal), PADDING_NONZERO (nonzero q at an index
  >= vocab_size), WRONG_MASS (the exact count sum is not M),
  ZERO_Q_AT_TOKEN (only with `token`: zero q at the token). -0.0 decodes as
  0. Refused rows decode to all-zero counts.

  Args:
    q: float32[..., N].
    vocab_size: V <= N; ids in [V, N) are padding (default N).
    token: optional int[...], the token sampled from each row.

  Returns:
    (counts int32[..., N], status int32[...]).
  """
  q = jnp.asarray(q)
  if token is not None:
    token = jnp.asarray(token, jnp.int32)
  limit = _check_q(q, vocab_size, token)
  return _q_to_counts(q, np.int64(limit), token)
