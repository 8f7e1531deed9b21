"""Fixed-depth speculative verification with exact integer decision rules.

Target rows enter as fixed point (`weights.target_rows`): P_v =
round(p_v 2^38), T = sum_v P_v; the target-only sampler draws from P / T,
and that P / T is the distribution the speculative path reproduces. With
q = c / M exactly (M = 2^24), every quantity of the standard rule is an
integer in units of 1 / (T M):

    accept x   iff  u < P_x M,  u = draw_below(ACCEPT bits, T c_x)
    residual   W_v = max(P_v M - c_v T, 0), token from W by CORRECTION bits
    bonus      W_v = P_v M (row D+1), token by BONUS bits

With ideal uniform u these rules give exactly P / T; the only error is the
2^-64 granularity of `draws.draw_below`, which keeps the per-position output
within total variation (V + 2) 2^-64 of P / T (docs/numerics.md proves it and
`dyadic_jax.reference` computes the exact output distribution).

Only what the rule needs is computed at full width: every target row's
max (its status), and Z' and T of the rows the chain reaches (loop mode,
`walk_chains`; batched mode normalizes every row at once); the drafted
entries P_x and c_x by lookup; and the residual row of the one position
where the chain stops, scanned from float64 limbs without an int64 row.
"""

import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
import numpy as np

from dyadic_jax import (cumulative, draws, qrows, reducer, rng, rowops,
                        rowwise, weights, x64)
from dyadic_jax.constants import LOG2_M, M, Status, TARGET_BITS


class DenseQ(typing.NamedTuple):
  """A dense dyadic q: counts int32[..., V] summing to M per row.

  Counts of any integer dtype are accepted and judged on their exact
  values: the ops clamp them to int32 (`qrows.saturate_int32`, which
  changes no verdict), never wrap them. Any other dtype (float, bool) is a
  TypeError naming the op.
  """
  counts: ArrayLike  # int32[..., V] (any integer dtype)


class SparseQ(typing.NamedTuple):
  """A sparse dyadic q: ascending ids with positive counts, then padding.

  A row is valid only in this canonical form: n in [1, k]; the first n
  entries strictly ascending ids in [0, V) with counts in [1, M] summing to
  M; every other entry (id -1, count 0). A live count of 0 is MISSING_Q,
  any other padding PADDING_NONZERO (`qrows.sparse_counts`). Fields of any
  integer dtype, as `DenseQ`.
  """
  ids: ArrayLike     # int32[..., k]; first n strictly ascending, then -1
  counts: ArrayLike  # int32[..., k]; positive in the first n, then 0
  n: ArrayLike       # int32[...]


@x64.scoped
def quantize_target(probs: jax.typing.ArrayLike
                    ) -> tuple[jax.Array, jax.Array]:
  """P = round(p 2^38) (int64[..., V]) and its exact row total T (int64).

  With p from `target_probs`, these are the P and T of verification and of
  the target-only sampler.
  """
  probs = jnp.asarray(probs, jnp.float64)
  weights.check_rows("quantize_target", probs)
  p = jnp.round(probs * jnp.float64(2.0 ** TARGET_BITS))
  return p.astype(jnp.int64), jnp.sum(p, -1).astype(jnp.int64)


def dense_counts(q: "DenseQ | SparseQ", width: int, offset: typing.Any = 0,
                 vocab: int | None = None) -> jax.Array:
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


