"""sharding: the dyadic_jax ops as collectives over a vocabulary mesh axis.

Same names and signatures as the `dyadic_jax` ops plus `mesh=`, same bits
for any number of shards (docs/architecture.md, "sharding"; the contract:
docs/numerics.md); `vocab_mesh`, `shard_ranges` and `place` set up the mesh
and the contiguous id blocks.
"""

from sharding.mesh import (VOCAB_AXIS, ShardRange, pad_vocab, padded_size,
                           place, shard_ranges, vocab_mesh, vocab_spec)
from sharding.ops import (allocate_dense, allocate_sparse, draft_weights,
                          sample_counts, sample_target, target_probs, unpad,
                          verify_chain)

__all__ = [
    "VOCAB_AXIS", "ShardRange", "allocate_dense", "allocate_sparse",
    "draft_weights", "pad_vocab", "padded_size", "place", "sample_counts",
    "sample_target", "shard_ranges", "target_probs", "unpad", "verify_chain",
    "vocab_mesh", "vocab_spec",
]
