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


def shard_ranges(vocab_size, n_shards):
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


def vocab_mesh(n_shards, devices=None):
  """A 1-D mesh of `n_shards` devices with the single axis "vocab".

  The axis is Auto on purpose, so that arrays placed with NamedSharding and
  shard_map in_specs agree without explicit-sharding type errors.
  """
  devices = jax.devices() if devices is None else list(devices)
  if not 1 <= n_shards <= len(devices):
    raise ValueError(f"vocab_mesh: {n_shards} shards but {len(devices)} "
                     f"devices available")
  return jax.sharding.Mesh(
      np.asarray(devices[:n_shards]), (VOCAB_AXIS,),
      axis_types=(jax.sharding.AxisType.Auto,))


def vocab_spec(ndim):
  """PartitionSpec of a [..., V] array: only the last axis is sharded."""
  return jax.sharding.PartitionSpec(*([None] * (ndim - 1)), VOCAB_AXIS)


def padded_size(vocab_size, n_shards):
  """Length of the padded vocabulary: n_shards blocks of ceil(V / n)."""
  return shard_ranges(vocab_size, n_shards)[0].size * n_shards


def pad_vocab(x, n_shards, fill):
  """Pads the last axis of x to `padded_size` with `fill` (zero mass)."""
  pad = padded_size(x.shape[-1], n_shards) - x.shape[-1]
  if not pad:
    return x
  return jax.numpy.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)],
                       constant_values=fill)


def place(x, mesh, fill=0):
  """Pads [..., V] to the mesh's blocks and puts each block on its device."""
  n = mesh.shape[VOCAB_AXIS]
  x = pad_vocab(jax.numpy.asarray(x), n, fill)
  return jax.device_put(
      x, jax.sharding.NamedSharding(mesh, vocab_spec(x.ndim)))
