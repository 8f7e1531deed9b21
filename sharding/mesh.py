"""The (requests, vocab) mesh and contiguous shard ranges.

A mesh has a "vocab" axis and optionally a "requests" axis before it:
batch rows are split over "requests" (every group of devices along "vocab"
holds a slice of the rows), the vocabulary over "vocab". Vocabulary shard
s of n owns global ids [start, stop) of a vocabulary padded to n * size;
ids in [V, n * size) are padding and always carry zero mass.
"""

import typing

import jax
import numpy as np

REQUESTS_AXIS = "requests"
VOCAB_AXIS = "vocab"
AXES = (REQUESTS_AXIS, VOCAB_AXIS)


class ShardRange(typing.NamedTuple):
  """Global id range owned by one shard; `stop - start` real ids."""
  shard: int
  start: int   # first global id
  stop: int    # one past the last real (non-padding) id
  size: int    # padded block length, the same for every shard


def shard_ranges(vocab_size: int, n_shards: int) -> tuple[ShardRange, ...]:
  """Contiguous ranges of `vocab_size` ids over `n_shards` equal blocks.

  Blocks have ceil(V / n) ids; the last shards may hold padding only (for
  example V=7 over 8 shards leaves shard 7 empty).
  """
  if vocab_size < 1 or n_shards < 1:
    raise ValueError(f"shard_ranges: need V >= 1 and n >= 1, got "
                     f"V={vocab_size}, n={n_shards}")
  size = -(-vocab_size // n_shards)
  return tuple(
      ShardRange(s, min(s * size, vocab_size), min((s + 1) * size, vocab_size),
                 size) for s in range(n_shards))


def make_mesh(*, requests: int = 1, vocab: int = 1,
              devices: typing.Sequence[jax.Device] | None = None
              ) -> jax.sharding.Mesh:
  """A requests x vocab mesh of the first `requests * vocab` devices.

  Args:
    requests: devices along "requests" (batch rows split over them), >= 1.
    vocab: devices along "vocab" (the vocabulary split over them), >= 1.
    devices: default `jax.devices()` (the default backend's), row-major:
      devices[i * vocab + j] is request group i, vocabulary shard j.

  Both axes are Auto on purpose, so that arrays placed with NamedSharding
  and shard_map in_specs agree without explicit-sharding type errors.

  On a CPU, emulate devices before JAX first uses one:
  `jax.config.update("jax_num_cpu_devices", 8)`, or
  `XLA_FLAGS=--xla_force_host_platform_device_count=8` in the environment.
  """
  devices = jax.devices() if devices is None else list(devices)
  for name, n in (("requests", requests), ("vocab", vocab)):
    if not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"make_mesh: {name}={n!r} must be an int >= 1")
  need = requests * vocab
  if need > len(devices):
    hint = ""
    if devices and devices[0].platform == "cpu":
      hint = (f"; for more CPU devices, before JAX first uses a device: "
              f"jax.config.update(\"jax_num_cpu_devices\", {need})"
              f" or XLA_FLAGS=--xla_force_host_platform_device_count="
              f"{need}")
    raise ValueError(f"make_mesh: {requests} x {vocab} devices but "
                     f"{len(devices)} available{hint}")
  return jax.sharding.Mesh(
      np.asarray(devices[:need]).reshape(requests, vocab), AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * 2)


def vocab_mesh(n_shards: int,
               devices: typing.Sequence[jax.Device] | None = None
               ) -> jax.sharding.Mesh:
  """`make_mesh(requests=1, vocab=n_shards)`: the vocabulary split alone."""
  return make_mesh(requests=1, vocab=n_shards, devices=devices)


def mesh_shape(mesh: jax.sharding.Mesh) -> tuple[int, int]:
  """(requests, vocab) sizes of a mesh with axes ("requests", "vocab") or
  ("vocab",); raises ValueError for any other mesh."""
  names = tuple(mesh.axis_names)
  if names not in (AXES, (VOCAB_AXIS,)):
    raise ValueError(f"mesh must have axes {AXES} or ({VOCAB_AXIS!r},), got "
                     f"{dict(mesh.shape)}")
  return mesh.shape.get(REQUESTS_AXIS, 1), mesh.shape[VOCAB_AXIS]


def vocab_spec(ndim: int) -> jax.sharding.PartitionSpec:
  """PartitionSpec of a [..., V] array: only the last axis is sharded."""
  return jax.sharding.PartitionSpec(*([None] * (ndim - 1)), VOCAB_AXIS)


def padded_size(vocab_size: int, n_shards: int) -> int:
  """Length of the padded vocabulary: n_shards blocks of ceil(V / n)."""
  return shard_ranges(vocab_size, n_shards)[0].size * n_shards


def pad_vocab(x: jax.Array, n_shards: int, fill: typing.Any) -> jax.Array:
  """Pads the last axis of x to `padded_size` with `fill` (zero mass)."""
  pad = padded_size(x.shape[-1], n_shards) - x.shape[-1]
  if not pad:
    return x
  return jax.numpy.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)],
                       constant_values=fill)


def place(x: jax.typing.ArrayLike, mesh: jax.sharding.Mesh,
          fill: typing.Any = 0) -> jax.Array:
  """Pads [..., V] to the mesh's blocks and puts each block on its device."""
  n = mesh_shape(mesh)[1]
  x = pad_vocab(jax.numpy.asarray(x), n, fill)
  return jax.device_put(
      x, jax.sharding.NamedSharding(mesh, vocab_spec(x.ndim)))


def from_blocks(block: np.ndarray, mesh: jax.sharding.Mesh) -> jax.Array:
  """The global [..., n w] array split over "vocab" whose block on this
  process's device is `block` [..., w]: every process of a mesh with one
  device each passes its own block (a rank-link verifier's received q, a
  tensor-parallel rank's shard). Nothing is copied between processes."""
  n = mesh_shape(mesh)[1]
  mine = [d for d in mesh.devices.flat
          if d.process_index == jax.process_index()]
  if len(mine) != 1:
    raise ValueError(f"from_blocks: needs one device of the mesh per "
                     f"process, this one has {len(mine)}")
  block = np.asarray(block)
  shape = block.shape[:-1] + (n * block.shape[-1],)
  return jax.make_array_from_single_device_arrays(
      shape, jax.sharding.NamedSharding(mesh, vocab_spec(block.ndim)),
      [jax.device_put(block, mine[0])])
