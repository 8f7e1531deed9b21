"""The q formats' batch verdicts: one jitted pass over a staged batch.

JAX's half of `dense` and `sparse` validation (`validate(...,
device=True)`, the verifier's staged batch), loaded on first use so that
the formats, the codec and the protocol sessions import without JAX. The
dense pass and why it is shaped so: `dense`'s docstring (on CPU one
compiled sweep that writes the counts and sums them exactly,
`_host_dense` over `dense_host.sweep`; on an accelerator one jitted
verdict, `_dense`); the sparse one is the core kernel `qrows.sparse` under
one jit with the sampling audit.
"""

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax import qrows, x64
from dyadic_jax.constants import M
from dyadic_jax.wire.qformats import base

_BAD = float(1 << 25)     # what a refused entry adds to its row's sum
# The class qrows.classify gives a fine entry (that of +0.0).
_FINE = int(qrows.classify(np.zeros(1, np.uint32), np)[0][0])


@functools.partial(jax.jit, static_argnames=("audit",))
def _dense(values: jax.Array, tokens: jax.Array, draws: jax.Array, *,
            audit: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  vocab = values.shape[-1]
  bits = lax.bitcast_convert_type(values, jnp.uint32)
  cls, count = qrows.classify(bits, jnp)
  fine = cls == _FINE
  total = jnp.sum(jnp.where(fine, count.astype(jnp.float64), _BAD), -1)
  counts = jnp.where(fine, count, 0)
  at = jnp.take_along_axis(counts, jnp.clip(tokens, 0, vocab - 1)[..., None],
                           axis=-1)[..., 0]
  ok = (total == M) & (tokens >= 0) & (tokens < vocab) & (at > 0)
  if audit:
    # Sibling reductions over the batch that XLA CPU fuses into one
    # multi-output reduction run several times slower than apart.
    counts, ok = lax.optimization_barrier((counts, ok))
    drawn = base.audit(counts, tokens, draws, jnp)
  else:
    drawn = jnp.ones(ok.shape, bool)
  return counts, ok, drawn


def _host_dense(values: np.ndarray | jax.Array, tokens: np.ndarray,
                draws: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`_dense`'s verdict on the host: one compiled sweep
  (`dense_host.sweep`) reads the rows once and writes the counts once (M +
  1 for an entry that is not fine), with each row's exact total, its mass
  before the token and its count at the token; then a few numpy calls on
  arrays of rows. A row is valid iff its total is M and its count at the
  token is > 0; the audit's mass before the token is `before`. The counts
  are a 64-byte-aligned numpy array, which JAX on CPU reads without a
  copy. docs/numerics.md section 4.
  """
  # numba loads on first use: the device path and the sparse verdicts
  # never need it.
  from dyadic_jax.wire.qformats import dense_host  # pylint: disable=g-import-not-at-top
  values = np.asarray(values)   # a CPU jax.Array: no copy
  shape = values.shape
  rows = math.prod(shape[:-1])
  counts = base.aligned_empty(shape, np.int32)
  flat = counts.reshape(rows, shape[-1])
  total, before, at = dense_host.sweep(values.reshape(rows, shape[-1]),
                                       tokens.reshape(rows), flat)
  valid = (total == M) & (at > 0)
  if draws is None:
    drawn = np.ones(rows, bool)
  else:
    u = draws.reshape(rows).astype(np.int64)
    drawn = (before <= u) & (u < before + at)
  if not valid.all():   # rare: refused rows' counts are zeros (qrows.dense)
    flat[~valid] = 0
  return counts, valid.reshape(shape[:-1]), drawn.reshape(shape[:-1])


def dense_verdict(values: np.ndarray | jax.Array, tokens: ArrayLike,
                  draws: ArrayLike | None, *, host: bool | None = None
                  ) -> tuple[np.ndarray | jax.Array, np.ndarray | jax.Array,
                             np.ndarray | jax.Array]:
  """(counts, valid, drawn) of dense rows [..., V]: counts where a row is
  valid (zeros elsewhere on the host path; on the device path each fine
  entry's count), valid as `qrows.dense`'s OK without the audit, drawn the
  audit's verdict (meaningful where valid; True without draws).

  host: one compiled sweep on the host (`_host_dense`, counts as an
  aligned numpy array; default on a CPU backend) or the one jitted
  verdict (`_dense`; default on an accelerator). Both give the same
  valid, drawn where valid and counts of valid rows.
  """
  if host is None:
    host = jax.default_backend() == "cpu"
  if host:
    # The staged slot is read in place (see _host_dense).
    return _host_dense(values, np.asarray(tokens, np.int32),
                       None if draws is None else np.asarray(draws, np.uint32))
  if isinstance(values, np.ndarray):
    # Zero-copy only from an aligned, writable slot (DLPack exports no
    # read-only array; rows staged in a received message are read-only).
    values = (jax.dlpack.from_dlpack(values)
              if values.ctypes.data % 64 == 0 and values.flags.c_contiguous
              and values.flags.writeable else jnp.asarray(values))
  return _device_dense(values, tokens, draws)


@x64.scoped
def _device_dense(values: jax.Array, tokens: ArrayLike,
                  draws: ArrayLike | None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  audit = draws is not None
  draws = jnp.asarray(draws if audit else np.zeros(np.shape(tokens),
                                                   np.uint32), jnp.uint32)
  return _dense(values, jnp.asarray(tokens, jnp.int32), draws, audit=audit)


@functools.partial(jax.jit, static_argnames=("vocab", "audit"))
def _sparse(values: jax.Array, ids: jax.Array, n: jax.Array,
            tokens: jax.Array, draws: jax.Array, *, vocab: int,
            audit: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  bits = lax.bitcast_convert_type(values, jnp.uint32)
  counts, row_status = qrows.sparse(bits, ids, n, tokens, vocab=vocab,
                                    xp=jnp)
  if audit:
    drawn = base.audit(counts, base.support_position(ids, n, tokens, jnp), draws, jnp)
  else:
    drawn = jnp.ones(row_status.shape, bool)
  return counts, row_status, drawn


@x64.scoped
def sparse_verdict(rows: base.Rows, draws: ArrayLike | None, vocab: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  audit = draws is not None
  draws = np.zeros(np.shape(rows.tokens), np.uint32) if not audit else draws
  return _sparse(rows.values, rows.ids, rows.n, rows.tokens,
                 np.asarray(draws, np.uint32), vocab=int(vocab), audit=audit)