def residual_weights(p_row: jax.Array, c_row: jax.Array, total: jax.Array,
                     red: reducer.Reducer | None = None) -> cumulative.Blocked:
  """W_v = max(P_v M - c_v T, 0), or P_v M where that is all zero.

  p_row: P (float64 integers, `weights.fixed_point`); c_row: int counts
  (0 for the bonus row, whose W is then P M); total: T (int64). Only an
  invalid q (zero count at the drafted token) can reject with no residual
  mass; the target row itself is then the only honest fallback.

  Returned for the scan (`cumulative.Blocked`) without an int64 row: with
  T = T_h 2^24 + T_l, W = 2^24 A - B for A = P - c T_h and B = c T_l,
  float64 integers computed exactly (|A| < 2^40, B < 2^49), kept where
  2^24 A > B (an exact comparison). A kept A is in (0, P], so its row sum
  is below T < 2^39, and B's is at most T_l M < 2^48 for a valid q: exact
  float64 block sums (docs/numerics.md section 6.2).
  """
  f64 = jnp.float64
  red = reducer.of(p_row, red)
  t_h = (total >> LOG2_M).astype(f64)
  t_l = (total & (M - 1)).astype(f64)
  c = jnp.asarray(c_row).astype(f64)
  a = p_row - c * t_h
  b = c * t_l
  keep = a * f64(M) > b
  return cumulative.blocked_limbs(
      jnp.where(keep, a, 0.0), jnp.where(keep, b, 0.0), LOG2_M,
      fallback=p_row, use_fallback=lambda local: red.sum(local[..., None]) == 0)


def categorical(weights_: jax.Array | cumulative.Blocked, bits: jax.Array,
                red: reducer.Reducer | None = None) -> jax.Array:
  """Index drawn from nonnegative integer weights[..., V] with 64 random bits.

  weights_: int64 rows or a `cumulative.Blocked`. u = draw_below(bits, S)
  with S the exact row total, then the first index whose inclusive
  cumulative weight is > u. Rows with S == 0 return V.
  """
  if red is None:
    red = reducer.local(weights_.n if isinstance(weights_, cumulative.Blocked)
                        else weights_.shape[-1])
  return red.first_cum_greater(
      weights_, lambda total: draws.draw_below(bits, total).astype(jnp.int64))


def next_token_bits(key: jax.Array, position: jax.Array, bonus: jax.Array) -> jax.Array:
  """64 fresh bits for the token after the accepted prefix.

  From the BONUS or CORRECTION domain: never the proposal's noise, which
  the rejection event depends on.
  """
  domain = jnp.where(bonus, rng.Domain.BONUS, rng.Domain.CORRECTION)
  return rng.draw64(rng.draw_key(key, position, domain))


def fixed_row(target_logits: jax.Array, rows: weights.TargetRows, i: jax.Array
              ) -> jax.Array:
  """P of row i (float64 integers [n]), its terms recomputed
  (`weights.target_terms`)."""
  e = weights.target_terms(_row(target_logits, i), _row(rows.shift, i),
                           _row(rows.status, i))
  return weights.fixed_point(e, _row(rows.inv, i))


