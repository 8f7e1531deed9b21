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
