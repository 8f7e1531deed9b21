"""Row ops: each op declared once, run on one device or over a mesh.

An op is a body over a batch of rows plus a description of its arguments
and outputs (`RowOp`): for each argument the number of trailing per-row
axes and, for a vocabulary-sized one, the value its padding ids take
(zero mass: -inf logits, zero weights or counts); for each output whether
it is vocabulary-sized. An `Executor` runs the description:

  LOCAL                     one device (this module)
  sharding.executor(mesh)   a ("requests", "vocab") mesh: batch rows split
                            over "requests", vocabulary blocks over
                            "vocab", the body's Reducer made of collectives

so the single-device op and its mesh form are one program with only the
`Reducer` steps swapped (dyadic_jax/reducer.py), hence the same bits. The
public ops take `executor=` (default LOCAL); the `sharding` package passes
its mesh's.

The body sees every argument with exactly one leading batch axis [N] (the
caller's batch shape flattened; a single row is N = 1) and returns a pytree
of arrays led by [N]. Under `jax.vmap`, both executors fold the vmapped
axis into N (`rowwise.fold_vmap`): vmap of an op is one call on the
widened batch, the same program.
"""

import typing

import jax
import numpy as np

from dyadic_jax import reducer, rowwise


class Arg(typing.NamedTuple):
  """One argument leaf of a row op."""
  core: int                 # trailing per-row axes (0: one value per row)
  fill: typing.Any = None   # padding-id value of a [..., V] leaf; None: the
                            # last axis is not the vocabulary


class RowOp(typing.NamedTuple):
  """A row op: its body and the description an Executor needs."""
  body: typing.Callable     # body(*args, red=Reducer) on [N, ...] leaves
  args: tuple               # pytree of Arg, one per leaf of the arguments
  vocab_out: typing.Any     # pytree of bool like the outputs: [N, V] leaf?
  vocab: int                # the vocabulary size V (unpadded)


class Executor(typing.Protocol):
  """How a RowOp runs; hashable (a static argument of the ops' jits)."""

  def run(self, op: RowOp, *args: typing.Any) -> typing.Any:
    """The op's outputs, led by the arguments' batch shape (traced)."""

  def widths(self, vocab: int) -> tuple[int, ...]:
    """Widths a [..., V] input may have: V, or also its padded layout."""


def declare(row_fn: typing.Callable, args: tuple, vocab_out: typing.Any,
            vocab: int) -> RowOp:
  """The RowOp of a row function `row_fn(*rows, red)` over any batch shape.

  Its body runs `row_fn` one row at a time or on the whole batch, by the
  row mode (`rowwise.map_rows`).
  """
  cores = tuple(a.core for a in args)

  def body(*leaves, red):
    return rowwise.map_rows(lambda *r: row_fn(*r, red=red), *leaves,
                            core_ndims=cores)

  return RowOp(body, args, vocab_out, vocab)


def leaf_specs(op: RowOp, args: tuple) -> tuple[list, list[Arg], typing.Any]:
  """(leaves, one Arg per leaf, treedef) of a call's arguments."""
  leaves, tree = jax.tree.flatten(args)
  specs = jax.tree.leaves(op.args, is_leaf=lambda a: isinstance(a, Arg))
  if len(specs) != len(leaves):
    raise ValueError(f"row op: {len(specs)} argument descriptions for "
                     f"{len(leaves)} arrays")
  return leaves, specs, tree


def batch_shape(leaves: list, specs: list[Arg]) -> tuple[int, ...]:
  """The batch shape: the first leaf's axes before its core axes."""
  x, core = leaves[0], specs[0].core
  return tuple(x.shape[:x.ndim - core])


def flatten_batch(x: jax.Array, core: int, n: int) -> jax.Array:
  """x[batch..., core...] -> x[n, core...]."""
  return x.reshape((n,) + tuple(x.shape[x.ndim - core:]))


def unflatten_batch(out: typing.Any, batch: tuple[int, ...]) -> typing.Any:
  """Every output leaf [N, ...] -> [batch..., ...]."""
  return jax.tree.map(lambda o: o.reshape(batch + o.shape[1:]), out)


class _Local:
  """The single-device executor."""

  def __repr__(self):
    return "rowops.LOCAL"

  def widths(self, vocab: int) -> tuple[int, ...]:
    return (vocab,)

  def run(self, op: RowOp, *args: typing.Any) -> typing.Any:
    leaves, specs, tree = leaf_specs(op, args)
    cores = [s.core for s in specs]
    red = reducer.local(op.vocab)

    def call(*leaves):
      batch = batch_shape(list(leaves), specs)
      n = int(np.prod(batch, dtype=np.int64))
      flat = [flatten_batch(x, c, n) for x, c in zip(leaves, cores)]
      out = op.body(*jax.tree.unflatten(tree, flat), red=red)
      return unflatten_batch(out, batch)

    return rowwise.fold_vmap(call)(*leaves)


LOCAL: Executor = _Local()
