"""The vocabulary mesh and contiguous shard ranges.

Shard s of n owns global ids [start, stop) of a vocabulary padded to
n * size; ids in [V, n * size) are padding and always carry zero mass.
"""

import typing

import jax
import numpy as np

VOCAB_AXIS = "vocab"


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


def vocab_mesh(n_shards: int,
               devices: typing.Sequence[jax.Device] | None = None
               ) -> jax.sharding.Mesh:
  """A 1-D mesh of the first `n_shards` devices, single axis "vocab".

  Args:
    n_shards: devices on the axis, in [1, len(devices)].
    devices: default `jax.devices()` (the default backend's).

  The axis is Auto on purpose, so that arrays placed with NamedSharding and
  shard_map in_specs agree without explicit-sharding type errors.

  On a CPU, emulate devices before JAX first uses one:
  `jax.config.update("jax_num_cpu_devices", 8)`, or
  `XLA_FLAGS=--xla_force_host_platform_device_count=8` in the environment.
  """
  devices = jax.devices() if devices is None else list(devices)
  if not 1 <= n_shards <= len(devices):
    hint = ""
    if devices and devices[0].platform == "cpu":
      hint = (f"; for more CPU devices, before JAX first uses a device: "
              f"jax.config.update(\"jax_num_cpu_devices\", {max(n_shards, 1)})"
              f" or XLA_FLAGS=--xla_force_host_platform_device_count="
              f"{max(n_shards, 1)}")
    raise ValueError(f"vocab_mesh: {n_shards} shards but {len(devices)} "
                     f"devices available{hint}")
  return jax.sharding.Mesh(
      np.asarray(devices[:n_shards]), (VOCAB_AXIS,),
      axis_types=(jax.sharding.AxisType.Auto,))


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
  n = mesh.shape[VOCAB_AXIS]
  x = pad_vocab(jax.numpy.asarray(x), n, fill)
  return jax.device_put(
      x, jax.sharding.NamedSharding(mesh, vocab_spec(x.ndim)))
