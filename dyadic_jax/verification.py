"""Fixed-depth speculative verification with exact integer decision rules.

Target p is floored onto a 2^-38 grid, P_v = floor(p_v 2^38), T = sum_v P_v;
the target-only sampler draws from P / T, and that P / T is the distribution
the speculative path reproduces. With q = c / M exactly (M = 2^24), every
quantity of the standard rule is an integer in units of 1 / (T M):

    accept x   iff  u < P_x M,  u = draw_below(ACCEPT bits, T c_x)
    residual   W_v = max(P_v M - c_v T, 0), token from W by CORRECTION bits
    bonus      W_v = P_v M (row D+1), token by BONUS bits

With ideal uniform u these rules give exactly P / T; the only error is the
2^-64 granularity of `draws.draw_below`, which keeps the per-position output
within total variation (V + 2) 2^-64 of P / T (docs/numerics.md proves it and
`dyadic_jax.reference` computes the exact output distribution).
"""

import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from dyadic_jax import draws, reducer, rng, rowwise, weights, x64
from dyadic_jax.constants import M, Status, TARGET_BITS


class DenseQ(typing.NamedTuple):
  """A dense dyadic q: counts int32[..., V] summing to M per row."""
  counts: ArrayLike  # int32[..., V]


class SparseQ(typing.NamedTuple):
  """A sparse dyadic q: ascending ids with positive counts, then padding."""
  ids: ArrayLike     # int32[..., k]; first n strictly ascending, then -1
  counts: ArrayLike  # int32[..., k]; positive in the first n, then 0
  n: ArrayLike       # int32[...]


def target_grid(probs, red=None):
  """(P as float64 integers, T int64): P = floor(p 2^38), T = sum_v P_v.

  P_v < 2^38 + 1 and T < 2^53, so the float64 sum is exact in any order;
  P stays float64 until a row is needed as int64 (float64 -> int64 does not
  vectorize on CPU).
  """
  p = jnp.floor(probs * jnp.float64(2.0 ** TARGET_BITS))
  return p, reducer.of(p, red).sum(p).astype(jnp.int64)


@x64.scoped
def quantize_target(probs):
  """P = floor(p 2^38) (int64[..., V]) and its exact row total T (int64)."""
  p, total = target_grid(jnp.asarray(probs, jnp.float64))
  return p.astype(jnp.int64), total


def dense_counts(q, width, offset=0, vocab=None):
  """int64[..., width] counts of a DenseQ or SparseQ over ids [offset, +width).

  A SparseQ is scattered by id ownership: only ids in this range land here
  (so a vocabulary shard never materializes the whole row). Padding
  entries and ids outside [0, vocab) are dropped.
  """
  if isinstance(q, DenseQ):
    return jnp.asarray(q.counts).astype(jnp.int64)
  vocab = width if vocab is None else vocab
  ids, counts, n = (jnp.asarray(a) for a in q)
  k = ids.shape[-1]
  live = (jnp.arange(k) < n[..., None]) & (ids >= 0) & (ids < vocab)
  local = ids - offset
  local = jnp.where(live & (local >= 0) & (local < width), local, width)
  batch = ids.shape[:-1]
  flat_ids = local.reshape((-1, k))
  flat_counts = jnp.where(live, counts, 0).reshape((-1, k)).astype(jnp.int64)
  scatter = lambda i, c: jnp.zeros((width,), jnp.int64).at[i].add(
      c, mode="drop")
  return jax.vmap(scatter)(flat_ids, flat_counts).reshape(batch + (width,))


def residual_weights(p_row, c_row, total, red=None):
  """W_v = max(P_v M - c_v T, 0) (int64), or P_v M where that is all zero.

  Only an invalid q (zero count at the drafted token) can reject with no
  residual mass; the target row itself is then the only honest fallback.
  With c_row = 0 this is the bonus row P M.
  """
  w = jnp.maximum(p_row * M - c_row * total, 0)
  return jnp.where(reducer.of(w, red).sum(w) > 0, w, p_row * M)


def categorical(weights, bits, red=None):
  """Index drawn from nonnegative int64 weights[..., V] with 64 random bits.

  u = draw_below(bits, S) with S the exact row total, then the first index
  whose inclusive cumulative weight is > u. Rows with S == 0 return V.
  """
  red = reducer.of(weights, red)
  total = red.sum(weights)
  u = draws.draw_below(bits, total).astype(jnp.int64)
  idx = red.first_cum_greater(weights, u)
  return jnp.where(total > 0, idx, red.vocab).astype(jnp.int32)


def next_token_bits(key, position, bonus):
  """64 fresh bits for the token after the accepted prefix.

  From the BONUS or CORRECTION domain: never the proposal's noise, which
  the rejection event depends on.
  """
  domain = jnp.where(bonus, rng.Domain.BONUS, rng.Domain.CORRECTION)
  return rng.draw64(rng.draw_key(key, position, domain))


def target_fixed_point_rows(target_logits, red=None):
  """(P as float64 integers, T int64, status) of target logits rows."""
  probs, status = weights.softmax64_rows(target_logits, red)
  return (*target_grid(probs, red), status)


# The same, row by row on CPU (also under vmap).
_target_fixed_point = rowwise.row_op(target_fixed_point_rows, (1,))


def sample_target_rows(target_logits, bits, red=None):
  """Body of `sample_target` given the 64 random bits of each row."""
  p, _, status = target_fixed_point_rows(target_logits, red)
  token = categorical(p.astype(jnp.int64), bits, red)
  return jnp.where(status == Status.OK, token, -1), status


