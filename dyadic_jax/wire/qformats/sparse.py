"""Sparse q rows: top-k supports, int32 ids[D, k] then float32 q[D, k].

Row i holds n[i] live entries (1 <= n <= k), ids strictly ascending in
[0, V), q = 0 allowed; entries past n are padding and never read.
`to_q` hands verification the canonical form (zero entries dropped,
padding (-1, 0)). Validation is
`dyadic_jax.qrows.sparse` on the bit patterns: with numpy for one row or
a loose batch, or (`device=True`, the verifier's staged batch) the same
kernel under one jitted call with the sampling audit: a k = 32 batch is a
few hundred entries, and one dispatch costs less than the forty numpy
calls the kernel makes.
"""

from __future__ import annotations   # JAX's types, without importing JAX

import typing

import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax.constants import M
from dyadic_jax.wire import layouts, status
from dyadic_jax.wire.qformats import base

if typing.TYPE_CHECKING:
  import jax

  from dyadic_jax import rowops

# The core ops and the device pass are imported where they are called, as
# in `dense`: the sessions import this module without JAX.


class SparseFormat(base.QFormat):
  """int32 global ids and float32 q on a support of at most k."""
  name = "sparse"
  representation = layouts.Representation.SPARSE
  entry_bytes = 8
  has_ids = True
  uses_support = True

  def width(self, vocab: int, support: int, shards: int = 1) -> int:
    del shards    # one link: the global top-k (the leader's)
    if not 1 <= support <= vocab:
      raise ValueError(f"max_support {support} not in [1, {vocab}]")
    return int(support)

  def put(self, rows: base.Rows, ids: ArrayLike, counts: ArrayLike) -> None:
    support, support_counts = np.asarray(ids), np.asarray(counts)
    assert rows.ids is not None and rows.values is not None   # has_ids
    s = support.shape[-1]
    rows.ids[:] = -1
    rows.ids[..., :s] = support
    rows.values[:] = 0
    rows.values[..., :s] = support_counts / M
    rows.n[:] = s

  def propose(self, logits: jax.Array, draw: jax.Array | None, width: int,
              executor: rowops.Executor) -> base.Proposed:
    assert draw is not None       # sampled: every position has its draw
    from dyadic_jax import proposal, qcodec
    ids, counts, n, token, status = proposal.propose_sparse(
        logits, draw, width, executor=executor)
    return token, status, qcodec.counts_to_q(counts), ids, n

  def validate(self, rows: base.Rows, *, vocab: int,
               draws: ArrayLike | None = None,
               device: bool = False) -> base.Verdict:
    from dyadic_jax import qrows  # pylint: disable=g-import-not-at-top
    if device:
      from dyadic_jax.wire.qformats import kernels
      counts, row_status, drawn = kernels.sparse_verdict(rows, draws, vocab)
      codes = base.with_audit(status.codes(np.asarray(row_status)),
                              np.asarray(drawn))
      return base.Verdict(np.asarray(counts), codes)
    tokens, n, ids = (np.asarray(a) for a in (rows.tokens, rows.n, rows.ids))
    values = np.asarray(rows.values)
    counts, row_status = qrows.sparse(values.view(np.uint32), ids, n,
                                      tokens, vocab=int(vocab), xp=np)
    codes = status.codes(row_status)
    if draws is not None:
      codes = base.with_audit(codes, base.audit(
          counts, base.support_position(ids, n, tokens, np),
          np.asarray(draws), np))
    return base.Verdict(counts, codes)

  def to_q(self, counts: typing.Optional[base.Counts],
           rows: base.Rows) -> base.Q:
    # The core takes the canonical form (`verification.SparseQ`): the
    # positive counts first, in the wire's ascending id order, then (-1,
    # 0). A wire row may list ids with q = 0; dropping them changes no
    # probability, and the core would refuse them (MISSING_Q).
    assert rows.ids is not None   # has_ids
    held_counts = np.asarray(counts, np.int32)
    live = np.arange(rows.ids.shape[-1]) < np.asarray(rows.n)[..., None]
    held = live & (held_counts > 0)
    order = np.argsort(~held, axis=-1, kind="stable")

    def pick(a: np.ndarray, fill: int) -> np.ndarray:
      return np.take_along_axis(np.where(held, a, fill), order,
                                -1).astype(np.int32)

    from dyadic_jax import verification  # pylint: disable=g-import-not-at-top
    return verification.SparseQ(pick(rows.ids, -1), pick(held_counts, 0),
                                held.sum(-1, dtype=np.int32))


FORMAT = SparseFormat()
