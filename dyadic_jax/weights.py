"""Globally normalized FP64 softmax weights for drafts and targets.

    w_v = e_v * fl(1 / Z),   e_v = exp(x_v - max_u x_u),
    x = (logits + bias) * fl(1 / T)

`Z` is the exact sum of the float64 terms e_v, up to 2^-64 per term, rounded
once: each e_v in [0, 1] is split into two 32-bit fixed-point limbs, held as
float64 integers. Every partial sum of a limb is an integer below 2^53
(V <= 2^21), so float64 adds them exactly whatever the order or sharding,
and Z is the same bits on every layout (docs/numerics.md, "Draft weights").
"""

import jax
import jax.numpy as jnp
from jax import lax

from dyadic_jax import reducer
from dyadic_jax import rowwise
from dyadic_jax import x64
from dyadic_jax.constants import MAX_VOCAB, NORMALIZER_BITS, Status


def check_vocab(name, v):
  if not 1 <= v <= MAX_VOCAB:
    raise ValueError(f"{name}: vocabulary size {v} not in [1, {MAX_VOCAB}]")


def fixed_point_limbs(e):
  """Splits float64 e in [0, 1] into limbs (hi, lo): e ~ hi 2^-32 + lo 2^-64.

  Both limbs are exact floors, integers below 2^32 + 1 held in float64 (a
  float64 -> int64 conversion does not vectorize on CPU), so summing a limb
  over at most 2^21 entries is exact.
  """
  scale = jnp.float64(2.0 ** NORMALIZER_BITS)
  s = e * scale
  hi = jnp.floor(s)
  lo = jnp.floor((s - hi) * scale)
  return hi, lo


def reciprocal(z):
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


def normalizer_from_limb_sums(hi_sum, lo_sum):
  """Float64 Z from the exact limb sums (a pure function of two integers)."""
  return (hi_sum + lo_sum * 2.0 ** -NORMALIZER_BITS) * 2.0 ** -NORMALIZER_BITS


def shifted_exp_and_status(x, red=None):
  """Per-row max shift and status for float64 scores x[..., V].

  Returns (e float64[..., V], status int32[...]); rows that are not OK get
  e = 0. One max-reduction classifies the row: XLA's max propagates NaN
  (Status.NAN, even beside +inf), a +inf max is Status.INF, a -inf max
  (every score -inf) is Status.ZERO_MASS.
  """
  row_max = reducer.of(x, red).max(x)
  status = jnp.select(
      [jnp.isnan(row_max), row_max == jnp.inf, row_max == -jnp.inf],
      [Status.NAN, Status.INF, Status.ZERO_MASS], Status.OK).astype(jnp.int32)
  ok = (status == Status.OK)[..., None]
  e = jnp.exp(x - jnp.where(ok, row_max[..., None], 0.0))
  return jnp.where(ok, e, 0.0), status


def exact_sums(x, *terms, red=None):
  """Row sums over the last axis of terms(x), one reduction at a time.

  Each term is a function of x whose entries are integers held in float64
  with every partial sum below 2^53, so each sum is exact. XLA CPU would
  fuse sibling reductions of one input into a multi-output reduction that
  runs several times slower than the separate passes; the optimization
  barrier between passes keeps them apart (recomputing a cheap term beats
  materializing it).
  """
  red = reducer.of(x, red)
  sums = []
  for term in terms:
    if sums:
      x, _ = lax.optimization_barrier((x, sums[-1]))
    sums.append(red.sum(term(x)))
  return sums


def softmax64_rows(x, red=None):
  """(w float64, status) of score rows x[..., V]: the body of every softmax."""
  e, status = shifted_exp_and_status(x.astype(jnp.float64), red)
  hi_sum, lo_sum = exact_sums(e, lambda e: fixed_point_limbs(e)[0],
                              lambda e: fixed_point_limbs(e)[1], red=red)
  z = normalizer_from_limb_sums(hi_sum, lo_sum)
  ok = status == Status.OK
  w = jnp.where(ok[..., None],
                e * reciprocal(jnp.where(ok, z, 1.0))[..., None], 0.0)
  return w, status


softmax64 = rowwise.row_op(softmax64_rows, (1,))
softmax64.__doc__ = "(w, status) of float[..., V] scores; row by row on CPU."


def draft_rows(logits, t, bias=None, red=None):
  """(w, status) of draft logits rows at per-row temperatures t (> 0)."""
  x = logits.astype(jnp.float64)
  if bias is not None:
    x = x + bias.astype(jnp.float64)
  return softmax64_rows(x * reciprocal(t)[..., None], red)


_draft_rows_no_bias = rowwise.row_op(draft_rows, (1, 0))
_draft_rows_bias = rowwise.row_op(draft_rows, (1, 0, 1))


def temperature_status(temperature, batch):
  """(t, t_ok): per-row temperatures, with 1.0 where t is not finite > 0."""
  t = jnp.broadcast_to(temperature, batch)
  t_ok = jnp.isfinite(t) & (t > 0)
  return jnp.where(t_ok, t, 1.0), t_ok


def apply_temperature_status(w, status, t_ok):
  """Refuses rows with a bad temperature: BAD_TEMPERATURE and zero weights."""
  status = jnp.where(t_ok, status, Status.BAD_TEMPERATURE).astype(jnp.int32)
  return jnp.where(t_ok[..., None], w, 0.0), status


@jax.jit
def _draft_weights(logits, temperature, bias):
  t, t_ok = temperature_status(temperature, logits.shape[:-1])

  if bias is None:
    w, status = _draft_rows_no_bias(logits, t)
  else:
    w, status = _draft_rows_bias(logits, t, bias)
  return apply_temperature_status(w, status, t_ok)


@x64.scoped
def draft_weights(logits, *, temperature=1.0, bias=None):
  """Draft weights softmax((logits + bias) / temperature) in float64.

  Args:
    logits: float[..., V]; -inf entries are allowed (weight exactly 0).
    temperature: positive finite scalar, or float[...] one per row.
    bias: optional float[..., V] (e.g. the Markov head's bias), added before
      the temperature.

  Returns:
    (weights float64[..., V], status int32[...]). Rows with a NaN get
    Status.NAN, a +inf score Status.INF, all -inf Status.ZERO_MASS, a bad
    temperature Status.BAD_TEMPERATURE; such rows have all-zero weights.
    Normalization is global over the whole row with the exact normalizer of
    the module docstring, so the result does not depend on vocab sharding.
  """
  logits = jnp.asarray(logits)
  check_vocab("draft_weights", logits.shape[-1])
  if bias is not None:
    bias = jnp.broadcast_to(jnp.asarray(bias), logits.shape)
  return _draft_weights(logits, jnp.asarray(temperature, jnp.float64), bias)


@jax.jit
def _target_probs(target_logits):
  return softmax64(target_logits)


@x64.scoped
def target_probs(target_logits):
  """Target probabilities at T=1: softmax(target_logits) in float64.

  Same normalization and statuses as `draft_weights` (no temperature, no
  bias): target processors (penalties, grammar masks as -inf) are applied to
  the logits by the caller, unchanged. Returns (probs float64[..., V],
  status int32[...]).
  """
  target_logits = jnp.asarray(target_logits)
  check_vocab("target_probs", target_logits.shape[-1])
  return _target_probs(target_logits)
