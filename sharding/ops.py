"""The dyadic_jax ops over a (requests, vocab) mesh: same names, same bits.

Each op is its `dyadic_jax` twin with a `mesh=` keyword: `mesh=None` is one
device (the twin itself), a mesh from `make_mesh` or `vocab_mesh` runs the
twin's own declaration (`dyadic_jax.rowops.RowOp`) through `MeshExecutor`:

* batch rows (flattened to one axis) are split over "requests", padded with
  copies of row 0 to a multiple of its size (those rows are dropped after);
* vocabulary-sized arguments are padded to the "vocab" blocks with zero
  mass (the op's declared fills: -inf logits, zero weights or counts) and
  split by contiguous id ranges;
* inside `jax.shard_map` each shard runs the op's body with a collective
  `Reducer` over "vocab" (sharding/collectives.py), so outputs are
  bit-identical to the single-device op for any mesh shape.

Vocabulary-sized outputs (weights, probabilities, dense counts) stay
sharded in the padded layout [..., padded_size(V, n)]: ids [0, V) hold
exactly the single-device values, padding ids hold zero. When n divides V
(129280 on 1, 2, 4 or 8 shards) that is [..., V]. JAX cannot shard an axis
unevenly, so unpadding an uneven vocabulary would gather the whole row onto
every device; `unpad` does that on purpose when a caller wants it. The
sharded ops also accept inputs already in the padded layout (zero mass at
padding ids). Per-row results (status, sparse ids/counts, tokens) are
replicated over "vocab" and split over "requests".
"""

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import dyadic_jax as dj
from dyadic_jax import rowops, rowwise
from sharding import collectives
from sharding.mesh import (REQUESTS_AXIS, VOCAB_AXIS, mesh_shape, pad_vocab,
                           padded_size, shard_ranges)


def unpad(x: jax.Array, vocab: int) -> jax.Array:
  """x[..., :vocab]: the unpadded view (gathers when V is not divisible)."""
  return x[..., :vocab]


@dataclasses.dataclass(frozen=True)
class MeshExecutor:
  """Runs a `rowops.RowOp` over a mesh with axes ("requests", "vocab")
  (or "vocab" alone). Hashable: a static argument of the ops' jits."""
  mesh: jax.sharding.Mesh

  def __post_init__(self):
    mesh_shape(self.mesh)   # refuses any other mesh now, not when traced

  @property
  def shape(self) -> tuple[int, int]:
    return mesh_shape(self.mesh)

  def widths(self, vocab: int) -> tuple[int, ...]:
    return (vocab, padded_size(vocab, self.shape[1]))

  def run(self, op: rowops.RowOp, *args: typing.Any) -> typing.Any:
    # Under jax.vmap the vmapped axis joins the batch (`rowwise.fold_vmap`):
    # vmap of an op over a mesh runs the same program as one call on the
    # widened batch. (Batching the shard_map itself instead deadlocked
    # XLA CPU's collectives at random, tests/sharding/test_ops.py.)
    leaves, specs, tree = rowops.leaf_specs(op, args)
    return rowwise.fold_vmap(
        lambda *xs: self._run(op, list(xs), specs, tree))(*leaves)

  def _run(self, op, leaves, specs, tree):
    r, n = self.shape
    size = shard_ranges(op.vocab, n)[0].size
    batch = rowops.batch_shape(leaves, specs)
    rows = int(np.prod(batch, dtype=np.int64))
    padded_rows = -(-rows // r) * r
    # Rows split over "requests" ("requests" absent: a 1-D vocabulary mesh).
    lead = REQUESTS_AXIS if REQUESTS_AXIS in self.mesh.axis_names else None
    flat = []
    for x, spec in zip(leaves, specs):
      x = rowops.flatten_batch(jnp.asarray(x), spec.core, rows)
      if padded_rows != rows:
        x = x[jnp.concatenate([jnp.arange(rows),
                               jnp.zeros(padded_rows - rows, jnp.int32)])]
      if spec.fill is not None:
        x = pad_vocab(x, n, spec.fill)
      flat.append(x)

    def spec_of(core, vocab):
      # [N, core...] within a request group: the last axis over "vocab" if
      # it is the vocabulary; axes not named are whole on every shard.
      return P(*([None] * core), VOCAB_AXIS) if vocab else P()

    in_specs = tuple(spec_of(s.core, s.fill is not None) for s in specs)
    out_specs = jax.tree.map(lambda v: spec_of(1, v), op.vocab_out)

    def body(*local):
      red = collectives.shard_reducer(op.vocab, size, n)
      return op.body(*jax.tree.unflatten(tree, local), red=red)

    def over_vocab(mesh, *xs):
      return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                           out_specs=out_specs, axis_names={VOCAB_AXIS},
                           check_vma=True)(*xs)

    if lead is None or r == 1:
      # One request group: the vocabulary map alone (on a 2-D mesh the
      # size-1 "requests" axis holds every row; nothing varies over it).
      out = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                          out_specs=out_specs, check_vma=True)(*flat)
    else:
      # Rows split over "requests", then each group's vocabulary. No
      # collective crosses "requests", so its map leaves check_vma off:
      # typing every constant of the row bodies as request-varying would
      # be its only effect. The vocabulary map keeps it on.
      out = jax.shard_map(
          lambda *xs: over_vocab(jax.sharding.get_abstract_mesh(), *xs),
          mesh=self.mesh, in_specs=(P(lead),) * len(flat),
          out_specs=jax.tree.map(lambda _: P(lead), op.vocab_out),
          axis_names={lead}, check_vma=False)(*flat)
    if padded_rows != rows:
      out = jax.tree.map(lambda o: o[:rows], out)
    return rowops.unflatten_batch(out, batch)


