"""sharding: the dyadic_jax ops as collectives over a vocabulary mesh axis.

This package holds the mesh and shard-range layer; the sharded ops build on
it (DESIGN.md section 4).
"""

from sharding.mesh import VOCAB_AXIS, ShardRange, shard_ranges, vocab_mesh

__all__ = ["VOCAB_AXIS", "ShardRange", "shard_ranges", "vocab_mesh"]