@jax.jit
def _sample_target(target_logits, key):
  p, _, status = _target_fixed_point(target_logits)
  token = categorical(p.astype(jnp.int64), rng.draw64(key))
  return jnp.where(status == Status.OK, token, -1), status


@x64.scoped
def sample_target(target_logits, key):
  """The ordinary target-only sampler: one token from P / T per row.

  Args:
    target_logits: float[..., V] after the target processors (T=1, top_p=1;
      masks as -inf).
    key: typed key with the batch shape, normally
      `rng.rng_key(..., Domain.TARGET_ONLY)`.

  Returns:
    (token int32[...], status int32[...]); token -1 where the logits row is
    refused (see `target_probs`). P(token = v) is within 2^-64 of P_v / T.
  """
  return _sample_target(jnp.asarray(target_logits), key)


def _row(x, i):
  return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def verify_rows(target_fixed, c, draft_tokens, key, anchor, red=None):
  """Body of `verify_chain` on one request's rows (local or one shard).

  target_fixed: (P float64 [D+1, n], T int64 [D+1], status [D+1]) from
  `target_fixed_point_rows`; c: int64 [D, n] counts over the same ids.
  """
  p, total, status = target_fixed
  red = reducer.of(p, red)
  depth = draft_tokens.shape[0]
  q_ok = jnp.all((red.bit_or((c < 0).astype(jnp.int32)) == 0)
                 & (red.sum(c) == M))

  x = draft_tokens.astype(jnp.int32)[:, None]
  c_x = red.lookup(c, x)[:, 0]                 # 0 for ids outside [0, V)
  p_x = red.lookup(p[:depth], x)[:, 0].astype(jnp.int64)

  positions = anchor + jnp.arange(depth)
  accept_keys = jax.vmap(
      lambda pos: rng.draw_key(key, pos, rng.Domain.ACCEPT))(positions)
  u = draws.draw_below(rng.draw64(accept_keys), total[:depth] * c_x)
  accept = (c_x > 0) & (u < (p_x * M).astype(jnp.uint64))
  accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32)), dtype=jnp.int32)

  bonus = accepted == depth
  p_j, total_j = _row(p, accepted).astype(jnp.int64), _row(total, accepted)
  c_j = jnp.where(bonus, 0, _row(c, jnp.minimum(accepted, depth - 1)))
  residual = residual_weights(p_j, c_j, total_j, red)
  token = categorical(residual, next_token_bits(key, anchor + accepted, bonus),
                      red)

  ok = jnp.all(status == Status.OK) & q_ok
  return jnp.where(ok, accepted, 0), jnp.where(ok, token, -1)


@jax.jit
def _verify_chain(target_logits, q, draft_tokens, key, anchor):
  c = dense_counts(q, target_logits.shape[-1])
  return verify_rows(_target_fixed_point(target_logits), c, draft_tokens,
                     key, anchor)


@x64.scoped
def verify_chain(target_logits, q, draft_tokens, key, *, anchor=0):
  """Standard fixed-depth verification of one request's drafted chain.

  Args:
    target_logits: float[D+1, V]; row i is the target's logits after the
      target processors for the position of draft token i (row D: bonus).
    q: `DenseQ` (counts int32[D, V]) or `SparseQ` (ids/counts int32[D, k],
      n int32[D]): the exact dyadic q each draft token was drawn from.
    draft_tokens: int32[D], x_1..x_D.
    key: typed JAX key of the round (`rng.round_key`). Decision keys derive
      from it as position -> domain -> counter, positions anchor + i.
    anchor: absolute position of x_1 (int, may be traced).

  Returns:
    (num_accepted int32 in [0, D], next_token int32): x_1..x_j are accepted
    while the ACCEPT tests pass; at the first rejection j < D, next_token is
    drawn from max(P_j M - c_j T_j, 0) over the whole vocabulary (CORRECTION);
    if all D pass, from row D (BONUS). A draft token with zero q is always
    rejected. (0, -1) if any target row is refused by `target_probs` or a q
    row does not hold nonnegative counts summing to M.

  Use `jax.vmap` over requests (key and anchor batched alike).
  """
  target_logits = jnp.asarray(target_logits)
  draft_tokens = jnp.asarray(draft_tokens)
  check_chain_shapes(target_logits, q, draft_tokens)
  return _verify_chain(target_logits, q, draft_tokens, key,
                       jnp.asarray(anchor, jnp.int64))


def check_chain_shapes(target_logits, q, draft_tokens, dense_widths=None):
  """Raises ValueError/TypeError unless the shapes form one D-chain.

  dense_widths: accepted column counts of a DenseQ (default: V only).
  """
  depth = draft_tokens.shape[-1]
  if draft_tokens.ndim != 1 or target_logits.shape[:-1] != (depth + 1,):
    raise ValueError(
        f"verify_chain: need target_logits [D+1, V] and draft_tokens [D], got "
        f"{target_logits.shape} and {draft_tokens.shape}")
  if not isinstance(q, (DenseQ, SparseQ)):
    raise TypeError(f"verify_chain: q must be DenseQ or SparseQ, got {type(q)}")
  widths = dense_widths or (target_logits.shape[-1],)
  if isinstance(q, DenseQ) and q.counts.shape[-1] not in widths:
    raise ValueError(f"verify_chain: dense q has {q.counts.shape[-1]} columns,"
                     f" target vocabulary is {target_logits.shape[-1]}")
  if q.counts.shape[:-1] != (depth,):
    raise ValueError(f"verify_chain: q rows {q.counts.shape} do not match "
                     f"depth {depth}")