def executor(mesh: jax.sharding.Mesh | None) -> rowops.Executor:
  """`rowops.LOCAL` for None, else the mesh's executor."""
  return rowops.LOCAL if mesh is None else MeshExecutor(mesh)


def _onto(mesh: jax.sharding.Mesh, x: typing.Any) -> typing.Any:
  """x, or a copy a jit over the mesh accepts when x is an array committed
  to other devices (e.g. one device's output, as the bridge's dense
  validation returns): replicated onto the mesh (the jit keeps each
  device's block), or a host copy when the mesh spans processes."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not (
      x.committed and x.sharding.device_set != set(mesh.devices.flat)):
    return x      # a traced value is placed by the caller's own jit
  if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
    return np.asarray(x)
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, P()))


def _on_mesh(op: typing.Callable[..., typing.Any]
             ) -> typing.Callable[..., typing.Any]:
  """The op with `mesh=` (None: one device) in place of `executor=`."""

  @functools.wraps(op)
  def on_mesh(*args, mesh: jax.sharding.Mesh | None = None, **kwargs):
    if mesh is not None:
      args = jax.tree.map(functools.partial(_onto, mesh), args)
    return op(*args, executor=executor(mesh), **kwargs)

  on_mesh.__doc__ = (
      f"`dyadic_jax.{op.__name__}` over a mesh (`mesh=`; None: one device),"
      f" the same bits.\n\n(sharding/ops.py: how the mesh splits the work.)"
      f"\n\n{op.__doc__}")
  return on_mesh


draft_weights = _on_mesh(dj.draft_weights)
target_probs = _on_mesh(dj.target_probs)
allocate_dense = _on_mesh(dj.allocate_dense)
allocate_sparse = _on_mesh(dj.allocate_sparse)
propose_dense = _on_mesh(dj.propose_dense)
propose_sparse = _on_mesh(dj.propose_sparse)
sample_counts = _on_mesh(dj.sample_counts)
sample_target = _on_mesh(dj.sample_target)
verify_chain = _on_mesh(dj.verify_chain)
verify_batch = _on_mesh(dj.verify_batch)
