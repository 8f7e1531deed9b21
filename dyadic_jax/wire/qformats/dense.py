"""Dense q rows: float32 q[D, V], every entry of the vocabulary.

Validation is `dyadic_jax.qrows` on the bit patterns. A batch staged in
aligned buffers (`validate(..., device=True)`) is checked in one jitted
pass built for XLA CPU: `qrows.classify` judges every entry (the kernel's
own entry classification), and ONE float64 reduction per row decides the
row: a fine entry adds its count, any other entry adds 2^25 (> 2^24), so a
row is valid exactly when the sum is 2^24 and its token has a nonzero
count (float64 sums of at most MAX_VOCAB = 2^18 terms below 2^26 stay
below 2^44, exact in any order). That is `qrows.dense`'s OK verdict on a
dense wire row (no padding: V = N); tests/wire/test_qformats.py checks
the two agree on every class. A refused row's code is then taken from `qrows.dense` itself, on
the host, for that row only. The sampling audit is one more reduction
(the count mass before each drafted token). `qrows.dense` on the whole
batch reads the rows about six times on XLA CPU; this path twice.
"""

import functools
import typing

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax import proposal, qcodec, qrows, rowops, verification, x64
from dyadic_jax.constants import M, Status
from dyadic_jax.wire import layouts, status
from dyadic_jax.wire.qformats import base
from dyadic_jax.wire.refusals import Code

_BAD = float(1 << 25)     # what a refused entry adds to its row's sum
# The class qrows.classify gives a fine entry (that of +0.0).
_FINE = int(qrows.classify(np.zeros(1, np.uint32), np)[0][0])


@functools.partial(jax.jit, static_argnames=("audit",))
def _device(values: jax.Array, tokens: jax.Array, draws: jax.Array, *,
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
def _device_verdict(values: np.ndarray | jax.Array, tokens: ArrayLike,
                    draws: ArrayLike | None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  if isinstance(values, np.ndarray):
    values = (jax.dlpack.from_dlpack(values)
              if values.ctypes.data % 64 == 0 and values.flags.c_contiguous
              else jnp.asarray(values))
  audit = draws is not None
  draws = jnp.asarray(draws if audit else np.zeros(np.shape(tokens),
                                                   np.uint32), jnp.uint32)
  return _device(values, jnp.asarray(tokens, jnp.int32), draws, audit=audit)


class DenseFormat(base.QFormat):
  """float32 q over the whole vocabulary."""
  name = "dense"
  representation = layouts.Representation.DENSE
  entry_bytes = 4
  shardable = True

  def width(self, vocab: int, support: int, shards: int = 1) -> int:
    del support   # any k (the default 32 included): a dense row holds V
    return -(-int(vocab) // int(shards))

  def put(self, rows: base.Rows, ids: ArrayLike, counts: ArrayLike) -> None:
    values = rows.values
    assert values is not None     # a dense row has values (has_values)
    values[:] = 0
    np.put_along_axis(values, np.asarray(ids),
                      (np.asarray(counts) / M).astype(np.float32), -1)
    rows.n[:] = values.shape[-1]

  def propose(self, logits: jax.Array, draw: jax.Array | None, width: int,
              executor: rowops.Executor) -> base.Proposed:
    assert draw is not None       # sampled: every position has its draw
    counts, token, status = proposal.propose_dense(logits, draw,
                                                   executor=executor)
    return (token, status, qcodec.counts_to_q(counts), None,
            jnp.int32(width))

  def validate(self, rows: base.Rows, *, vocab: int,
               draws: ArrayLike | None = None,
               device: bool = False) -> base.Verdict:
    tokens = np.asarray(rows.tokens)
    n = np.asarray(rows.n)
    values = rows.values
    assert values is not None     # a dense row has values (has_values)
    counts: base.Counts
    if device:
      counts, device_valid, device_ok = _device_verdict(values, tokens, draws)
      valid, ok = np.asarray(device_valid), np.asarray(device_ok)
      row_status = np.zeros(valid.shape, np.int32)
      for index in zip(*np.nonzero(~valid)):   # rare: the kernel's code
        _, one = qrows.dense(values[index].view(np.uint32)[None],
                             tokens[index][None], vocab=int(vocab), xp=np)
        row_status[index] = int(one[0]) or int(Status.WRONG_MASS)
    else:
      counts, row_status = qrows.dense(values.view(np.uint32), tokens,
                                       vocab=int(vocab), xp=np)
      ok = (np.ones(row_status.shape, bool) if draws is None else
            base.audit(np.asarray(counts), tokens, np.asarray(draws), np))
    codes = base.with_audit(status.codes(row_status), ok)
    # The live count of a dense row is V: anything else is a framing lie.
    codes = np.where(n != values.shape[-1], np.int32(
        Code.LENGTH_MISMATCH), codes).astype(np.int32)
    return base.Verdict(counts, codes)

  def to_q(self, counts: typing.Optional[base.Counts],
           rows: base.Rows) -> base.Q:
    del rows
    assert counts is not None     # validated dense rows have counts
    return verification.DenseQ(counts)


FORMAT = DenseFormat()
