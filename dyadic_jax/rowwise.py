"""Row-at-a-time application of vocabulary-row ops on CPU.

An op like `allocate_dense` makes ~25 passes over each [V] row (status,
exact sums, bisection counts). Batched over [B, V], every pass streams the
whole batch through memory; one row at a time (about 1 MB in float64 at
V = 129280), the row stays in cache across all passes. On XLA CPU that is
2-3x faster (experiments/bench_core.py). Accelerators keep the batched form.

`row_op` makes the same hold under `jax.vmap`: its batching rule folds the
vmapped axis into the rows instead of widening every step of the row loop.
"""

import jax
from jax import lax
import numpy as np


def map_rows(fn, *args, core_ndims):
  """fn(*args), mapped one leading-batch element at a time on CPU.

  core_ndims[i] is the number of trailing per-row axes of args[i] (1 for a
  [V] row, 0 for a per-row scalar); the leading axes form the batch shape,
  the same for every argument. fn must accept any batch shape (including
  none) and return a pytree of arrays led by that batch shape.
  """
  a0, c0 = args[0], core_ndims[0]
  batch = a0.shape[:a0.ndim - c0]
  n = int(np.prod(batch, dtype=np.int64))
  if n <= 1 or jax.default_backend() != "cpu":
    return fn(*args)
  flat = [a.reshape((n,) + a.shape[a.ndim - c:])
          for a, c in zip(args, core_ndims)]
  out = lax.map(lambda xs: fn(*xs), flat)
  return jax.tree.map(lambda o: o.reshape(batch + o.shape[1:]), out)


def row_op(fn, core_ndims):
  """fn as a row op: `map_rows` on call, and a vmap rule that keeps rows.

  Under `jax.vmap` the vmapped axis becomes one more leading batch axis of
  every argument (unbatched arguments are broadcast), and the op runs once
  on the widened batch.
  """

  @jax.custom_batching.custom_vmap
  def op(*args):
    return map_rows(fn, *args, core_ndims=core_ndims)

  @op.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [a if batched else jax.numpy.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched in zip(args, in_batched)]
    out = op(*args)
    return out, jax.tree.map(lambda _: True, out)

  return op
