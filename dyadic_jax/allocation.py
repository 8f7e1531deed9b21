"""Integer ticket allocation: dyadic counts c_v with sum exactly M.

Dense: floor plus largest remainders over the whole vocabulary; sparse: exact
global top-k support, renormalized, then the same allocation on the support.

No sort touches a vocabulary-sized row. The R leftover tickets go to the R
largest remainders (ties to the lowest id): `select_top` searches for a
threshold t on the remainders' int64 bit patterns (a nonnegative float64
orders like its bits) with exactly R keys >= t. Each step is one counting
pass over the row; counts are integers, so the answer is the same for any
reduction order or sharding. A sample of the keys brackets t before the
first pass, and interpolation inside the bracket usually finds it in a few
more (docs/numerics.md section 2).

Weights are judged on their bit patterns: XLA CPU flushes float64
subnormals to zero in compares, so `w < 0` would miss -1e-310. A negative
weight (subnormal or not) is NEGATIVE; a positive subnormal weight counts
as a zero weight on every backend (it is below one ticket by 2^998).
"""

import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax

from dyadic_jax import reducer
from dyadic_jax import rowops
from dyadic_jax import x64
from dyadic_jax.weights import check_rows, exact_sums, reciprocal
from dyadic_jax.constants import M, Status

_FIXED_REMAINDER_BITS = 32
_INF_BITS = 0x7FF0000000000000     # float64 +inf: above every finite key
_ONE_BITS = 0x3FF0000000000000     # float64 1.0
_SMALLEST_NORMAL_BITS = 0x0010000000000000
_SMALLEST_NORMAL = 2.0 ** -1022
_TINY32 = 2.0 ** -126  # smallest normal float32: the key of every tiny w > 0
_SAMPLE_STRIDE = 64    # every 64th key brackets the threshold
_MAX_STEPS = 512       # the search ends long before (see `_probes`)
_SMALL = 64            # keys left in [lo, hi) that are ranked exactly
CANDIDATE_BLOCK = 64   # block of the candidate gather and the two-level top-k


