"""Dense q rows judged as a row op: one verdict however the rows are split.

    check_dense(values, token, draw, *, vocab, executor) -> (counts, status,
                                                            drawn)

`qrows.dense`'s verdict of float32 q rows [..., N] (N = V, or the padded
layout of a vocabulary mesh) written against a `Reducer`, so that with a
mesh executor (`sharding.executor(mesh)`) each vocabulary shard classifies
only its own entries and the row-wide steps are collectives:

* the first failing entry class: an integer max over shards;
* the mass: the sum of the integer counts, an int64 all-reduce, must be
  exactly M = 2^24;
* the count at the token: the owning shard's value (`Reducer.lookup`);
* the sampling audit: the token the PROPOSAL draw selects from the counts
  (`Reducer.first_cum_greater`: the shard by its global count mass, then
  the token within it) must be the drafted one.

That is how a verifier whose ranks each received only their own shard of
q agrees on every row (docs/numerics.md, section 4): the verdict is
replicated, so no rank can accept a row another refuses. Statuses and
their order are `qrows.dense`'s (TOKEN_OUT_OF_RANGE, NAN, INF, NEGATIVE,
WRONG_MASS (> 1), NON_DYADIC, PADDING_NONZERO (ids >= vocab), WRONG_MASS
(sum), ZERO_Q_AT_TOKEN); `drawn` is the audit, meaningful on OK rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dyadic_jax import qrows, rowops, x64
from dyadic_jax.constants import M, Status


def _check_row(values, token, draw, *, vocab, red):
  # pylint: disable=protected-access
  bits = lax.bitcast_convert_type(values, jnp.uint32)
  cls, counts = qrows.classify(bits, jnp)
  ids = red.offset + jnp.arange(bits.shape[-1])
  cls = jnp.where((ids >= vocab) & (cls == qrows._FINE) & (counts != 0),
                  qrows._PADDING, cls)
  first = -red.max(-cls)                       # the row's first class
  total = red.sum(counts.astype(jnp.int64))    # an integer all-reduce
  token = token.astype(jnp.int32)
  at = red.lookup(counts, jnp.clip(token, 0, vocab - 1)[..., None])[..., 0]
  checks = qrows._token_range(token, vocab) + [
      (first != qrows._FINE, qrows._status_of_class(first, jnp)),
      (total != M, int(Status.WRONG_MASS)),
      (at == 0, int(Status.ZERO_Q_AT_TOKEN))]
  counts, status = qrows._finish(qrows._first_status(checks, jnp), counts,
                                 jnp)
  drawn = red.first_cum_greater(counts, draw.astype(jnp.int64)) == token
  return counts, status, drawn


@functools.partial(jax.jit, static_argnames=("vocab", "executor"))
def _check_dense(values, token, draw, vocab, executor):
  return executor.run(
      rowops.declare(functools.partial(_check_row, vocab=vocab),
                     (rowops.Arg(1, 0.0), rowops.Arg(0), rowops.Arg(0)),
                     (True, False, False), values.shape[-1]),
      values, token, draw)


@x64.scoped
def check_dense(values: jax.typing.ArrayLike, token: jax.typing.ArrayLike,
                draw: jax.typing.ArrayLike, *, vocab: int,
                executor: rowops.Executor = rowops.LOCAL
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The verdict of dense q rows and the sampling audit of their tokens.

  Args:
    values: float32[..., N] q rows; N >= vocab (ids >= vocab are padding
      and must be zero). On a mesh: a global array split over "vocab".
    token: int[...], the drafted token of each row.
    draw: uint32[...], its 24-bit PROPOSAL draw.
    vocab: V.

  Returns:
    (counts int32[..., N] (zero on refused rows; split like `values` on a
    mesh), status int32[...] (`qrows.dense`'s), drawn bool[...]: the draw
    selects the token from the counts).
  """
  values = jnp.asarray(values)
  if values.dtype != jnp.float32 or values.ndim < 1:
    raise TypeError(f"check_dense: values must be float32 rows [..., N], got "
                    f"{values.dtype}{list(values.shape)}")
  token, draw = jnp.asarray(token), jnp.asarray(draw)
  if token.shape != values.shape[:-1] or draw.shape != token.shape:
    raise ValueError(f"check_dense: token {token.shape} and draw "
                     f"{draw.shape} must be the batch shape "
                     f"{values.shape[:-1]}")
  if not 1 <= vocab <= values.shape[-1]:
    raise ValueError(f"check_dense: vocab={vocab} not in [1, "
                     f"{values.shape[-1]}]")
  return _check_dense(values, token, draw, int(vocab), executor)
