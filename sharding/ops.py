"""The dyadic_jax ops over a vocabulary mesh: same names, same results.

Each op has the signature of its `dyadic_jax` twin plus a `mesh=` keyword
(a 1-D mesh with axis "vocab", see `vocab_mesh`). Vocabulary-sized inputs
are padded to the mesh's blocks with zero mass (-inf logits, zero weights
or counts) and split by contiguous id ranges; inside `jax.shard_map` each
shard runs the same row body as the single-device op with a collective
`Reducer` (sharding/collectives.py), so outputs are bit-identical to the
single-device op for any number of shards.

Vocabulary-sized outputs (weights, probabilities, dense counts) stay
sharded in the padded layout [..., padded_size(V, n)]: ids [0, V) hold
exactly the single-device values, padding ids hold zero. When n divides V
(129280 on 1, 2, 4 or 8 shards) that is [..., V]. JAX cannot shard an axis
unevenly, so unpadding an uneven vocabulary would gather the whole row onto
every device; `unpad` does that on purpose when a caller wants it. The
sharded ops also accept inputs already in the padded layout (zero mass at
padding ids). Per-row results (status, sparse ids/counts, tokens) come back
replicated.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dyadic_jax import allocation
from dyadic_jax import rng
from dyadic_jax import rowwise
from dyadic_jax import verification
from dyadic_jax import weights as weights_lib
from dyadic_jax import x64
from dyadic_jax.constants import M
from dyadic_jax.verification import DenseQ, SparseQ
from sharding import collectives
from sharding.mesh import (VOCAB_AXIS, pad_vocab, padded_size, shard_ranges,
                           vocab_spec)

_REPLICATED = P()


def _layout(mesh, vocab):
  """(shards, block size) of `vocab` ids on `mesh`."""
  if VOCAB_AXIS not in mesh.shape or len(mesh.shape) != 1:
    raise ValueError(f"mesh must be 1-D with axis {VOCAB_AXIS!r}, got "
                     f"{dict(mesh.shape)}")
  n = mesh.shape[VOCAB_AXIS]
  return n, shard_ranges(vocab, n)[0].size


def _shard_map(body, mesh, in_specs, out_specs):
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=True)


def unpad(x: jax.Array, vocab: int) -> jax.Array:
  """x[..., :vocab]: the unpadded view (gathers when V is not divisible)."""
  return x[..., :vocab]


def _rows(fn, *args, core_ndims):
  """Row-by-row application inside a shard (cache-friendly on CPU)."""
  return rowwise.map_rows(fn, *args, core_ndims=core_ndims)


def _over_vocab(row_fn, mesh, vocab, args, core_ndims, fills, vocab_out):
  """Runs row_fn(*rows, red=shard reducer) on every shard of the mesh.

  core_ndims[i] is 1 for a [..., V] argument (padded with fills[i], split by
  vocabulary blocks) and 0 for a per-row argument (replicated);
  vocab_out[j] says whether output j is a sharded [..., V] array (else it
  is replicated, one value per row).
  """
  n, size = _layout(mesh, vocab)
  batch_ndim = args[0].ndim - core_ndims[0]
  sharded = vocab_spec(batch_ndim + 1)
  per_row = P(*([None] * batch_ndim))
  padded = [pad_vocab(a, n, fill) if core else a
            for a, core, fill in zip(args, core_ndims, fills)]

  def body(*local):
    red = collectives.shard_reducer(vocab, size, n)
    return _rows(lambda *rows: row_fn(*rows, red=red), *local,
                 core_ndims=core_ndims)

  out_specs = tuple(sharded if v else per_row for v in vocab_out)
  return _shard_map(
      body, mesh, tuple(sharded if c else per_row for c in core_ndims),
      out_specs[0] if len(out_specs) == 1 else out_specs)(*padded)


# ----------------------------------------------------------------------------
# Weights.


@functools.partial(jax.jit, static_argnames="mesh")
def _draft_weights(logits, temperature, bias, mesh):
  t, t_ok = weights_lib.temperature_status(temperature, logits.shape[:-1])
  args, cores, fills = [logits, t], [1, 0], [-jnp.inf, None]
  if bias is not None:
    args, cores, fills = args + [bias], cores + [1], fills + [0.0]
  w, status = _over_vocab(weights_lib.draft_rows, mesh, logits.shape[-1],
                          args, cores, fills, (True, False))
  return weights_lib.apply_temperature_status(w, status, t_ok)


@x64.scoped
def draft_weights(logits: jax.typing.ArrayLike, *, temperature: jax.typing.ArrayLike = 1.0,
                  bias: jax.typing.ArrayLike | None = None,
                  mesh: jax.sharding.Mesh) -> tuple[jax.Array, jax.Array]:
  """`dyadic_jax.draft_weights` over a vocabulary mesh (same bits)."""
  logits = jnp.asarray(logits)
  weights_lib.check_vocab("draft_weights", logits.shape[-1])
  if bias is not None:
    bias = jnp.broadcast_to(jnp.asarray(bias), logits.shape)
  return _draft_weights(logits, jnp.asarray(temperature, jnp.float64), bias,
                        mesh)


@functools.partial(jax.jit, static_argnames="mesh")
def _target_probs(target_logits, mesh):
  return _over_vocab(weights_lib.target_probs_rows, mesh,
                     target_logits.shape[-1], [target_logits], [1],
                     [-jnp.inf], (True, False))


@x64.scoped
def target_probs(target_logits: jax.typing.ArrayLike, *, mesh: jax.sharding.Mesh
                 ) -> tuple[jax.Array, jax.Array]:
  """`dyadic_jax.target_probs` over a vocabulary mesh (same bits)."""
  target_logits = jnp.asarray(target_logits)
  weights_lib.check_vocab("target_probs", target_logits.shape[-1])
  return _target_probs(target_logits, mesh)


# ----------------------------------------------------------------------------
# Allocation.


@functools.partial(jax.jit, static_argnames="mesh")
def _allocate_dense(w, mesh):
  return _over_vocab(
      lambda w, red: allocation.largest_remainder(w, M, red), mesh,
      w.shape[-1], [w], [1], [0.0], (True, False))


@x64.scoped
def allocate_dense(weights: jax.typing.ArrayLike, *, mesh: jax.sharding.Mesh
                   ) -> tuple[jax.Array, jax.Array]:
  """`dyadic_jax.allocate_dense` over a vocabulary mesh (same bits).

  The R leftover tickets are coordinated globally: the threshold bisection
  counts with psum, and the few keys tied at the threshold are gathered
  and ranked by global id.
  """
  return _allocate_dense(jnp.asarray(weights).astype(jnp.float64), mesh)


@functools.partial(jax.jit, static_argnames=("k", "mesh"))
def _allocate_sparse(w, k, mesh):
  return _over_vocab(
      lambda w, red: allocation.allocate_sparse_rows(w, k, red), mesh,
      w.shape[-1], [w], [1], [0.0], (False,) * 4)


@x64.scoped
def allocate_sparse(weights: jax.typing.ArrayLike, k: int, *, mesh: jax.sharding.Mesh
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`dyadic_jax.allocate_sparse` over a vocabulary mesh (same bits).

  Each shard takes its local top-k; only those shards * k candidates
  (float32 key, global id) are gathered and merged by (key desc, id asc);
  support weights are looked up by id from their owners. Never a local
  normalization.
  """
  w = jnp.asarray(weights).astype(jnp.float64)
  k = int(k)
  if not 1 <= k <= w.shape[-1]:
    raise ValueError(f"allocate_sparse: k={k} not in [1, {w.shape[-1]}]")
  return _allocate_sparse(w, k, mesh)