def threshold_search(count_at_least: typing.Callable[[jax.Array], jax.Array], r: jax.Array,
                     lo: int, hi: int, steps: int) -> jax.Array:
  """Largest t in [lo, hi) with count_at_least(t) >= r, by bisection.

  Preconditions: count_at_least is non-increasing, count_at_least(lo) >= r
  and count_at_least(hi) < r; `steps` >= log2(hi - lo). `r` is int64 with
  the batch shape; the result too.
  """
  def body(_, lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    take = count_at_least(mid) >= r
    return jnp.where(take, mid, lo), jnp.where(take, hi, mid)

  start = (jnp.full_like(r, lo, jnp.int64), jnp.full_like(r, hi, jnp.int64))
  return lax.fori_loop(0, steps, body, start)[0]


def _counter(red):
  # int32 lanes vectorize twice as wide as int64; counts are <= V < 2^31.
  return lambda mask: red.sum(mask.astype(jnp.int32)).astype(jnp.int64)


def _global_ids(shape, red, dtype=jnp.int64):
  return lax.broadcasted_iota(dtype, shape, len(shape) - 1) + red.offset


def _as_float(bits):
  return lax.bitcast_convert_type(bits, jnp.float64)


def _as_bits(value):
  return lax.bitcast_convert_type(value, jnp.int64)


def _probe_value(bits):
  """The float64 threshold of a probe given as bits.

  Keys are 0 or normal, so a subnormal threshold t counts like the
  smallest normal one ({x >= t} = {x > 0}); using that value keeps the
  compare exact where XLA flushes subnormal operands to zero.
  """
  bits = jnp.where(bits > 0, jnp.maximum(bits, _SMALLEST_NORMAL_BITS), bits)
  return _as_float(bits)[..., None]


class _Search(typing.NamedTuple):
  lo: jax.Array      # int64[...] bits: count(lo) >= r
  hi: jax.Array      # int64[...] bits: count(hi) < r
  c_lo: jax.Array    # int64[...]
  c_hi: jax.Array    # int64[...]
  bad: jax.Array     # bool[...]: the last step did not halve the interval


def _count2(x, ta, tb, red):
  """(#{x >= ta}, #{x >= tb}) per row: one pass, one variadic reduction
  of two int32 indicators (exact: counts are below 2^31)."""
  ca, cb = exact_sums(x, lambda x: (x >= _probe_value(ta)).astype(jnp.int32),
                      lambda x: (x >= _probe_value(tb)).astype(jnp.int32),
                      red=red)
  return ca.astype(jnp.int64), cb.astype(jnp.int64)


def _sorted_sample(x, red):
  """Every _SAMPLE_STRIDE-th key of each shard, gathered, ascending (bits).

  The sample differs between layouts; it only steers where the search
  probes (how many passes it takes), never the result.
  """
  return jnp.sort(_as_bits(red.gather(x[..., ::_SAMPLE_STRIDE])), axis=-1)


def _sample_probes(s, r, sample):
  """Probes at the sample's quantiles inside (lo, hi), and the sample size m.

  With m sample keys in [lo, hi), the keys at sample rank sigma +- (2 sd +
  1) from the top, where sigma is the rank at which r keys of the row
  would lie at or above (counts interpolated between lo and hi) and sd its
  binomial spread, bracket the threshold with high probability.
  """
  size = sample.shape[-1]
  above = lambda t: jnp.sum(sample >= t[..., None], -1)   # small: [..., S]
  s_lo, s_hi = above(s.lo), above(s.hi)
  m = (s_lo - s_hi).astype(jnp.float64)
  frac = (r - s.c_hi).astype(jnp.float64) / (s.c_lo - s.c_hi)
  sigma = m * frac
  sd = jnp.sqrt(jnp.maximum(sigma * (1.0 - frac), 0.0))
  desc = lambda j: jnp.take_along_axis(
      sample, jnp.clip(size - 1 - j, 0, size - 1)[..., None], -1)[..., 0]
  j_a = s_hi + jnp.ceil(sigma + 2.0 * sd + 1.0).astype(jnp.int64)
  j_b = s_hi + jnp.floor(sigma - 2.0 * sd - 1.0).astype(jnp.int64)
  ta = desc(jnp.clip(j_a, s_hi, s_lo - 1))
  tb = desc(jnp.clip(j_b, s_hi, s_lo - 1))
  return ta, tb, m


def _line_probes(s, r):
  """Probes by linear interpolation of the count between lo and hi.

  At the interval's mean density, the keys where r + h and r - h keys
  would lie at or above, h = min(1.5 sqrt(n), n / 3): a bracket of the
  threshold while n is large, thirds of the interval when it is small.
  """
  n = (s.c_lo - s.c_hi).astype(jnp.float64)
  v_lo, v_hi = _as_float(s.lo), _as_float(s.hi)
  step = (v_hi - v_lo) / n
  center = v_lo + step * (s.c_lo.astype(jnp.float64) - r - 0.5)
  half = step * jnp.maximum(0.5, jnp.minimum(1.5 * jnp.sqrt(n), n / 3.0))
  return (_as_bits(jnp.maximum(center - half, 0.0)),
          _as_bits(jnp.maximum(center + half, 0.0)))


def _probes(s, r, sample, top):
  """Two probe keys strictly inside (lo, hi), ascending; and `top`.

  The sample's quantiles while it has >= 8 keys in the interval, then
  linear interpolation. After a step that did not halve the interval
  (`bad`): `top`, the largest key below hi (at least lo + 1), and the
  bit-space midpoint. If count(top) >= r the threshold is top (nothing
  lies between it and hi) and the search ends; otherwise the midpoint
  halves the bit range, so the search ends within 2 * 64 < _MAX_STEPS
  steps.
  """
  sa, sb, m = _sample_probes(s, r, sample)
  la, lb = _line_probes(s, r)
  top = jnp.maximum(top, s.lo + 1)
  mid = s.lo + (s.hi - s.lo) // 2
  use_sample = m >= 8
  ta = jnp.where(s.bad, jnp.minimum(top, mid),
                 jnp.where(use_sample, sa, la))
  tb = jnp.where(s.bad, jnp.maximum(top, mid),
                 jnp.where(use_sample, sb, lb))
  ta = jnp.clip(ta, s.lo + 1, s.hi - 1)
  tb = jnp.clip(tb, ta, s.hi - 1)
  return ta, tb, top


def _update(s, ta, tb, ca, cb, r):
  """Narrows (lo, hi) with the counts at probes ta <= tb."""
  above_b, above_a = cb >= r, ca >= r
  lo = jnp.where(above_b, tb, jnp.where(above_a, ta, s.lo))
  c_lo = jnp.where(above_b, cb, jnp.where(above_a, ca, s.c_lo))
  hi = jnp.where(above_a, jnp.where(above_b, s.hi, tb), ta)
  c_hi = jnp.where(above_a, jnp.where(above_b, s.c_hi, cb), ca)
  bad = 2 * (c_lo - c_hi) > s.c_lo - s.c_hi
  return _Search(lo, hi, c_lo, c_hi, bad)


def _done(s, r):
  return (s.c_lo == r) | (s.c_lo - s.c_hi <= _SMALL) | (s.hi - s.lo <= 1)


def _search(x, r, upper, red):
  """The final `_Search` (see `select_top`) and the number of passes.

  r >= 1. Starts from lo = 0 (every key counts) and hi = upper (none).
  """
  batch = r.shape
  n_all = x.shape[-1] * red.shards
  zero = jnp.zeros(batch, jnp.int64)
  sample = _sorted_sample(x, red)
  s = _Search(zero, jnp.full(batch, upper, jnp.int64),
              jnp.full(batch, n_all, jnp.int64), zero,
              jnp.zeros(batch, bool))

  def body(carry):
    s, passes = carry
    done = _done(s, r)
    need_top = jnp.any(s.bad & ~done)
    top = lax.cond(
        need_top,
        lambda: _as_bits(red.max(jnp.where(x < _as_float(s.hi)[..., None], x,
                                           0.0))),
        lambda: s.lo)
    ta, tb, top = _probes(s, r, sample, top)
    ca, cb = _count2(x, ta, tb, red)
    new = _update(s, ta, tb, ca, cb, r)
    # Nothing lies in (top, hi): count(top + 1) == count(hi).
    c_top = jnp.where(top == ta, ca, cb)
    ends = s.bad & (c_top >= r) & ((top == ta) | (top == tb))
    new = new._replace(
        lo=jnp.where(ends, top, new.lo), c_lo=jnp.where(ends, c_top, new.c_lo),
        hi=jnp.where(ends, top + 1, new.hi),
        c_hi=jnp.where(ends, s.c_hi, new.c_hi))
    # Rows that are done keep their state (a batch runs to its slowest row).
    s = jax.tree.map(lambda a, b: jnp.where(done, a, b), s, new)
    return s, passes + 1 + need_top.astype(jnp.int32)

  return lax.while_loop(
      lambda c: jnp.any(~_done(c[0], r)) & (c[1] < _MAX_STEPS), body,
      (s, jnp.int32(0)))


def _inside(x, s):
  """x in [lo, hi) (as values; lo and hi are probe bits)."""
  return (x >= _probe_value(s.lo)) & (x < _probe_value(s.hi))


def _tie_cut(x, s, need, red):
  """Mask of the `need` lowest-id keys in [lo, hi), all equal (id bisection)."""
  count = _counter(red)
  tie = _inside(x, s)
  ids = _global_ids(x.shape, red)
  n = red.vocab
  cut = threshold_search(lambda j: count(tie & (ids >= j[..., None])),
                         count(tie) - need + 1, 0, n + 1,
                         max(1, (n + 1).bit_length()))
  cut = jnp.where(need > 0, cut + 1, 0)[..., None]
  return tie & (ids < cut)


def _few_candidates(x, inside, red):
  """(keys, global ids, valid) of the <= _SMALL keys where `inside`.

  One pass counts `inside` per block of CANDIDATE_BLOCK keys; the
  non-empty blocks (at most _SMALL) are found by a top-k over the block
  counts and gathered; a top-k over the gathered positions keeps the
  inside keys in ascending position. Each shard contributes _SMALL slots,
  gathered in shard order: [..., shards * _SMALL], replicated.
  """
  batch, width = x.shape[:-1], x.shape[-1]
  pad = (-width) % CANDIDATE_BLOCK
  widen = lambda a, fill: jnp.pad(a, [(0, 0)] * len(batch) + [(0, pad)],
                                  constant_values=fill)
  blocks = (width + pad) // CANDIDATE_BLOCK
  wide_in = widen(inside, False)
  per_block = jnp.sum(wide_in.reshape(batch + (blocks, CANDIDATE_BLOCK)), -1,
                      dtype=jnp.int32)
  kb = min(_SMALL, blocks)
  _, picked = lax.top_k(per_block.astype(jnp.float32), kb)  # lower first
  pos = (picked[..., None] * CANDIDATE_BLOCK
         + jnp.arange(CANDIDATE_BLOCK, dtype=picked.dtype)
         ).reshape(batch + (-1,))
  slots = pos.shape[-1]
  cand_in = jnp.take_along_axis(wide_in, pos, -1)
  rank = jnp.where(cand_in, slots - jnp.arange(slots), 0).astype(jnp.float32)
  top, j = lax.top_k(rank, min(_SMALL, slots))                # exact: < 2^24
  pos = jnp.take_along_axis(pos, j, -1)
  keys = _as_bits(jnp.take_along_axis(widen(x, 0.0), pos, -1))
  ids = pos.astype(jnp.int64) + red.offset
  return red.gather(keys), red.gather(ids), red.gather(top > 0)


def _rank_few(x, s, need, red):
  """(key bits, id) of the need-th largest of the <= _SMALL keys in [lo, hi).

  Ranked exactly by (key desc, global id asc) on the gathered candidates.
  """
  keys, ids, valid = _few_candidates(x, _inside(x, s), red)
  ki, kj = keys[..., :, None], keys[..., None, :]
  ii, ij = ids[..., :, None], ids[..., None, :]
  beats = valid[..., None, :] & ((kj > ki) | ((kj == ki) & (ij < ii)))
  place = jnp.sum(beats, -1)
  last = jnp.argmax(valid & (place == need[..., None] - 1), -1)[..., None]
  take = lambda a: jnp.take_along_axis(a, last, -1)[..., 0]
  return take(keys), take(ids)


def select_top(x: jax.Array, r: jax.Array, red: reducer.Reducer | None = None,
               upper: int = _INF_BITS) -> jax.Array:
  """Mask of the r largest keys per row, ties to the lowest (global) id.

  x: float64[..., N] keys, each 0 or a positive normal float (callers
  zero subnormals: XLA CPU would flush them in compares), below the value
  whose bits are `upper` (default +inf); r: int[...] in [0, N]. Exactly r
  entries are selected: every key above the r-th largest key, then the
  lowest-indexed keys equal to it.

  The search keeps lo < hi (bit patterns, which order like the values)
  with count(>= lo) >= r > count(>= hi) and stops when count(>= lo) == r
  (the selection is {x >= lo}), or when at most _SMALL keys lie in
  [lo, hi): those are gathered and ranked exactly by (key desc, global id
  asc), which settles ties too. Only when more than _SMALL keys tie
  (hi = lo + 1, e.g. all-equal weights) are the ties cut by an id
  bisection. Every count is an integer: the result is layout-invariant.
  """
  red = reducer.of(x, red)
  r = r.astype(jnp.int64)
  s, _ = _search(x, jnp.maximum(r, 1), upper, red)
  exact = s.c_lo == r
  few = ~exact & (s.c_lo - s.c_hi <= _SMALL)
  tied = ~exact & ~few
  need = r - s.c_hi
  above = x >= _probe_value(jnp.where(exact, s.lo, s.hi))

  def with_few():
    kt, it = _rank_few(x, s, need, red)
    # As values and int32 ids (cheaper lanes than int64): keys are 0 or
    # normal, so the float compare is exact.
    xt = _as_float(kt)[..., None]
    ids = _global_ids(x.shape, red, jnp.int32)
    chosen = _inside(x, s) & (
        (x > xt) | ((x == xt) & (ids <= it.astype(jnp.int32)[..., None])))
    return above | (few[..., None] & chosen)

  mask = lax.cond(jnp.any(few), with_few, lambda: above)
  mask = lax.cond(
      jnp.any(tied),
      lambda: mask | (tied[..., None] & _tie_cut(x, s, need, red)),
      lambda: mask)
  return mask & (r > 0)[..., None]


# Per-weight codes; a row's status is decided by the largest code present.
_CODE_ZERO, _CODE_POSITIVE, _CODE_NEGATIVE, _CODE_INF, _CODE_NAN = range(5)
_CODE_STATUS = (Status.ZERO_MASS, Status.OK, Status.NEGATIVE, Status.INF,
                Status.NAN)


def weight_codes(w: jax.Array) -> jax.Array:
  """int32 code per weight, FTZ-proof: NaN 4, inf 3, negative 2, positive
  normal 1, else (zero, -0.0, positive subnormal) 0.

  NaN, inf and "at least the smallest normal" are float compares that no
  flush-to-zero can change; the sign needs the bits (a negative subnormal
  compares equal to 0 where XLA flushes it): sign bit set, not -0.0.
  """
  bits = lax.bitcast_convert_type(w, jnp.int64)
  negative = (bits < 0) & (bits != jnp.iinfo(jnp.int64).min)
  return jnp.where(
      w != w, _CODE_NAN, jnp.where(
          jnp.abs(w) == jnp.inf, _CODE_INF, jnp.where(
              negative, _CODE_NEGATIVE, jnp.where(
                  w >= _SMALLEST_NORMAL, _CODE_POSITIVE,
                  _CODE_ZERO)))).astype(jnp.int32)


def weight_status(w: jax.Array, red: reducer.Reducer | None = None) -> jax.Array:
  """Status of raw weight rows: NAN, INF, NEGATIVE, ZERO_MASS in that order.

  One max-reduction of `weight_codes` (the codes are ordered by priority;
  a row with no code above 0 has no positive normal weight: ZERO_MASS).
  """
  top = reducer.of(w, red).max(weight_codes(w))
  return jnp.asarray(_CODE_STATUS, jnp.int32)[top]


def clean_weights(w: jax.Array, red: reducer.Reducer | None = None) -> tuple[jax.Array, jax.Array]:
  """(w with refused rows and positive subnormals zeroed, status).

  After this every weight is 0 or a positive normal float64, so float
  compares on it (and on its remainders) are exact on every backend.
  """
  return _known_clean(w, weight_status(w, red))


def _known_clean(w, status):
  """`clean_weights` for rows whose status is already known (a softmax's:
  an OK row is finite, nonnegative and has a positive normal weight, so
  the status pass would find OK): zeros refused rows and subnormals."""
  keep = (status == Status.OK)[..., None] & (w >= _SMALLEST_NORMAL)
  return jnp.where(keep, w, 0.0), status


def _scaled_parts(w, total):
  """(f, r): floor and exact fractional part of w * total, w clamped to 4.

  A weight above 2 can never be part of a consistent row (its floor alone
  exceeds the total, so R < 0); clamping keeps every conversion in range.
  """
  s = jnp.minimum(w, 4.0) * jnp.float64(total)  # exact: a power of two
  f = jnp.floor(s)
  return f, s - f


def largest_remainder(w: jax.Array, total: int, red: reducer.Reducer | None = None,
                      status: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """Floor + largest remainders of w * total (see `allocate_dense`).

  `status`: the rows' status when the caller knows it (softmax rows; see
  `_known_clean`); None judges the weights.
  """
  red = reducer.of(w, red)
  w, status = (clean_weights(w, red) if status is None
               else _known_clean(w, status))
  # Integer-valued float64 terms whose partial sums stay below 2^53: exact
  # in any order (a float64 -> int64 conversion per entry does not
  # vectorize on CPU, so the terms stay float64).
  f_sum, r_fixed = exact_sums(
      w, lambda w: _scaled_parts(w, total)[0],
      lambda w: jnp.floor(_scaled_parts(w, total)[1]
                          * 2.0 ** _FIXED_REMAINDER_BITS), red=red)
  leftover = total - f_sum.astype(jnp.int64)
  # One ticket of slack, measured with integers so every layout agrees. It
  # implies leftover <= #{r > 0}, since every remainder is below 1.
  slack = jnp.abs((leftover << _FIXED_REMAINDER_BITS)
                  - r_fixed.astype(jnp.int64))
  consistent = (leftover >= 0) & (slack < (1 << _FIXED_REMAINDER_BITS))
  status = jnp.where((status == Status.OK) & ~consistent,
                     Status.INCONSISTENT_MASS, status).astype(jnp.int32)
  ok = status == Status.OK
  f, r = _scaled_parts(w, total)
  # r is 0 or normal (w is, and w M - floor(w M) is exact), and below 1.
  r = lax.optimization_barrier(r)
  tickets = select_top(r, jnp.where(ok, leftover, 0), red, upper=_ONE_BITS)
  counts = f.astype(jnp.int32) + tickets
  return jnp.where(ok[..., None], counts, 0), status


@functools.partial(jax.jit, static_argnames="executor")
def _allocate_dense(w, executor):
  return executor.run(
      rowops.declare(lambda w, red: largest_remainder(w, M, red),
                     (rowops.Arg(1, 0.0),), (True, False), w.shape[-1]), w)


@x64.scoped
def allocate_dense(weights: jax.typing.ArrayLike, *,
                   executor: rowops.Executor = rowops.LOCAL
                   ) -> tuple[jax.Array, jax.Array]:
  """Dense dyadic allocation: int32 counts with an exact sum of M per row.

  c_v = floor(w_v M) + [v holds one of the R largest remainders], where
  R = M - sum_v floor(w_v M) and ties between equal remainders go to the
  lowest id. Consequences: |c_v - w_v M| < 1, a zero weight never gets a
  ticket, and sum_v c_v == M exactly.

  Args:
    weights: float[..., V] (float64 expected; float32 is widened exactly),
      normalized to 1.

  Returns:
    (counts int32[..., V], status int32[...]). Refused rows (all counts zero):
    Status.NAN, INF, NEGATIVE (any weight with the sign bit and a nonzero
    magnitude, subnormals included), ZERO_MASS (no positive normal weight;
    positive subnormal weights count as zero), and INCONSISTENT_MASS when
    the weights do not sum to 1 within one ticket: precisely when R < 0,
    when R exceeds the number of nonzero remainders, or when
    |R * 2^32 - sum_v floor(r_v 2^32)| >= 2^32. Never clipped or renormalized.
  """
  w = jnp.asarray(weights)
  check_rows("allocate_dense", w)
  return _allocate_dense(w.astype(jnp.float64), executor)


def _round_down_f32(w, ok):
  """Monotone float32 key of the weights: round toward zero, positive
  normal weights >= 2^-126; 0 for zero or subnormal weights and on rows
  that are not ok."""
  y = w.astype(jnp.float32)
  # Rounded up means y > w >= 0: one step toward zero is its bits minus 1
  # (cheaper than nextafter; other entries are masked below).
  down = lax.bitcast_convert_type(lax.bitcast_convert_type(y, jnp.int32) - 1,
                                  jnp.float32)
  y = jnp.where(y.astype(jnp.float64) > w, down, y)
  return jnp.where(ok[..., None] & (w >= _SMALLEST_NORMAL),
                   jnp.maximum(y, jnp.float32(_TINY32)), jnp.float32(0))


def _top_k(raw: jax.Array, key: typing.Callable, k: int,
           block_max: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """(`lax.top_k(key(raw), k)`'s values and indices, unique).

  key: elementwise, monotone nondecreasing, keys >= 0 (`_round_down_f32`
  of the weights). When the row is long against k, two levels: the key of
  each block's max (= the max of its keys, key being monotone) over blocks
  of CANDIDATE_BLOCK entries, the top k blocks by (max desc, block asc),
  then `lax.top_k` over those blocks' keys in ascending id order. Every one of
  the row's top k (key desc, id asc) lies in those blocks: if one lay in a
  block B left out, each of the k chosen blocks would hold a key that
  beats it (a larger key, or an equal key in a block of lower ids). About
  a quarter of XLA CPU's full TopK time at V = 129280, k = 32.
  block_max: the blocks' maxima of raw [..., ceil(n / CANDIDATE_BLOCK)]
  when an earlier pass took them (`weights.softmax64_block_parts`);
  otherwise one pass here.

  unique: #{keys >= the k-th key} == k, from the blocks alone (keys that
  large lie only in blocks whose max is that large; when at most k blocks
  are, they were all chosen); None on the one-level path.
  """
  n = raw.shape[-1]
  if 4 * k * CANDIDATE_BLOCK > n:
    vals, idx = lax.top_k(key(raw), k)
    return vals, idx, None
  batch = raw.shape[:-1]
  pad = (-n) % CANDIDATE_BLOCK
  blocks = jnp.pad(raw, [(0, 0)] * len(batch) + [(0, pad)]).reshape(
      batch + (-1, CANDIDATE_BLOCK))
  if block_max is None:
    block_max = jnp.max(blocks, -1)
  block_keys = key(block_max)
  _, chosen = lax.top_k(block_keys, k)
  chosen = jnp.sort(chosen, -1)
  ids = (chosen[..., None] * CANDIDATE_BLOCK
         + jnp.arange(CANDIDATE_BLOCK)).reshape(batch + (k * CANDIDATE_BLOCK,))
  # Padding keys are -1: below every key, never chosen or counted.
  cand = jnp.where(ids < n, key(jnp.take_along_axis(
      blocks, chosen[..., None], axis=-2).reshape(ids.shape)), -1.0)
  vals, pos = lax.top_k(cand, k)
  kth = jnp.min(vals, -1, keepdims=True)
  unique = ((jnp.sum(block_keys >= kth, -1) <= k)
            & (jnp.sum(cand >= kth, -1) == k))
  return vals, jnp.take_along_axis(ids, pos, -1), unique


def _scaled(w, scale):
  return w if scale is None else w * scale[..., None]


def top_k_ids(w: jax.Array, k: int, red: reducer.Reducer | None = None,
              ok: jax.Array | None = None,
              scale: jax.Array | None = None,
              block_max: jax.Array | None = None) -> jax.Array:
  """Ascending global ids of the exact top-k of w by (weight desc, id asc).

  Weights below the smallest normal float64 count as zero; rows where
  `ok` is False (default: all ok) are not searched (their ids are
  arbitrary). Fast path: `lax.top_k` on monotone float32 keys (per shard,
  then merged over the gathered k candidates of every shard), exact
  whenever the k-th key is not tied with an unselected one (or is zero:
  zero weights are dropped later anyway). Otherwise the exact selection
  decides.

  scale: optional float64[...]: the weights are fl(w * scale) per row
  (a softmax's e and fl(1 / Z)), formed where each step reads them, so
  the row of products is never stored. block_max: optional maxima of w
  over its blocks of CANDIDATE_BLOCK local entries, as `_top_k` takes them.
  """
  red = reducer.of(w, red)
  n = w.shape[-1]
  local_k = min(k, n)
  if ok is None:
    ok = jnp.ones(w.shape[:-1], bool)
  vals, idx, unique = _top_k(
      w, lambda v: _round_down_f32(_scaled(v, scale), ok), local_k,
      block_max)
  ids = idx.astype(jnp.int32) + red.offset
  if red.collective:
    unique = None     # the shard's own k-th key is not the global one
    # Candidates of every shard in shard (= id) order; top_k keeps the
    # lower position first among equal keys, so ties go to the lower id.
    cand_vals, cand_ids = red.gather(vals), red.gather(ids)
    vals, pos = lax.top_k(cand_vals, k)
    ids = jnp.take_along_axis(cand_ids, pos, -1)
  # min, not vals[..., -1]: XLA CPU keeps its fast TopK kernel only for a
  # sort whose users slice [0, k); a folded [k-1, k) slice makes it a full
  # sort. For the same reason #{key32 >= kth} is counted on w itself.
  kth = jnp.min(vals, -1, keepdims=True).astype(jnp.float64)
  if unique is None:
    # #{w >= kth} == #{key32 >= kth}: keys round down, and every positive
    # normal weight has a key >= 2^-126.
    ws = _scaled(w, scale)
    at_least = jnp.where(kth > _TINY32, ws >= kth, ws >= _SMALLEST_NORMAL)
    unique = _counter(red)(at_least) == k
  exact = unique | (kth[..., 0] == 0) | ~ok
  fast = jnp.sort(ids, axis=-1)

  def slow(_):
    ws = _scaled(w, scale)
    clean = jnp.where(ok[..., None] & (ws >= _SMALLEST_NORMAL), ws, 0.0)
    mask = select_top(clean, jnp.full(w.shape[:-1], k, jnp.int64), red=red)
    local = lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)
    rank = jnp.where(mask, n - local, -1)
    top, _ = lax.top_k(rank.astype(jnp.float32), local_k)  # exact: n < 2^24
    big = jnp.iinfo(jnp.int32).max
    chosen = jnp.where(top > 0, n - top.astype(jnp.int32) + red.offset, big)
    # Exactly k entries are selected over all shards: the k smallest ids.
    chosen = jnp.sort(red.gather(chosen), axis=-1)[..., :k]
    return jnp.where(exact[..., None], fast, chosen)

  return lax.cond(jnp.all(exact), lambda _: fast, slow, None)


def ordered_sum(x: jax.Array) -> jax.Array:
  """Sum over the last (small) axis in index order: a fixed rounding sequence."""
  def body(i, acc):
    return acc + lax.dynamic_index_in_dim(x, i, x.ndim - 1, keepdims=False)

  return lax.fori_loop(0, x.shape[-1], body, jnp.zeros(x.shape[:-1], x.dtype))


def sparse_from_support(ids: jax.Array, ws: jax.Array, row_status: jax.Array
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Renormalize support weights, allocate M, drop zero counts, pad with -1."""
  k = ids.shape[-1]
  total = ordered_sum(ws)
  ok = row_status == Status.OK
  wn = ws * reciprocal(jnp.where(ok, total, 1.0))[..., None]
  counts, status = largest_remainder(jnp.where(ok[..., None], wn, 0.0), M)
  status = jnp.where(ok, status, row_status).astype(jnp.int32)
  pos = lax.broadcasted_iota(jnp.int32, counts.shape, counts.ndim - 1)
  order = jnp.argsort(jnp.where(counts > 0, pos, k + pos), axis=-1)
  ids = jnp.take_along_axis(ids, order, -1)
  counts = jnp.take_along_axis(counts, order, -1)
  n = jnp.sum(counts > 0, -1, dtype=jnp.int32)
  keep = (pos < n[..., None]) & (status == Status.OK)[..., None]
  return (jnp.where(keep, ids, -1).astype(jnp.int32),
          jnp.where(keep, counts, 0).astype(jnp.int32),
          jnp.where(status == Status.OK, n, 0), status)


@functools.partial(jax.jit, static_argnames=("k", "executor"))
def _allocate_sparse(w, k, executor):
  return executor.run(
      rowops.declare(lambda w, red: allocate_sparse_rows(w, k, red),
                     (rowops.Arg(1, 0.0),), (False,) * 4, w.shape[-1]), w)


def allocate_sparse_rows(w: jax.Array, k: int, red: reducer.Reducer | None = None,
                         status: jax.Array | None = None,
                         scale: jax.Array | None = None,
                         block_max: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The body of `allocate_sparse` on weight rows (local or one shard);
  `status` as in `largest_remainder`, `scale` and `block_max` as in
  `top_k_ids`."""
  red = reducer.of(w, red)
  if status is None:
    status = weight_status(_scaled(w, scale), red)
  ok = status == Status.OK
  ids = top_k_ids(w, k, red, ok, scale=scale, block_max=block_max)
  ws = red.lookup(w, ids)
  if scale is not None:
    ws = ws * scale[..., None]     # fl(w_id * s): the bits of the product row
  ws = jnp.where(ok[..., None] & (ws >= _SMALLEST_NORMAL), ws, 0.0)
  return sparse_from_support(ids, ws, status)


@x64.scoped
def allocate_sparse(weights: jax.typing.ArrayLike, k: int, *,
                    executor: rowops.Executor = rowops.LOCAL
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Sparse dyadic allocation on the exact global top-k support.

  The support is the k largest weights, ties to the lowest id. Its weights
  are renormalized in float64 (w_i * fl(1 / W), W summed in ascending-id
  order), then
  allocated exactly as `allocate_dense` does on those k values; entries left
  with zero tickets are dropped.

  Args:
    weights: float[..., V] nonnegative weights (any positive scale).
    k: static int in [1, V].

  Returns:
    (ids int32[..., k], counts int32[..., k], n int32[...], status int32[...]):
    the first n entries hold strictly ascending ids with positive counts
    summing to M; the rest are padding (id -1, count 0). Refused rows have
    n = 0 and status NAN, INF, NEGATIVE or ZERO_MASS (judged on bit
    patterns as in `allocate_dense`; positive subnormals count as zero).
  """
  w = jnp.asarray(weights)
  check_rows("allocate_sparse", w)
  w = w.astype(jnp.float64)
  k = int(k)
  if not 1 <= k <= w.shape[-1]:
    raise ValueError(f"allocate_sparse: k={k} not in [1, {w.shape[-1]}]")
  return _allocate_sparse(w, k, executor)


