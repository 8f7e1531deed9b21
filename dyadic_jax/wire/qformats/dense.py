"""Dense q rows: float32 q[D, V], every entry of the vocabulary.

Validation is `dyadic_jax.qrows` on the bit patterns. A batch staged in
aligned buffers (`validate(..., device=True)`) is judged in one pass that
decides only whether each row is valid (`qrows.dense`'s OK: every entry
fine, the exact count sum 2^24, the token in range with a nonzero count)
and runs the sampling audit; a refused row's code is then taken from
`qrows.dense` itself, on the host, for that row only
(tests/wire/test_qformats.py holds both to the kernel and the oracle on
every class). Two shapes of that pass (`kernels.dense_verdict`):

* on CPU (the default there): one compiled sweep (numba,
  `dense_host.sweep`) reads the staged slot in place and writes each
  entry's count, or 2^24 + 1 for an entry that is not fine, into the
  counts' buffer, with each row's exact int64 total, its sum before the
  token and its count at the token: a row is valid exactly when its total
  is 2^24 and the count at its token is positive, and the audit reads the
  sum before the token. One read of q and one write of the counts
  (verification takes the counts): XLA CPU's row reductions ran at a
  tenth of memory speed and numpy needs a pass per operation
  (experiments/bench_bridge.py, `validate` against `rowsum`);
* on an accelerator: one jitted verdict, `qrows.classify` per entry and
  ONE float64 reduction per row (a fine entry adds its count, any other
  2^25), plus one for the audit (exact in any order: below 2^44).
"""

from __future__ import annotations   # JAX's types, without importing JAX

import typing

import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax.constants import M, Status
from dyadic_jax.wire import layouts, status
from dyadic_jax.wire.qformats import base
from dyadic_jax.wire.refusals import Code

if typing.TYPE_CHECKING:
  import jax

  from dyadic_jax import rowops

# The core ops (qrows, proposal, qcodec, verification) and the device pass
# (`kernels`) are imported where they are called: they load JAX, which the
# formats' layouts, the codec and the protocol sessions never need.


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
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from dyadic_jax import proposal, qcodec
    counts, token, status = proposal.propose_dense(logits, draw,
                                                   executor=executor)
    return (token, status, qcodec.counts_to_q(counts), None,
            jnp.int32(width))

  def validate(self, rows: base.Rows, *, vocab: int,
               draws: ArrayLike | None = None,
               device: bool = False) -> base.Verdict:
    from dyadic_jax import qrows  # pylint: disable=g-import-not-at-top
    rows = base.checked_rows("DenseFormat.validate", rows)
    tokens = np.asarray(rows.tokens)
    n = np.asarray(rows.n)
    values = rows.values
    assert values is not None     # a dense row has values (has_values)
    counts: base.Counts
    if device:
      from dyadic_jax.wire.qformats import kernels
      counts, device_valid, device_ok = kernels.dense_verdict(values, tokens,
                                                              draws)
      valid, ok = np.asarray(device_valid), np.asarray(device_ok)
      if values.shape[-1] > vocab:
        # The device pass knows no V: a row with mass (or any bits) on a
        # padding id past V is refused by the kernel below, as on the host.
        valid = valid & ~(np.asarray(values)[..., int(vocab):].view(
            np.uint32) != 0).any(-1)
      if valid.all():   # the usual batch: only the audit can refuse a row
        codes = np.where(ok, np.int32(0), np.int32(Code.SAMPLING_MISMATCH))
      else:
        row_status = np.zeros(valid.shape, np.int32)
        for index in zip(*np.nonzero(~valid)):   # rare: the kernel's code
          _, one = qrows.dense(values[index].view(np.uint32)[None],
                               tokens[index][None], vocab=int(vocab), xp=np)
          row_status[index] = int(one[0]) or int(Status.WRONG_MASS)
        codes = base.with_audit(status.codes(row_status), ok)
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
    from dyadic_jax import verification  # pylint: disable=g-import-not-at-top
    return verification.DenseQ(counts)


FORMAT = DenseFormat()
