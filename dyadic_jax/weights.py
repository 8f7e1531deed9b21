"""Globally normalized softmax rows: FP64 draft weights, fixed-point targets.

Draft weights (float64, the contract's FP64 softmax):

    w_v = e_v * fl(1 / Z),   e_v = exp(fl(fl(y_v - max_u y_u) * fl(1 / T))),
    y = logits + bias

(the temperature scales after the max shift, so no fused multiply-add can
change a term: docs/numerics.md section 1).

`Z` is the exact sum of the float64 terms e_v, up to 2^-64 per term, rounded
once: each e_v in [0, 1] is split into two 32-bit fixed-point limbs, held as
float64 integers. Every partial sum of a limb is an integer below 2^53
(V <= MAX_VOCAB), so float64 adds them exactly whatever the order or
sharding, and Z is the same bits on every layout.

Target rows (what verification and the target-only sampler use):

    e_v = exp32(x_v - max_u x_u)      float32, relative error <= 2^-22
    Z'  = 2^-32 sum_v floor(e_v 2^32)  exact, in [1, V]
    p_v = fl(e_v * fl(1 / Z')),  P_v = round(p_v 2^38),  T = sum_v P_v

`dyadic_jax.fastexp` computes e with a float64-accurate argument, so P / T
is within total variation 2^-22 + V 2^-39 of the exact softmax of the given
logits (docs/numerics.md sections 1 and 6).
"""

import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax

from dyadic_jax import fastexp
from dyadic_jax import reducer
from dyadic_jax import rowops
from dyadic_jax import rowwise
from dyadic_jax import x64
from dyadic_jax.constants import (MAX_VOCAB, NORMALIZER_BITS, TARGET_BITS,
                                  Status)

_F64_SMALLEST_NORMAL_BITS = 0x0010000000000000
_F64_INF_BITS = 0x7FF0000000000000


def check_vocab(name: str, v: int) -> None:
  if not 1 <= v <= MAX_VOCAB:
    raise ValueError(f"{name}: vocabulary size {v} not in [1, {MAX_VOCAB}]")


def check_rows(name: str, x: jax.Array) -> None:
  """ValueError naming the op unless x is [..., V] with 1 <= V <= MAX_VOCAB."""
  if x.ndim < 1:
    raise ValueError(f"{name}: expected rows [..., V], got a 0-d array")
  check_vocab(name, x.shape[-1])


