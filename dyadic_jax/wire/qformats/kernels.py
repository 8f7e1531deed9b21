"""The q formats' device verdicts: one jitted pass over a staged batch.

JAX's half of `dense` and `sparse` validation (`validate(...,
device=True)`, the verifier's staged batch), loaded on first use so that
the formats, the codec and the protocol sessions import without JAX. The
dense pass and why it is shaped so: `dense`'s docstring; the sparse one
is the core kernel `qrows.sparse` under one jit with the sampling audit.
"""

import functools

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


@x64.scoped
def dense_verdict(values: np.ndarray | jax.Array, tokens: ArrayLike,
                    draws: ArrayLike | None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  if isinstance(values, np.ndarray):
    values = (jax.dlpack.from_dlpack(values)
              if values.ctypes.data % 64 == 0 and values.flags.c_contiguous
              else jnp.asarray(values))
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
