"""sharding: the dyadic_jax ops over a (requests, vocab) device mesh.

Same names and signatures as the `dyadic_jax` ops plus `mesh=` (None: one
device), same bits for any mesh shape (docs/architecture.md, "sharding";
the contract: docs/numerics.md). `make_mesh(requests=r, vocab=v)` and
`vocab_mesh(n)` build meshes; `shard_ranges`, `place` and `from_blocks` (one
block per process) give the contiguous id blocks; `executor(mesh)` is what
the ops pass to their `dyadic_jax` declarations.
"""

from sharding.mesh import (AXES, REQUESTS_AXIS, VOCAB_AXIS, ShardRange,
                           from_blocks, make_mesh, mesh_shape, pad_vocab,
                           padded_size, place, shard_ranges, vocab_mesh,
                           vocab_spec)
from sharding.ops import (MeshExecutor, allocate_dense, allocate_sparse,
                          draft_weights, executor, propose_dense,
                          propose_sparse, sample_counts,
                          sample_target, target_probs, unpad, verify_batch,
                          verify_chain)

__all__ = [
    "AXES", "MeshExecutor", "REQUESTS_AXIS", "VOCAB_AXIS", "ShardRange",
    "allocate_dense", "allocate_sparse", "draft_weights", "executor",
    "from_blocks", "make_mesh", "mesh_shape", "pad_vocab", "padded_size",
    "place", "propose_dense", "propose_sparse", "sample_counts", "sample_target", "shard_ranges", "target_probs",
    "unpad", "verify_batch", "verify_chain", "vocab_mesh", "vocab_spec",
]
