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

from dyadic_jax import draws, qrows, reducer, rng, rowwise, weights, x64
from dyadic_jax.constants import M, Status, TARGET_BITS


class DenseQ(typing.NamedTuple):
  """A dense dyadic q: counts int32[..., V] summing to M per row."""
  counts: jax.Array  # int32[..., V]


class SparseQ(typing.NamedTuple):
  """A sparse dyadic q: ascending ids with positive counts, then padding."""
  ids: jax.Array     # int32[..., k]; first n strictly ascending, then -1
  counts: jax.Array  # int32[..., k]; positive in the first n, then 0
  n: jax.Array       # int32[...]


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


_Q_NEGATIVE, _Q_ABOVE_M, _Q_PADDING = 4, 2, 1


def dense_q_status(counts, red=None):
  """Status of dense count rows int[..., n]: NEGATIVE, WRONG_MASS (a count
  above M), PADDING_NONZERO (a count at an id >= V), WRONG_MASS (sum != M).

  The order of `qrows.dense` on the same q = c / M. One OR-reduction of
  per-entry class bits, then one exact integer sum.
  """
  red = reducer.of(counts, red)
  ids = lax.broadcasted_iota(jnp.int32, counts.shape, counts.ndim - 1)
  flags = (jnp.where(counts < 0, _Q_NEGATIVE, 0)
           | jnp.where(counts > M, _Q_ABOVE_M, 0)
           | jnp.where((ids + red.offset >= red.vocab) & (counts != 0),
                       _Q_PADDING, 0)).astype(jnp.int32)
  seen = red.bit_or(flags)
  total = red.sum(counts.astype(jnp.int64))
  return jnp.select(
      [(seen & _Q_NEGATIVE) > 0, (seen & _Q_ABOVE_M) > 0,
       (seen & _Q_PADDING) > 0, total != M],
      [Status.NEGATIVE, Status.WRONG_MASS, Status.PADDING_NONZERO,
       Status.WRONG_MASS], Status.OK).astype(jnp.int32)


def sparse_q_status(q, vocab):
  """Status of SparseQ rows: `qrows.sparse` on q = c / M (replicated data).

  MISSING_Q, ID_OUT_OF_RANGE, DUPLICATE_ID, UNSORTED_IDS, NEGATIVE,
  WRONG_MASS (a count above M, or a sum other than M). No token check: a
  drafted token outside the support is rejected, not refused.
  """
  ids, counts, n = (jnp.asarray(a) for a in q)
  # float32(c) 2^-24 has the class of c: exact for |c| <= M, and beyond
  # that still negative or above 1.
  bits = lax.bitcast_convert_type(
      counts.astype(jnp.float32) * jnp.float32(2.0 ** -24), jnp.uint32)
  return qrows.sparse(bits, ids, n, vocab=vocab, xp=jnp)[1]


def first_failure(status):
  """The first non-OK entry of status[..., rows] (OK if none)."""
  bad = status != Status.OK
  first = jnp.argmax(bad, axis=-1)
  return jnp.where(jnp.any(bad, -1),
                   jnp.take_along_axis(status, first[..., None], -1)[..., 0],
                   Status.OK).astype(jnp.int32)


def chain_status(target_status, q_status):
  """Status of one chain: the first refused target row (rows 0..D), else the
  first refused q row (rows 0..D-1), else OK."""
  return first_failure(jnp.concatenate(
      [target_status.astype(jnp.int32), q_status.astype(jnp.int32)], -1))


def verify_rows(target_fixed, c, q_status, draft_tokens, key, anchor,
                red=None):
  """Body of `verify_chain` on one request's rows (local or one shard).

  target_fixed: (P float64 [D+1, n], T int64 [D+1], status [D+1]) from
  `target_fixed_point_rows`; c: int64 [D, n] counts over the same ids;
  q_status: int32 [D] from `dense_q_status` / `sparse_q_status`.
  """
  p, total, status = target_fixed
  red = reducer.of(p, red)
  depth = draft_tokens.shape[0]

  if depth:
    x = draft_tokens.astype(jnp.int32)[:, None]
    c_x = red.lookup(c, x)[:, 0]                 # 0 for ids outside [0, V)
    p_x = red.lookup(p[:depth], x)[:, 0].astype(jnp.int64)
    positions = anchor + jnp.arange(depth)
    accept_keys = jax.vmap(
        lambda pos: rng.draw_key(key, pos, rng.Domain.ACCEPT))(positions)
    u = draws.draw_below(rng.draw64(accept_keys), total[:depth] * c_x)
    accept = (c_x > 0) & (u < (p_x * M).astype(jnp.uint64))
    accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32)),
                       dtype=jnp.int32)
  else:  # D = 0: a target-only step, the bonus draw from row 0
    accepted = jnp.zeros((), jnp.int32)

  bonus = accepted == depth
  p_j, total_j = _row(p, accepted).astype(jnp.int64), _row(total, accepted)
  if depth:
    c_j = jnp.where(bonus, 0, _row(c, jnp.minimum(accepted, depth - 1)))
  else:
    c_j = jnp.zeros((), jnp.int64)
  residual = residual_weights(p_j, c_j, total_j, red)
  token = categorical(residual, next_token_bits(key, anchor + accepted, bonus),
                      red)

  chain = chain_status(status, q_status)
  ok = chain == Status.OK
  return jnp.where(ok, accepted, 0), jnp.where(ok, token, -1), chain


