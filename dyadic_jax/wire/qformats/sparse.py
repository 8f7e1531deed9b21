"""Sparse q rows: top-k supports, int32 ids[D, k] then float32 q[D, k].

Row i holds n[i] live entries (1 <= n <= k), ids strictly ascending in
[0, V), q = 0 allowed; entries past n are padding and never read.
`to_q` hands verification the canonical form (zero entries dropped,
padding (-1, 0)). Validation is
`dyadic_jax.qrows.sparse` on the bit patterns: with numpy for one row or
a loose batch. The verifier's staged batch (`device=True`) is judged by
`host_verdict` (one numba-compiled loop, `sparse_host`; no JAX) on a CPU
backend or when it is small, else
by the same kernel under one jitted call with the sampling audit
(`kernels.sparse_verdict`): docs/numerics.md section 4.
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

# A staged batch of at most this many entries (R x D x k) is judged on the
# host on any backend. On CPU the host verdict won at every size measured
# (with the audit, the jitted call's host copies included; medians of 7 x
# 200 calls on 2 loaded cores; compiled host pass vs the numpy one it
# replaced vs jitted: R x D x k = 1 x 1 x 32: 4.6 vs 33 vs 53 us; 4 x 5 x
# 32: 3.9 vs 60 vs 56; 64 x 5 x 32: 14 vs 144 vs 192; 4 x 5 x 256: 6.6 vs
# 121 vs 155; 64 x 8 x 1024: 1.6 vs 4.3 vs 7.6 ms), so a CPU backend
# always uses it. On an accelerator (not measured) the jitted pass pays a
# dispatch and two copies, ~100 us, then runs at memory speed, while the
# host pass costs ~3 ns an entry: past ~2^15 entries the device should
# win; the bound stays at 2^14 (set when numpy cost ~7 ns an entry), where
# the host pass is now about twice as far ahead.
HOST_ENTRIES = 1 << 14


def host_verdict(rows: base.Rows, draws: ArrayLike | None,
                 vocab: int) -> base.Verdict:
  """`qrows.sparse`'s verdict (codes by `status.codes`) and the audit
  (`base.with_audit`), in one compiled call (`sparse_host.verdict`: the
  same counts and codes, the classes in the kernel's order)."""
  # numba loads on first use, as for the dense host pass.
  from dyadic_jax.wire.qformats import sparse_host  # pylint: disable=g-import-not-at-top
  return sparse_host.verdict(rows, draws, vocab)


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
    rows = base.checked_rows("SparseFormat.validate", rows)
    assert rows.values is not None   # has_values
    if device and (rows.values.size <= HOST_ENTRIES or _cpu_backend()):
      return host_verdict(rows, draws, vocab)
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


def _cpu_backend() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.default_backend() == "cpu"


FORMAT = SparseFormat()
