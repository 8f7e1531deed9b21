"""Dense q rows: float32 q[D, V], every entry of the vocabulary.

Validation is `dyadic_jax.qrows.dense` on the bit patterns; a batch staged
in aligned buffers is validated in one jitted pass (`validate(...,
device=True)`), which also runs the sampling audit, so the 10 MB of a
4-request batch at V = 129280 are read once for both.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from dyadic_jax import qrows, verification, x64
from dyadic_jax.wire import layouts, status
from dyadic_jax.wire.errors import Code
from dyadic_jax.wire.qformats import base


@functools.partial(jax.jit, static_argnames=("vocab", "requests", "audit"))
def _device(values, tokens, draws, *, vocab, requests, audit):
  # Only the first `requests` rows of the staging slot are read (fused).
  values, tokens = values[:requests], tokens[:requests]
  bits = lax.bitcast_convert_type(values, jnp.uint32)
  counts, row_status = qrows.dense(bits, tokens, vocab=vocab, xp=jnp)
  if audit:
    ok = base.audit(counts, tokens, draws[:requests], jnp)
  else:
    ok = jnp.ones(row_status.shape, bool)
  return counts, row_status, ok


@x64.scoped
def _device_verdict(values, tokens, draws, vocab, requests):
  if isinstance(values, np.ndarray):
    values = (jax.dlpack.from_dlpack(values)
              if values.ctypes.data % 64 == 0 and values.flags.c_contiguous
              else jnp.asarray(values))
  audit = draws is not None
  draws = jnp.asarray(draws if audit else np.zeros(tokens.shape, np.uint32),
                      jnp.uint32)
  return _device(values, jnp.asarray(tokens, jnp.int32), draws, vocab=vocab,
                 requests=requests, audit=audit)


class DenseFormat(base.QFormat):
  """float32 q over the whole vocabulary."""
  representation = layouts.Representation.DENSE
  entry_bytes = 4

  def width(self, vocab, support):
    del support
    return int(vocab)

  def validate(self, rows, *, vocab, draws=None, device=False):
    tokens = np.asarray(rows.tokens)
    n = np.asarray(rows.n)
    if device:
      requests = tokens.shape[0]
      counts, row_status, ok = _device_verdict(rows.values, tokens, draws,
                                               int(vocab), requests)
      row_status, ok = np.asarray(row_status), np.asarray(ok)
      n = n[:requests]
    else:
      counts, row_status = qrows.dense(rows.values.view(np.uint32), tokens,
                                       vocab=int(vocab), xp=np)
      ok = (np.ones(row_status.shape, bool) if draws is None else
            base.audit(counts, tokens, np.asarray(draws), np))
    codes = base.with_audit(status.codes(row_status), ok)
    # The live count of a dense row is V: anything else is a framing lie.
    codes = np.where(n != rows.values.shape[-1], np.int32(
        Code.LENGTH_MISMATCH), codes).astype(np.int32)
    return base.Verdict(counts, codes)

  def to_q(self, counts, rows):
    del rows
    return verification.DenseQ(counts)


FORMAT = DenseFormat()