# ----------------------------------------------------------------------------
# Draws.


@functools.partial(jax.jit, static_argnames="mesh")
def _sample_counts(counts, draw, mesh):
  return _over_vocab(
      lambda c, u, red: red.first_cum_greater(c, u.astype(jnp.int64)), mesh,
      counts.shape[-1], [counts, draw], [1, 0], [0, None], (False,))


@x64.scoped
def sample_counts(counts: jax.typing.ArrayLike, draw: jax.typing.ArrayLike, *, mesh: jax.sharding.Mesh
                  ) -> jax.Array:
  """`dyadic_jax.sample_counts` over a vocabulary mesh (same token).

  Shard-then-token: the one replicated 24-bit draw picks the shard by the
  shards' integer count totals (a zero-mass shard can never be picked),
  then the token inside it by the local cumulative counts.
  """
  counts, draw = jnp.asarray(counts), jnp.asarray(draw)
  if draw.shape != counts.shape[:-1]:
    raise ValueError(f"sample_counts: draw shape {draw.shape} must be the "
                     f"batch shape {counts.shape[:-1]} of counts")
  return _sample_counts(counts, draw, mesh)


@functools.partial(jax.jit, static_argnames="mesh")
def _sample_target(target_logits, key, mesh):
  return _over_vocab(verification.sample_target_rows, mesh,
                     target_logits.shape[-1],
                     [target_logits, rng.draw64(key)], [1, 0],
                     [-jnp.inf, None], (False, False))


