"""Sparse q rows: top-k supports, int32 ids[D, k] then float32 q[D, k].

Row i holds n[i] live entries (1 <= n <= k), ids strictly ascending in
[0, V); entries past n are padding and never read. Validation is
`dyadic_jax.qrows.sparse` on the bit patterns (numpy: a k = 32 batch is a
few thousand entries).
"""

import numpy as np

from dyadic_jax import qrows, verification
from dyadic_jax.wire import layouts, status
from dyadic_jax.wire.qformats import base


class SparseFormat(base.QFormat):
  """int32 global ids and float32 q on a support of at most k."""
  representation = layouts.Representation.SPARSE
  entry_bytes = 8
  has_ids = True

  def width(self, vocab, support):
    return int(min(support, vocab))

  def validate(self, rows, *, vocab, draws=None, device=False):
    del device    # small rows: numpy is the fast path
    tokens, n, ids = (np.asarray(a) for a in (rows.tokens, rows.n, rows.ids))
    values = np.asarray(rows.values)
    counts, row_status = qrows.sparse(values.view(np.uint32), ids, n,
                                      tokens, vocab=int(vocab), xp=np)
    codes = status.codes(row_status)
    if draws is not None:
      live = np.arange(ids.shape[-1]) < n[..., None]
      position = np.argmax(live & (ids == tokens[..., None]), axis=-1)
      codes = base.with_audit(codes, base.audit(counts, position,
                                                np.asarray(draws), np))
    return base.Verdict(counts, codes)

  def to_q(self, counts, rows):
    live = np.arange(rows.ids.shape[-1]) < np.asarray(rows.n)[..., None]
    ids = np.where(live, rows.ids, -1).astype(np.int32)
    return verification.SparseQ(ids, np.asarray(counts, np.int32),
                                np.asarray(rows.n, np.int32))


FORMAT = SparseFormat()