def fixed_point_limbs(e: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits float64 e in [0, 1] into limbs (hi, lo): e ~ hi 2^-32 + lo 2^-64.

  Both limbs are exact floors, integers below 2^32 + 1 held in float64 (a
  float64 -> int64 conversion does not vectorize on CPU), so summing a limb
  over at most MAX_VOCAB entries is exact.
  """
  scale = jnp.float64(2.0 ** NORMALIZER_BITS)
  s = e * scale
  hi = jnp.floor(s)
  lo = jnp.floor((s - hi) * scale)
  return hi, lo


def reciprocal(z: jax.Array) -> jax.Array:
  """fl(1 / z), correctly rounded, the same bits wherever z sits.

  XLA CPU's vectorized float64 division is not correctly rounded, and
  whether an element takes the vector or the scalar path depends on its
  position (batch size, shard width): e / Z differs in the last bit
  between layouts. A scalar division per element, in a loop over the (few,
  one per row) values, is IEEE; every quotient of the library is therefore
  written as a product with this reciprocal. Other backends divide
  correctly rounded already.
  """
  if jax.default_backend() != "cpu" or z.ndim == 0:
    return 1.0 / z
  return lax.map(lambda s: 1.0 / s, z.reshape(-1)).reshape(z.shape)


def normalizer_from_limb_sums(hi_sum: jax.Array, lo_sum: jax.Array) -> jax.Array:
  """Float64 Z from the exact limb sums (a pure function of two integers)."""
  return (hi_sum + lo_sum * 2.0 ** -NORMALIZER_BITS) * 2.0 ** -NORMALIZER_BITS


def max_and_status(x: jax.Array, red: reducer.Reducer | None = None) -> tuple[jax.Array, jax.Array]:
  """(row max, status) of score rows x[..., V]: one pass.

  A NaN anywhere is Status.NAN (even beside +inf), else a +inf max is
  Status.INF, a -inf max (every score -inf) Status.ZERO_MASS. The NaN test
  is its own integer flag, reduced beside the max in one pass
  (`reducer.one_pass`): XLA CPU's vectorized max reductions do not
  propagate NaN (at V = 4096 a NaN row's max came back finite, or -inf),
  so the max alone cannot be trusted to carry it.
  """
  red = reducer.of(x, red)
  row_max, nan = reducer.one_pass(red, (reducer.MAX, x),
                                  (reducer.MAX, (x != x).astype(jnp.int32)))
  nan = nan > 0
  status = jnp.select(
      [nan, row_max == jnp.inf, row_max == -jnp.inf],
      [Status.NAN, Status.INF, Status.ZERO_MASS], Status.OK).astype(jnp.int32)
  return row_max, status


def shifted_exp_and_status(x: jax.Array, red: reducer.Reducer | None = None,
                           scale: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """Per-row max shift and status for float64 scores x[..., V].

  Returns (e float64[..., V], status int32[...]); rows that are not OK get
  e = 0 (statuses of `max_and_status`). e = exp(fl(x - max)), or with a
  per-row `scale` s[...] (a temperature's fl(1 / T), positive and finite)
  e = exp(fl(fl(x - max) * s)): the shift comes before the product, so no
  addition consumes a product and a fused multiply-add has nothing to
  contract (docs/numerics.md section 1). The status is then that of the
  scaled scores fl(x * s), judged on their max fl(max * s) (rounding is
  monotone): INF where it overflows to +inf, ZERO_MASS to -inf.
  """
  row_max, status = max_and_status(x, red)
  if scale is not None:
    scaled = row_max * scale
    status = jnp.where(status != Status.OK, status, jnp.select(
        [scaled == jnp.inf, scaled == -jnp.inf],
        [Status.INF, Status.ZERO_MASS], Status.OK)).astype(jnp.int32)
  ok = (status == Status.OK)[..., None]
  d = x - jnp.where(ok, row_max[..., None], 0.0)
  if scale is not None:
    d = d * scale[..., None]
  e = jnp.exp(d)
  return jnp.where(ok, e, 0.0), status


def exact_sums(x: jax.Array, *terms: typing.Callable[[jax.Array], jax.Array],
               red: reducer.Reducer | None = None) -> list[jax.Array]:
  """Row sums over the last axis of terms(x), all in one pass
  (`reducer.one_pass`).

  Each term is a function of x whose entries are integers (int32, or
  float64 with every partial sum below 2^53), so each sum is exact in any
  order.
  """
  red = reducer.of(x, red)
  return reducer.one_pass(red, *((reducer.SUM, term(x)) for term in terms))


def softmax64_parts(x: jax.Array, red: reducer.Reducer | None = None,
                    scale: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(e, fl(1 / Z), status) of score rows: the weights are where(OK,
  fl(e * fl(1 / Z)), 0), for a caller that needs them only in places.
  `scale`: as `shifted_exp_and_status`."""
  e, status = shifted_exp_and_status(x.astype(jnp.float64), red, scale)
  hi_sum, lo_sum = exact_sums(e, lambda e: fixed_point_limbs(e)[0],
                              lambda e: fixed_point_limbs(e)[1], red=red)
  return e, _inv_of_sums(hi_sum, lo_sum, status), status


def _inv_of_sums(hi_sum, lo_sum, status):
  z = normalizer_from_limb_sums(hi_sum, lo_sum)
  return reciprocal(jnp.where(status == Status.OK, z, 1.0))


def softmax64_block_parts(x: jax.Array, block: int,
                          red: reducer.Reducer | None = None,
                          scale: jax.Array | None = None
                          ) -> tuple[jax.Array, ...]:
  """`softmax64_parts` plus the max of e over each block of `block` local
  entries ([..., ceil(n / block)], the last block zero-padded).

  One pass over e for both: a variadic reduction per block of the two
  limbs and the max, then the block sums summed (exact integers, so Z is
  the same bits as `softmax64_parts`'). A top-k that would take the
  block maxima of the stored row in a pass of its own
  (`allocation.top_k_ids`) gets them here.
  """
  red = reducer.of(x, red)
  e, status = shifted_exp_and_status(x.astype(jnp.float64), red, scale)
  n = e.shape[-1]
  pad = (-n) % block
  blocks = jnp.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, pad)]).reshape(
      e.shape[:-1] + ((n + pad) // block, block))
  hi, lo = fixed_point_limbs(blocks)
  zero = jnp.zeros((), e.dtype)
  hi_blocks, lo_blocks, block_max = lax.reduce(
      (hi, lo, blocks), (zero, zero, zero),
      lambda a, b: (a[0] + b[0], a[1] + b[1], jnp.maximum(a[2], b[2])),
      (blocks.ndim - 1,))
  return (e, _inv_of_sums(red.sum(hi_blocks), red.sum(lo_blocks), status),
          status, block_max)


def softmax64_rows(x: jax.Array, red: reducer.Reducer | None = None,
                   scale: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
  """(w float64, status) of score rows x[..., V]: the body of every softmax
  (`scale`: as `shifted_exp_and_status`)."""
  e, inv, status = softmax64_parts(x, red, scale)
  w = jnp.where((status == Status.OK)[..., None], e * inv[..., None], 0.0)
  return w, status


softmax64 = rowwise.row_op(softmax64_rows, (1,))
softmax64.__doc__ = "(w, status) of float[..., V] scores; row by row on CPU."


def _draft_scores(logits, bias):
  """y = fl(logits + bias) in float64 (the temperature scales after the
  max shift: `shifted_exp_and_status`)."""
  y = logits.astype(jnp.float64)
  if bias is not None:
    y = y + bias.astype(jnp.float64)
  return y


def draft_rows(logits: jax.Array, t: jax.Array, bias: jax.Array | None = None,
               red: reducer.Reducer | None = None) -> tuple[jax.Array, jax.Array]:
  """(w, status) of draft logits rows at per-row temperatures t (> 0)."""
  return softmax64_rows(_draft_scores(logits, bias), red, reciprocal(t))


def draft_parts(logits: jax.Array, t: jax.Array, bias: jax.Array | None = None,
                red: reducer.Reducer | None = None, block: int | None = None
                ) -> tuple:
  """`draft_rows` as `softmax64_parts`: (e, fl(1 / Z), status), and with
  `block` as `softmax64_block_parts` (the block maxima of e last).

  e_v = exp(fl(fl(y_v - max y) * fl(1 / t))), y = fl(logits + bias).
  """
  y, scale = _draft_scores(logits, bias), reciprocal(t)
  if block is None:
    return softmax64_parts(y, red, scale)
  return softmax64_block_parts(y, block, red, scale)


def temperature_status(temperature: jax.Array, batch: tuple[int, ...]
                       ) -> tuple[jax.Array, jax.Array]:
  """(t, t_ok): per-row float64 temperatures, 1.0 where t is refused.

  A temperature must be a positive normal float64, judged on its bits: a
  subnormal (its reciprocal overflows; XLA CPU would also flush it to zero
  in a compare), zero, a negative, inf or NaN is refused.
  """
  t = jnp.broadcast_to(temperature, batch).astype(jnp.float64)
  bits = lax.bitcast_convert_type(t, jnp.int64)
  t_ok = (bits >= _F64_SMALLEST_NORMAL_BITS) & (bits < _F64_INF_BITS)
  return jnp.where(t_ok, t, 1.0), t_ok


def apply_temperature_status(w: jax.Array, status: jax.Array, t_ok: jax.Array
                             ) -> tuple[jax.Array, jax.Array]:
  """Refuses rows with a bad temperature: BAD_TEMPERATURE and zero weights."""
  status = jnp.where(t_ok, status, Status.BAD_TEMPERATURE).astype(jnp.int32)
  return jnp.where(t_ok[..., None], w, 0.0), status


@functools.partial(jax.jit, static_argnames="executor")
def _draft_weights(logits, temperature, bias, executor):
  t, t_ok = temperature_status(temperature, logits.shape[:-1])
  args = (logits, t) + (() if bias is None else (bias,))
  specs = (rowops.Arg(1, -jnp.inf), rowops.Arg(0)) + (
      () if bias is None else (rowops.Arg(1, 0.0),))
  w, status = executor.run(
      rowops.declare(draft_rows, specs, (True, False), logits.shape[-1]), *args)
  return apply_temperature_status(w, status, t_ok)


@x64.scoped
def draft_weights(logits: jax.typing.ArrayLike, *,
                  temperature: jax.typing.ArrayLike = 1.0,
                  bias: jax.typing.ArrayLike | None = None,
                  executor: rowops.Executor = rowops.LOCAL
                  ) -> tuple[jax.Array, jax.Array]:
  """Draft weights softmax((logits + bias) / temperature) in float64.

  Args:
    logits: float[..., V]; -inf entries are allowed (weight exactly 0).
    temperature: positive normal float64 scalar, or float[...] one per row.
    bias: optional float[..., V] (e.g. the Markov head's bias), added before
      the temperature.
    executor: where the rows run (`dyadic_jax.rowops`; the `sharding` ops
      pass their mesh's).

  Returns:
    (weights float64[..., V], status int32[...]). Rows with a NaN get
    Status.NAN, a +inf score Status.INF (also a score that overflows once
    scaled by 1 / temperature), all -inf Status.ZERO_MASS, a
    temperature that is not a positive normal float (zero, negative,
    subnormal, inf, NaN) Status.BAD_TEMPERATURE; such rows have all-zero
    weights. Normalization is global over the whole row with the exact
    normalizer of the module docstring, so the result does not depend on
    vocab sharding.
  """
  logits = jnp.asarray(logits)
  check_rows("draft_weights", logits)
  if bias is not None:
    bias = jnp.broadcast_to(jnp.asarray(bias), logits.shape)
  return _draft_weights(logits, jnp.asarray(temperature, jnp.float64), bias,
                        executor)


# ----------------------------------------------------------------------------
# Target rows: float32 exp, fixed point on the 2^-38 grid.


class TargetRows(typing.NamedTuple):
  """The target fixed point of score rows (see the module docstring)."""
  shift: jax.Array    # float32 or float64[...]: the row max (0 if refused)
  inv: jax.Array      # float64[...]: fl(1 / Z'), 1 on refused rows
  total: jax.Array    # float64[...]: T = sum_v P_v (an exact integer)
  status: jax.Array   # int32[...]


def fixed_point(e: jax.Array, inv: jax.Array) -> jax.Array:
  """P = round(fl(e * inv) 2^38) as float64 integers in [0, 2^38].

  One rounding per product (no add follows it, so no fused multiply-add
  can change it): the same bits whether e is a row or a gathered entry.
  """
  return jnp.round(probs_of(e, inv) * jnp.float64(2.0 ** TARGET_BITS))


def probs_of(e: jax.Array, inv: jax.Array) -> jax.Array:
  """p = fl(e * inv) (float64) of float32 terms e; inv broadcasts against e."""
  return e.astype(jnp.float64) * inv


def _scores(x):
  """float32 scores (float64 and integer logits stay float64)."""
  if x.dtype == jnp.float64 or jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(jnp.float64)
  return x.astype(jnp.float32)


def target_terms(x: jax.Array, shift: jax.Array, status: jax.Array) -> jax.Array:
  """e = exp(x - shift) (float32 [..., n]), 0 on refused rows.

  The one definition of the terms: `target_rows` and every later
  recomputation of a row (verification's residual row) call it, so they
  get the same bits.
  """
  x = _scores(x)
  e = fastexp.exp_shifted(x, shift.astype(x.dtype)[..., None])
  return jnp.where((status == Status.OK)[..., None], e, jnp.float32(0))


def target_shift(x: jax.Array, red: reducer.Reducer | None = None
                 ) -> tuple[jax.Array, jax.Array]:
  """(shift, status) of score rows x[..., V]: the row max (0 if refused).

  The first pass of `target_rows`; the terms are then
  `target_terms(x, shift, status)`.
  """
  row_max, status = max_and_status(_scores(x), red)
  return jnp.where(status == Status.OK, row_max, 0), status


def target_inv(e: jax.Array, status: jax.Array,
               red: reducer.Reducer | None = None
               ) -> tuple[jax.Array, jax.Array]:
  """(inv, e) of the terms e[..., n] (`target_terms`): inv = fl(1 / Z').

  One pass: Z', an exact float64 sum of integers below 2^32 + 1 (1 on
  refused rows). e comes back through the barrier that keeps it stored for
  the passes that follow (T, a residual row) instead of recomputed.
  """
  red = reducer.of(e, red)
  z = red.sum(jnp.floor(e * jnp.float32(2.0 ** 32)).astype(jnp.float64))
  # A barrier's outputs vary over the mesh axis when any input does: only
  # the (already varying) e passes through, the replicated z stays out.
  e, _ = lax.optimization_barrier((e, z))
  return reciprocal(jnp.where(status == Status.OK, z * 2.0 ** -32, 1.0)), e


def target_total(e: jax.Array, inv: jax.Array,
                 red: reducer.Reducer | None = None) -> jax.Array:
  """T = sum_v P_v (float64[...], an exact sum of integers below 2^38 + 1)."""
  return reducer.of(e, red).sum(fixed_point(e, inv[..., None]))


def total_bounds(inv: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
  """(lo, hi) int64 with lo <= T <= hi, from inv = fl(1 / Z') alone.

  T = 2^38 sum e / Z' up to V / 2 + 2^-13 (docs/numerics.md 6.1, Ranges),
  and 1 <= sum e / Z' < 1 + V 2^-32 / Z', so
  2^38 - V/2 - 2^-13 < T < 2^38 + 64 V / Z' + V/2 + 2^-13; 64 V / Z' is
  at most fl(64 V inv) (1 + 2^-51) <= fl(64 V inv) + 2^-27 (64 V / Z'
  < 2^24). Only for OK rows (a refused row has T = 0).
  """
  half = vocab // 2 + 1
  extra = jnp.ceil(jnp.float64(64 * vocab) * inv).astype(jnp.int64) + 1
  lo = jnp.int64(2 ** TARGET_BITS - half)
  return jnp.broadcast_to(lo, extra.shape), 2 ** TARGET_BITS + half + extra


def target_scale(e: jax.Array, status: jax.Array,
                 red: reducer.Reducer | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(inv, total, e) of the terms e[..., n] (`target_terms`) of score rows:
  `target_inv`, then `target_total` (two passes)."""
  inv, e = target_inv(e, status, red)
  return inv, target_total(e, inv, red), e


def target_rows(x: jax.Array, red: reducer.Reducer | None = None) -> tuple[TargetRows, jax.Array]:
  """(`TargetRows`, e float32[..., n]) of score rows x[..., V].

  Three passes after the max: e (float32), Z' and T (`target_scale`).
  """
  red = reducer.of(x, red)
  shift, status = target_shift(x, red)
  e = lax.optimization_barrier(target_terms(x, shift, status))
  inv, total, e = target_scale(e, status, red)
  return TargetRows(shift, inv, total, status), e


def target_summary(x: jax.Array, ids: jax.Array, red: reducer.Reducer | None = None
                   ) -> tuple[TargetRows, jax.Array]:
  """(`TargetRows`, e at ids[...]) of rows x[..., V]: no row is kept.

  ids outside [0, V) give e = 0.
  """
  red = reducer.of(x, red)
  rows, e = target_rows(x, red)
  return rows, red.lookup(e, ids[..., None])[..., 0]


def target_probs_rows(x: jax.Array, red: reducer.Reducer | None = None) -> tuple[jax.Array, jax.Array]:
  """(p float64[..., V], status) of score rows: the body of `target_probs`."""
  rows, e = target_rows(x, red)
  return probs_of(e, rows.inv[..., None]), rows.status


@functools.partial(jax.jit, static_argnames="executor")
def _target_probs(target_logits, executor):
  return executor.run(
      rowops.declare(target_probs_rows, (rowops.Arg(1, -jnp.inf),),
                     (True, False), target_logits.shape[-1]), target_logits)


@x64.scoped
def target_probs(target_logits: jax.typing.ArrayLike, *,
                 executor: rowops.Executor = rowops.LOCAL
                 ) -> tuple[jax.Array, jax.Array]:
  """Target probabilities at T=1: p_v = fl(e_v * fl(1 / Z')) in float64.

  e_v = exp(x_v - max) in float32 to a relative error of 2^-22
  (`dyadic_jax.fastexp`), Z' its exact 2^-32 fixed-point sum. These p are
  what verification and the target-only sampler use: P = round(p 2^38)
  (`quantize_target`), within total variation 2^-22 + V 2^-39 of the exact
  softmax (docs/numerics.md section 6). Statuses as `draft_weights` (no
  temperature, no bias); target processors (penalties, grammar masks as
  -inf) are applied to the logits by the caller, unchanged.

  Returns:
    (probs float64[..., V], status int32[...]); refused rows are all zero.
  """
  target_logits = jnp.asarray(target_logits)
  check_rows("target_probs", target_logits)
  return _target_probs(target_logits, executor)