@x64.scoped
def sample_target(target_logits: jax.typing.ArrayLike, key: jax.Array, *, mesh: jax.sharding.Mesh
                  ) -> tuple[jax.Array, jax.Array]:
  """`dyadic_jax.sample_target` over a vocabulary mesh (same token)."""
  return _sample_target(jnp.asarray(target_logits), key, mesh)


# ----------------------------------------------------------------------------
# Verification.


@functools.partial(jax.jit, static_argnames="mesh")
def _verify_chain(target_logits, q, draft_tokens, key, anchor, mesh):
  vocab = target_logits.shape[-1]
  n, size = _layout(mesh, vocab)
  spec = vocab_spec(2)
  if isinstance(q, DenseQ):
    q = DenseQ(pad_vocab(jnp.asarray(q.counts), n, 0))
    q_spec = DenseQ(spec)
  else:
    # Sparse rows are small: every shard gets them and keeps its own ids.
    q_spec = SparseQ(_REPLICATED, _REPLICATED, _REPLICATED)

  def body(tl, q, draft, key, anchor):
    red = collectives.shard_reducer(vocab, size, n)
    summary = _rows(lambda x, ids: weights_lib.target_summary(x, ids, red),
                    tl, verification.summary_ids(draft), core_ndims=(1, 0))
    return verification.verify_rows(summary, tl, q, draft, key, anchor, red)

  return _shard_map(
      body, mesh, (spec, q_spec, _REPLICATED, _REPLICATED, _REPLICATED),
      (_REPLICATED,) * 3)(pad_vocab(target_logits, n, -jnp.inf), q,
                                  draft_tokens, key, anchor)


@x64.scoped
def verify_chain(target_logits: jax.typing.ArrayLike, q: DenseQ | SparseQ | None,
                 draft_tokens: jax.typing.ArrayLike, key: jax.Array, *, anchor: jax.typing.ArrayLike = 0,
                 mesh: jax.sharding.Mesh) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`dyadic_jax.verify_chain` over a vocabulary mesh (same results).

  Returns (num_accepted, next_token, status), replicated, bit-identical to
  the single-device op (D = 0 included: the target-only BONUS draw).

  Every shard builds max(P_v M - c_v T, 0) for each id it owns, including
  ids outside a sparse q's support; the global residual mass picks the
  correction shard, the local cumulative mass the token, and the global id
  comes back replicated. Acceptance looks up P_x and c_x from their owner.
  A SparseQ is routed by id ownership (no shard builds the full row).
  """
  target_logits = jnp.asarray(target_logits)
  draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
  q = verification.empty_q(q, target_logits, draft_tokens)
  vocab = target_logits.shape[-1]
  padded = padded_size(vocab, _layout(mesh, vocab)[0])
  verification.check_chain_shapes(target_logits, q, draft_tokens,
                                  dense_widths=(vocab, padded))
  return _verify_chain(target_logits, q, draft_tokens, key,
                       jnp.asarray(anchor, jnp.int64), mesh)