def sample_target_rows(target_logits: jax.Array, bits: jax.Array, red: reducer.Reducer | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  """Body of `sample_target` given the 64 random bits of each row."""
  rows, e = weights.target_rows(target_logits, red)
  p = weights.fixed_point(e, rows.inv[..., None])
  token = categorical(cumulative.blocked_limbs(p, None, 0), bits, red)
  return jnp.where(rows.status == Status.OK, token, -1), rows.status


@functools.partial(jax.jit, static_argnames="executor")
def _sample_target(target_logits, key, executor):
  return executor.run(
      rowops.declare(sample_target_rows,
                     (rowops.Arg(1, -jnp.inf), rowops.Arg(0)), (False, False),
                     target_logits.shape[-1]),
      target_logits, rng.draw64(key))


@x64.scoped
def sample_target(target_logits: jax.typing.ArrayLike, key: jax.Array, *,
                  executor: rowops.Executor = rowops.LOCAL
                  ) -> tuple[jax.Array, jax.Array]:
  """The ordinary target-only sampler: one token from P / T per row.

  Args:
    target_logits: float[..., V] after the target processors (T=1, top_p=1;
      masks as -inf).
    key: typed key array with the batch shape (an int or a raw key is a
      TypeError), normally the TARGET_ONLY key of the request's position:
      `draw_key(round_key, anchor, Domain.TARGET_ONLY)` (or `rng_key`).

  Returns:
    (token int32[...], status int32[...]); token -1 where the logits row is
    refused (see `target_probs`). P(token = v) is within 2^-64 of P_v / T.
  """
  rng.check_key("sample_target", "key", key)
  target_logits = jnp.asarray(target_logits)
  weights.check_rows("sample_target", target_logits)
  if jnp.shape(key) != target_logits.shape[:-1]:
    raise ValueError(f"sample_target: key shape {jnp.shape(key)} must be the "
                     f"batch shape {target_logits.shape[:-1]}")
  return _sample_target(target_logits, key, executor)


def _row(x, i):
  return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _cell(x, r, i):
  """x[r, i] as one dynamic slice of x (nothing of x[r] is materialized)."""
  starts = (jnp.asarray(r, jnp.int32), jnp.asarray(i, jnp.int32)) + (
      jnp.int32(0),) * (x.ndim - 2)
  return lax.dynamic_slice(x, starts, (1, 1) + x.shape[2:])[0, 0]


# Per-count codes in the order of `qrows.dense`; a row reports its largest.
_Q_STATUS = (Status.OK, Status.PADDING_NONZERO, Status.WRONG_MASS,
             Status.NEGATIVE)


def dense_q_status(counts: jax.Array, red: reducer.Reducer | None = None) -> jax.Array:
  """Status of dense count rows int[..., n]: NEGATIVE, WRONG_MASS (a count
  above M), PADDING_NONZERO (a count at an id >= V), WRONG_MASS (sum != M).

  The order of `qrows.dense` on the same q = c / M. Judged on the exact
  values (wider integers are clamped to int32, `qrows.saturate_int32`).
  One pass: the int32 max of per-count codes beside the exact sum (float64:
  |c| < 2^31 and V <= 2^18, so every partial sum is an integer below 2^53).
  """
  red = reducer.of(counts, red)
  i32 = jnp.int32
  counts = qrows.saturate_int32(counts, jnp)
  ids = lax.broadcasted_iota(i32, counts.shape, counts.ndim - 1) + red.offset
  codes = jnp.where(counts < 0, i32(3), jnp.where(
      counts > M, i32(2), jnp.where((ids >= red.vocab) & (counts != 0),
                                    i32(1), i32(0))))
  worst, total = reducer.one_pass(red, (reducer.MAX, codes),
                                  (reducer.SUM, counts.astype(jnp.float64)))
  status = jnp.asarray(_Q_STATUS, i32)[worst]
  return jnp.where((worst == 0) & (total != M), Status.WRONG_MASS,
                   status).astype(i32)


def sparse_q_status(q: SparseQ, vocab: int) -> jax.Array:
  """Status of SparseQ rows: `qrows.sparse_counts` (replicated data).

  MISSING_Q, ID_OUT_OF_RANGE, DUPLICATE_ID, UNSORTED_IDS, NEGATIVE,
  WRONG_MASS (a count above M), PADDING_NONZERO (padding other than (-1,
  0)), WRONG_MASS (a sum other than M), MISSING_Q (a live count of 0), on
  the exact integers. No token check: a drafted token outside the support
  is rejected, not refused.
  """
  return qrows.sparse_counts(q.counts, q.ids, q.n, vocab=vocab, xp=jnp)[1]


def int32_q(q: DenseQ | SparseQ) -> DenseQ | SparseQ:
  """q with every field int32, clamped (`qrows.saturate_int32`): the
  verdicts of the exact values, in the one form the row bodies see.

  Host data is narrowed with numpy and device or traced arrays with
  jax.numpy, before the op's jit: one compiled program serves every
  integer dtype.
  """
  def narrow(a):
    xp = jnp if isinstance(a, jax.Array) else np
    a = xp.asarray(a)
    return a if a.dtype == np.int32 else qrows.saturate_int32(a, xp)

  return type(q)(*(narrow(a) for a in q))


def q_rows_status(q: DenseQ | SparseQ, red: reducer.Reducer) -> jax.Array:
  """Per-row status [D] of a DenseQ (its local counts) or a SparseQ."""
  if isinstance(q, DenseQ):
    return dense_q_status(jnp.asarray(q.counts), red)
  return sparse_q_status(q, red.vocab)


def first_failure(status: jax.Array) -> jax.Array:
  """The first non-OK entry of status[..., rows] (OK if none)."""
  bad = status != Status.OK
  first = jnp.argmax(bad, axis=-1)
  return jnp.where(jnp.any(bad, -1),
                   jnp.take_along_axis(status, first[..., None], -1)[..., 0],
                   Status.OK).astype(jnp.int32)


def chain_status(target_status: jax.Array, q_status: jax.Array) -> jax.Array:
  """Status of one chain: the first refused target row (rows 0..D), else the
  first refused q row (rows 0..D-1), else OK."""
  return first_failure(jnp.concatenate(
      [target_status.astype(jnp.int32), q_status.astype(jnp.int32)], -1))


def drafted_counts(q: DenseQ | SparseQ, x: jax.Array, red: reducer.Reducer
                   ) -> jax.Array:
  """c_x (int64 [D]): each row's count at its drafted token, 0 outside V."""
  if isinstance(q, DenseQ):
    counts = jnp.asarray(q.counts)
    return red.lookup(counts, x[:, None])[:, 0].astype(jnp.int64)
  ids, counts, n = (jnp.asarray(a) for a in q)
  live = (jnp.arange(ids.shape[-1]) < n[:, None]) & (ids == x[:, None])
  return jnp.sum(jnp.where(live, counts, 0).astype(jnp.int64), -1)


def row_counts(q: DenseQ | SparseQ, j: jax.Array, width: int,
               red: reducer.Reducer) -> jax.Array:
  """Counts of q's row j over this shard's `width` ids (int64 [width])."""
  if isinstance(q, DenseQ):
    return _row(jnp.asarray(q.counts), j).astype(jnp.int64)
  row = SparseQ(*(_row(a, j) for a in q))
  return dense_counts(row, width, red.offset, red.vocab)


def summary_ids(draft_tokens: jax.Array) -> jax.Array:
  """Per target row, the id whose term verification needs: x_1..x_D, -1."""
  return jnp.concatenate([draft_tokens.astype(jnp.int32),
                          jnp.full((1,), -1, jnp.int32)])


def next_token(p_j: jax.Array, q: DenseQ | SparseQ, j: jax.Array, depth: int,
               total: jax.Array, key: jax.Array, anchor: jax.Array,
               red: reducer.Reducer) -> jax.Array:
  """The token after the accepted prefix, the chain having stopped at row j.

  p_j: row j's P (float64 integers); total: its T (int64). j < D: the
  CORRECTION draw from max(P_j M - c_j T, 0); j = D: the BONUS draw from
  P_D M.
  """
  if depth:
    c_j = row_counts(q, jnp.minimum(j, depth - 1), p_j.shape[-1], red)
  else:
    c_j = jnp.zeros((), jnp.int64)
  return draw_next(p_j, c_j, j == depth, total, key, anchor + j, red)


def draw_next(p_j: jax.Array, c_j: jax.Array, bonus: jax.Array,
              total: jax.Array, key: jax.Array, position: jax.Array,
              red: reducer.Reducer) -> jax.Array:
  """`next_token` given row j's counts c_j (ignored when bonus) and the
  position anchor + j of its draw."""
  c_j = jnp.where(bonus, 0, c_j)
  return categorical(residual_weights(p_j, c_j, total, red),
                     next_token_bits(key, position, bonus), red)


def verify_rows(summary: tuple[weights.TargetRows, jax.Array], target_logits: jax.Array,
                q: DenseQ | SparseQ, draft_tokens: jax.Array, key: jax.Array,
                anchor: jax.Array, red: reducer.Reducer | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Body of `verify_chain` on one request's rows (local or one shard).

  summary: (`weights.TargetRows` [D+1], e at `summary_ids` [D+1]) from
  `weights.target_summary`; target_logits [D+1, n] (the residual row is
  recomputed from it); q: DenseQ (counts int32 [D, n] over the same ids)
  or SparseQ (replicated [D, k]). Returns (num_accepted, next_token,
  status).
  """
  rows, e_x = summary
  red = reducer.of(target_logits, red)
  depth = draft_tokens.shape[0]
  total = rows.total.astype(jnp.int64)

  if depth:
    x = draft_tokens.astype(jnp.int32)
    c_x = drafted_counts(q, x, red)                # 0 for ids outside [0, V)
    p_x = weights.fixed_point(e_x[:depth], rows.inv[:depth]).astype(jnp.int64)
    positions = anchor + jnp.arange(depth)
    accept_keys = jax.vmap(
        lambda pos: rng.draw_key(key, pos, rng.Domain.ACCEPT))(positions)
    u = draws.draw_below(rng.draw64(accept_keys), total[:depth] * c_x)
    accept = (c_x > 0) & (u < (p_x * M).astype(jnp.uint64))
    accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32)),
                       dtype=jnp.int32)
  else:  # D = 0: a target-only step, the bonus draw from row 0
    accepted = jnp.zeros((), jnp.int32)

  token = next_token(fixed_row(target_logits, rows, accepted), q, accepted,
                     depth, _row(total, accepted), key, anchor, red)

  chain = chain_status(rows.status, q_rows_status(q, red))
  ok = chain == Status.OK
  return jnp.where(ok, accepted, 0), jnp.where(ok, token, -1), chain


def accepts(bits: jax.Array, c_x: jax.Array, p_x: jax.Array,
            bounds: tuple[jax.Array, jax.Array],
            total: typing.Callable[[], jax.Array]) -> jax.Array:
  """The ACCEPT test u < P_x M, u = draw_below(bits, T c_x), T computed
  only when its bounds cannot decide it.

  u is nondecreasing in T, so with lo <= T <= hi (`weights.total_bounds`)
  u(lo) >= P_x M rejects and u(hi) < P_x M accepts; only bits in between
  (a fraction below (hi - lo) / lo, at most 2^-15 at V = 129280) call
  total() for the exact T. The verdict is always the exact test's
  (docs/numerics.md 6.2). bits: uint64; c_x, p_x: int64 (c_x T < 2^63).
  """
  a = (p_x * M).astype(jnp.uint64)
  lo, hi = (draws.draw_below(bits, t * c_x) for t in bounds)
  return lax.cond((hi < a) | (lo >= a), lambda: hi < a,
                  lambda: draws.draw_below(bits, total() * c_x) < a)


class _Walk(typing.NamedTuple):
  """The state of a `walk_chains` walk after rows 0..i-1."""
  i: jax.Array         # next row
  stopped: jax.Array   # the chain stopped at row i - 1
  accepted: jax.Array  # tokens accepted so far
  token: jax.Array     # the next token once stopped


def walk_chains(target_logits: jax.Array, q: DenseQ | SparseQ,
                draft_tokens: jax.Array, key: jax.Array, anchor: jax.Array,
                red: reducer.Reducer | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`verify_rows` of [N] requests, normalizing only the rows chains reach.

  Every row's max and status, and every q row's status, in one batched
  pass each (for the chain statuses); then each request in turn walks rows
  0, 1, ... while the ACCEPT tests pass: the terms, Z', the test (T only
  when its bounds leave it undecided, `accepts`), and at the row where the
  chain stops T and the residual draw from the terms in hand. Rows past
  the first rejection are never normalized, and every row is read in place
  (`_cell`: one dynamic slice of the batch, never a per-request copy).
  Each quantity is computed by the same functions as in `verify_rows`, so
  the outputs are the same bits (tests/core/test_row_modes.py).
  """
  red = reducer.of(target_logits, red)
  depth = draft_tokens.shape[-1]
  shift, status = weights.target_shift(target_logits, red)       # [N, D+1]
  chain = jax.vmap(lambda st, q: chain_status(st, q_rows_status(q, red)))(
      status, q)
  x = draft_tokens.astype(jnp.int32)

  def walk(r):
    shift_r, status_r = _row(shift, r), _row(status, r)
    key_r, anchor_r, x_r = _row(key, r), _row(anchor, r), _row(x, r)

    def step(s):
      status_i = _row(status_r, s.i)
      e = weights.target_terms(_cell(target_logits, r, s.i),
                               _row(shift_r, s.i), status_i)
      inv, e = weights.target_inv(e, status_i, red)
      total = lambda: weights.target_total(e, inv, red).astype(jnp.int64)
      if depth:
        j = jnp.minimum(s.i, depth - 1)
        x_j = _row(x_r, j)[None]
        q_j = jax.tree.map(lambda a: _cell(jnp.asarray(a), r, j)[None], q)
        c_x = drafted_counts(q_j, x_j, red)[0]
        p_x = weights.fixed_point(red.lookup(e, x_j)[0],
                                  inv).astype(jnp.int64)
        bits = rng.draw64(rng.draw_key(key_r, anchor_r + s.i,
                                       rng.Domain.ACCEPT))
        accept = ((s.i < depth) & (c_x > 0) & accepts(
            bits, c_x, p_x, weights.total_bounds(inv, red.vocab), total))
        c_j = lambda: row_counts(q_j, 0, target_logits.shape[-1], red)
      else:
        accept = jnp.zeros((), bool)
        c_j = lambda: jnp.zeros((), jnp.int64)
      token = lax.cond(accept, lambda: jnp.int32(-1), lambda: draw_next(
          weights.fixed_point(e, inv), c_j(), s.i == depth, total(), key_r,
          anchor_r + s.i, red))
      return _Walk(s.i + 1, ~accept, s.accepted + accept.astype(jnp.int32),
                   token)

    start = _Walk(jnp.int32(0), jnp.zeros((), bool), jnp.int32(0),
                  jnp.int32(-1))
    end = lax.while_loop(lambda s: ~s.stopped, step, start)
    return end.accepted, end.token

  accepted, token = lax.map(walk, jnp.arange(x.shape[0]))
  ok = chain == Status.OK
  return jnp.where(ok, accepted, 0), jnp.where(ok, token, -1), chain


def chains(target_logits: jax.Array, q: DenseQ | SparseQ,
           draft_tokens: jax.Array, key: jax.Array, anchor: jax.Array, *,
           red: reducer.Reducer) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Body of `verify_batch` on [N] requests (local or one shard).

  Loop mode walks each request's chain in turn (`walk_chains`: rows past
  the first rejection are never normalized). Batched mode makes the target
  rows' summaries of all N requests one row op over the N (D+1) rows, then
  runs the rest of each chain per request.
  """
  if rowwise.row_mode() == "loop":
    return walk_chains(target_logits, q, draft_tokens, key, anchor, red)
  ids = jax.vmap(summary_ids)(draft_tokens)                       # [N, D+1]
  summary = rowwise.map_rows(
      lambda x, i: weights.target_summary(x, i, red), target_logits, ids,
      core_ndims=(1, 0))
  return jax.vmap(
      lambda s, tl, q, x, k, a: verify_rows(s, tl, q, x, k, a, red))(
          summary, target_logits, q, draft_tokens, key, anchor)


def _q_args(q):
  if isinstance(q, DenseQ):
    return DenseQ(rowops.Arg(2, 0))        # [D, V] counts, zero at padding
  return SparseQ(rowops.Arg(2), rowops.Arg(2), rowops.Arg(1))  # replicated


@functools.partial(jax.jit, static_argnames="executor")
def _verify(target_logits, q, draft_tokens, key, anchor, executor):
  args = (rowops.Arg(2, -jnp.inf), _q_args(q), rowops.Arg(1), rowops.Arg(0),
          rowops.Arg(0))
  op = rowops.RowOp(chains, args, (False,) * 3, target_logits.shape[-1])
  return executor.run(op, target_logits, q, draft_tokens, key, anchor)


@x64.scoped
def verify_chain(target_logits: jax.typing.ArrayLike,
                 q: DenseQ | SparseQ | None,
                 draft_tokens: jax.typing.ArrayLike, key: jax.Array, *,
                 anchor: jax.typing.ArrayLike = 0,
                 executor: rowops.Executor = rowops.LOCAL
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Standard fixed-depth verification of one request's drafted chain.

  Args:
    target_logits: float[D+1, V]; row i is the target's logits after the
      target processors for the position of draft token i (row D: bonus).
    q: `DenseQ` (counts int32[D, V]) or `SparseQ` (ids/counts int32[D, k],
      n int32[D]): the exact dyadic q each draft token was drawn from.
      With D = 0 it may be None. Any integer dtype, judged on its exact
      values; another dtype is a TypeError.
    draft_tokens: int32[D], x_1..x_D (D >= 0).
    key: one typed JAX key, the round's (`rng.round_key(seed, generation,
      round)`; an int, a raw key or a batch of keys is a TypeError or
      ValueError naming `key`). Decision keys derive from it as position
      -> domain -> counter, positions anchor + i.
    anchor: the absolute position of x_1 in the request's sequence, i.e.
      the number of tokens before it (prompt plus committed tokens: the
      request's length so far); int64, may be traced. It only labels the
      decision keys (x_{i+1}'s ACCEPT test at position anchor + i, the next
      token at anchor + j) and changes no distribution, but both sides
      must use the same one: the draft's PROPOSAL draws are at the same
      positions (`proposal_draws(key, D, anchor)`), which is how a chain
      is reproduced and audited. 0 (the default) for a one-off chain.
    executor: where the rows run (`dyadic_jax.rowops`; `sharding` passes
      its mesh's, which also accepts a dense q in the padded layout).

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
    M, PADDING_NONZERO; sparse: also MISSING_Q (n outside [1, k], or a live
    count of 0), ID_OUT_OF_RANGE, DUPLICATE_ID, UNSORTED_IDS, and
    PADDING_NONZERO for padding other than (id -1, count 0)). A refused
    chain returns (0, -1, status): never commit its token.

  Many requests: `verify_batch` (or `jax.vmap` of this op, which runs the
  same program).
  """
  rng.check_key("verify_chain", "key", key, shape=())
  target_logits = jnp.asarray(target_logits)
  draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
  q = empty_q(q, target_logits, draft_tokens)
  q = check_chain_shapes("verify_chain", target_logits, q, draft_tokens,
                         executor.widths(target_logits.shape[-1]))
  return _verify(target_logits, int32_q(q), draft_tokens, key,
                 jnp.asarray(anchor, jnp.int64), executor)


@x64.scoped
def verify_batch(target_logits: jax.typing.ArrayLike,
                 q: DenseQ | SparseQ | None,
                 draft_tokens: jax.typing.ArrayLike, keys: jax.Array,
                 anchors: jax.typing.ArrayLike = 0, *,
                 executor: rowops.Executor = rowops.LOCAL
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`verify_chain` of B requests of one depth D in one call.

  Args:
    target_logits: float[B, D+1, V], request b's rows as in `verify_chain`.
    q: `DenseQ` (counts int32[B, D, V]) or `SparseQ` (ids/counts int32[B,
      D, k], n int32[B, D]); None when D = 0.
    draft_tokens: int32[B, D].
    keys: typed keys [B], each request's round key (`rng.round_key(seed,
      generation, round)`, stacked; an int or a raw key is a TypeError).
    anchors: int[B] (or a scalar for all): each request's anchor, the
      absolute position of its x_1 (its length so far: prompt plus
      committed tokens), as `verify_chain`'s `anchor`: the positions its
      decision keys are folded with. Pass the anchors its drafts were
      drawn with (`proposal_draws(keys, D, anchors)`); the bridge passes
      each request's `len(tokens)`.
    executor: as in `verify_chain`; a ("requests", "vocab") mesh splits the
      B requests over "requests".

  Returns:
    (num_accepted int32[B], next_token int32[B], status int32[B]), each
    request's exactly as `verify_chain` returns it (tests/core/test_verification
    .py compares them bit for bit).
  """
  rng.check_key("verify_batch", "keys", keys)
  target_logits = jnp.asarray(target_logits)
  draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
  if target_logits.ndim != 3 or draft_tokens.ndim != 2:
    raise ValueError(f"verify_batch: need target_logits [B, D+1, V] and "
                     f"draft_tokens [B, D], got {target_logits.shape} and "
                     f"{draft_tokens.shape}")
  batch = target_logits.shape[:1]
  if q is None and draft_tokens.shape[1:] == (0,):
    q = DenseQ(jnp.zeros(batch + (0, target_logits.shape[-1]), jnp.int32))
  q = check_chain_shapes("verify_batch", target_logits, q, draft_tokens,
                         executor.widths(target_logits.shape[-1]),
                         batch_ndim=1)
  if jnp.shape(keys) != batch:
    raise ValueError(f"verify_batch: keys shape {jnp.shape(keys)} must be "
                     f"{batch}, one key per request")
  anchors = jnp.broadcast_to(jnp.asarray(anchors, jnp.int64), batch)
  return _verify(target_logits, int32_q(q), draft_tokens, keys, anchors,
                 executor)


def empty_q(q: DenseQ | SparseQ | None, target_logits: jax.Array,
            draft_tokens: jax.Array) -> DenseQ | SparseQ | None:
  """q, or an empty DenseQ when q is None and D = 0."""
  if q is None and draft_tokens.shape == (0,):
    return DenseQ(jnp.zeros((0, target_logits.shape[-1]), jnp.int32))
  return q


def check_chain_shapes(name: str, target_logits: jax.Array, q: typing.Any,
                       draft_tokens: jax.Array, dense_widths: tuple[int, ...],
                       batch_ndim: int = 0) -> DenseQ | SparseQ:
  """q, checked: raises ValueError/TypeError unless the shapes form
  D-chains and q's fields are integers.

  batch_ndim leading axes (the same on every argument) precede each
  chain's [D+1, V] target rows, [D] tokens and [D, ...] q rows;
  dense_widths: accepted column counts of a DenseQ (V, or also the padded
  layout of a mesh).
  """
  b = batch_ndim
  t, d = target_logits.shape, draft_tokens.shape
  lead = "B, " if b else ""
  if len(d) != b + 1 or len(t) != b + 2 or t[:b] != d[:b] or (
      t[b] != d[b] + 1):
    raise ValueError(
        f"{name}: need target_logits [{lead}D+1, V] and draft_tokens "
        f"[{lead}D], got {t} and {d}")
  weights.check_vocab(name, t[-1])
  rows = t[:b] + (d[b],)
  if not isinstance(q, (DenseQ, SparseQ)):
    raise TypeError(f"{name}: q must be DenseQ or SparseQ, got {type(q)}")
  for field, a in zip(q._fields, q):
    dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"{name}: {type(q).__name__}.{field} must be integers "
                      f"(any integer dtype), got {dtype}")
  counts_shape = np.shape(q.counts)
  if isinstance(q, DenseQ) and counts_shape[-1:] != () and (
      counts_shape[-1] not in dense_widths):
    raise ValueError(f"{name}: dense q has {counts_shape[-1]} columns,"
                     f" target vocabulary is {t[-1]}")
  if len(counts_shape) != b + 2 or counts_shape[:b + 1] != rows:
    raise ValueError(f"{name}: q rows {counts_shape} do not match "
                     f"[{lead}D] = {rows}")
  if isinstance(q, SparseQ) and (np.shape(q.ids) != counts_shape
                                 or np.shape(q.n) != rows):
    raise ValueError(f"{name}: sparse q needs ids and counts [{lead}D, k] "
                     f"and n [{lead}D], got {np.shape(q.ids)}, "
                     f"{counts_shape}, {np.shape(q.n)}")
  return q