def q_rows_status(q, c, vocab, red=None):
  """Per-row status [D] of a DenseQ (from its counts c) or a SparseQ."""
  if isinstance(q, DenseQ):
    return dense_q_status(c, red)
  return sparse_q_status(q, vocab)


@jax.jit
def _verify_chain(target_logits, q, draft_tokens, key, anchor):
  vocab = target_logits.shape[-1]
  c = dense_counts(q, vocab)
  return verify_rows(_target_fixed_point(target_logits), c,
                     q_rows_status(q, c, vocab), draft_tokens, key, anchor)


@x64.scoped
def verify_chain(target_logits: jax.typing.ArrayLike, q: "DenseQ | SparseQ",
                 draft_tokens: jax.typing.ArrayLike, key: jax.Array, *,
                 anchor: jax.typing.ArrayLike = 0
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Standard fixed-depth verification of one request's drafted chain.

  Args:
    target_logits: float[D+1, V]; row i is the target's logits after the
      target processors for the position of draft token i (row D: bonus).
    q: `DenseQ` (counts int32[D, V]) or `SparseQ` (ids/counts int32[D, k],
      n int32[D]): the exact dyadic q each draft token was drawn from.
      With D = 0 it may be None.
    draft_tokens: int32[D], x_1..x_D (D >= 0).
    key: typed JAX key of the round (`rng.round_key`). Decision keys derive
      from it as position -> domain -> counter, positions anchor + i.
    anchor: absolute position of x_1 (int, may be traced).

  Returns:
    (num_accepted int32 in [0, D], next_token int32, status int32):
    x_1..x_j are accepted while the ACCEPT tests pass; at the first
    rejection j < D, next_token is drawn from max(P_j M - c_j T_j, 0) over
    the whole vocabulary (CORRECTION); if all D pass, from row D (BONUS).
    A draft token with zero q (or outside [0, V)) is always rejected.
    D = 0 is a target-only step: next_token is the BONUS draw from row 0,
    the same token as `sample_target(target_logits[0], draw_key(key,
    anchor, Domain.BONUS))`.
    status is OK, or the first refused target row's status (see
    `target_probs`; rows 0..D in order), else the first refused q row's
    (dense: NEGATIVE, WRONG_MASS for a count above M or a sum other than
    M, PADDING_NONZERO; sparse: also MISSING_Q, ID_OUT_OF_RANGE,
    DUPLICATE_ID, UNSORTED_IDS). A refused chain returns (0, -1, status):
    never commit its token.

  Use `jax.vmap` over requests (key and anchor batched alike).
  """
  target_logits = jnp.asarray(target_logits)
  draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
  q = empty_q(q, target_logits, draft_tokens)
  check_chain_shapes(target_logits, q, draft_tokens)
  return _verify_chain(target_logits, q, draft_tokens, key,
                       jnp.asarray(anchor, jnp.int64))


def empty_q(q, target_logits, draft_tokens):
  """q, or an empty DenseQ when q is None and D = 0."""
  if q is None and draft_tokens.shape == (0,):
    return DenseQ(jnp.zeros((0, target_logits.shape[-1]), jnp.int32))
  return q


def check_chain_shapes(target_logits, q, draft_tokens, dense_widths=None):
  """Raises ValueError/TypeError unless the shapes form one D-chain.

  dense_widths: accepted column counts of a DenseQ (default: V only).
  """
  if draft_tokens.ndim != 1 or target_logits.ndim != 2 or (
      target_logits.shape[0] != draft_tokens.shape[0] + 1):
    raise ValueError(
        f"verify_chain: need target_logits [D+1, V] and draft_tokens [D], got "
        f"{target_logits.shape} and {draft_tokens.shape}")
  weights.check_vocab("verify_chain", target_logits.shape[-1])
  depth = draft_tokens.shape[0]
  if not isinstance(q, (DenseQ, SparseQ)):
    raise TypeError(f"verify_chain: q must be DenseQ or SparseQ, got {type(q)}")
  widths = dense_widths or (target_logits.shape[-1],)
  counts_shape = jnp.shape(q.counts)
  if isinstance(q, DenseQ) and counts_shape[-1:] != () and (
      counts_shape[-1] not in widths):
    raise ValueError(f"verify_chain: dense q has {counts_shape[-1]} columns,"
                     f" target vocabulary is {target_logits.shape[-1]}")
  if len(counts_shape) != 2 or counts_shape[0] != depth:
    raise ValueError(f"verify_chain: q rows {counts_shape} do not match "
                     f"depth {depth}")
  if isinstance(q, SparseQ) and (jnp.shape(q.ids) != counts_shape
                                 or jnp.shape(q.n) != (depth,)):
    raise ValueError(f"verify_chain: sparse q needs ids and counts [D, k] "
                     f"and n [D], got {jnp.shape(q.ids)}, {counts_shape}, "
                     f"{jnp.shape(q.n)}")
