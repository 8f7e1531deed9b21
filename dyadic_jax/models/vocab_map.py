"""A draft over a restricted output vocabulary: K kept ids of V.

A draft whose q is zero outside a fixed set of frequent tokens keeps
verification exact (q may be anything; the residual max(p - q, 0) gives
the target's mass outside the set back) and cuts its step's cost, which a
V = 49,152 output layer dominates. The draft model itself is an ordinary
`transformer` over K + 1 ids: 0..K-1 are the kept tokens in `kept`'s
order, K stands for every other token (as input only: its logit reaches
no full id).

    vmap = vocab_map.make(kept, vocab=V)
    small = vocab_map.to_small(vmap, tokens)     # full ids -> model ids
    rows = vocab_map.expand(vmap, small_logits)  # [..., K + 1] -> [..., V]

`expand` fills the ids outside the set with -inf: zero weight in the
draft's softmax (docs/numerics.md: -inf logits are allowed), so no
allocation gives them a ticket.
"""

import typing

import jax
import jax.numpy as jnp
import numpy as np


class VocabMap(typing.NamedTuple):
  """The two lookups (arrays: pass them as arguments of a jit)."""
  to_small: jax.Array   # int32[V]: a full id's model id (K if not kept)
  to_full: jax.Array    # int32[V]: a full id's column of [logits, -inf]
                        # (its model id if kept, else K + 1)


def make(kept: typing.Any, vocab: int) -> VocabMap:
  """The map of `kept` (distinct ids in [0, vocab), model id = position).

  Raises:
    ValueError: kept empty, not 1-D, with repeats or ids out of range.
  """
  kept = np.asarray(kept)
  if kept.ndim != 1 or kept.size == 0 or kept.dtype.kind not in "iu":
    raise ValueError(f"vocab_map: kept must be a non-empty 1-D integer "
                     f"array, got {kept.dtype}{list(kept.shape)}")
  if kept.min() < 0 or kept.max() >= vocab or np.unique(kept).size != \
      kept.size:
    raise ValueError(f"vocab_map: kept must hold distinct ids in [0, "
                     f"{vocab})")
  k = kept.size
  to_small = np.full(vocab, k, np.int32)
  to_small[kept] = np.arange(k, dtype=np.int32)
  to_full = np.where(to_small < k, to_small, k + 1).astype(np.int32)
  return VocabMap(jnp.asarray(to_small), jnp.asarray(to_full))


def to_small(vmap: VocabMap, tokens: typing.Any) -> jax.Array:
  """Model ids of full ids (any shape; traceable)."""
  return jnp.take(vmap.to_small, jnp.asarray(tokens, jnp.int32))


def host_small(vmap: VocabMap, tokens: typing.Any) -> np.ndarray:
  """`to_small` on the host (numpy in, numpy out)."""
  return np.asarray(vmap.to_small)[np.asarray(tokens, np.int64)]


def expand(vmap: VocabMap, logits: jax.Array) -> jax.Array:
  """f32[..., V] logits of the full vocabulary from f32[..., K + 1]: the
  kept ids' logits, -inf elsewhere (traceable)."""
  pad = jnp.full(logits.shape[:-1] + (1,), -jnp.inf, logits.dtype)
  return jnp.take(jnp.concatenate([logits, pad], axis=-1), vmap.to_full,
                  axis=-1)
