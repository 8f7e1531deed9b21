"""exp(x - m) in float32 with a proved relative error, for the target rows.

    e = exp(x - m),   x <= m,   relative error <= EXP_REL_ERROR (2^-22)

The target distribution only needs each term e_v = exp(x_v - max) to a
relative error far below the contract's 2^-20 (docs/numerics.md section
6), and float32 runs twice as many lanes per instruction as float64. What
float32 cannot do is hold the argument: fl32(x - m) is off by up to
|x - m| 2^-24 relative, which for x - m near -80 would cost 2^-18 in e.
So the argument is never rounded:

1. x - m = d + d_lo exactly: d = fl32(x - m), and d_lo its rounding error
   by the error-free TwoSum (float32 inputs), or d in float64 (float64
   inputs; x - m then errs by |x - m| 2^-53).
2. k = round(d log2(e)); r = (d - k C1) - k C2 + d_lo, with C1 + C2 = ln 2
   and C1 = 0.693359375 (9 significant bits, so k C1 is exact): |r| <=
   ln(2)/2 + 2^-16, computed with an absolute error below 2^-24.
3. exp(r) by a degree-6 polynomial (float32 coefficients fitted on
   [-ln(2)/2, ln(2)/2]; approximation error 2^-25.6 relative), Horner in
   float32, then times 2^k built from the exponent bits (exact).

Every step is an IEEE float32 (or float64) operation, the same on every
backend up to fused multiply-adds, which the error bound covers. Terms with
x - m < -87 (e < 2^-125) are 0. The bound is proved in docs/numerics.md and
measured over every float32 argument in [-87, 0] by
`experiments/bench_core.py --exp_accuracy`.
"""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

# Relative error bound of `exp_shifted` for x - m >= CUTOFF (proved in
# docs/numerics.md section 6; the measured maximum is below 2^-23).
EXP_REL_ERROR = 2.0 ** -22
CUTOFF = -87.0

_LOG2E = 1.4426950408889634
_C1 = 0.693359375                  # ln 2, high 9 bits: k * C1 is exact
_C2 = -2.1219444005469057e-04      # ln 2 - C1 (float32)
_LN2_HI = 6.93147180369123816490e-01  # fdlibm: 32 trailing zero bits
_LN2_LO = 1.90821492927058770002e-10
# exp(r) on |r| <= ln(2)/2, highest degree first (c1 = c0 = 1 exactly, so
# exp(0) = 1 exactly and the row maximum has e = 1).
_COEFFS = np.asarray([0.0013948604464530945, 0.008375145494937897,
                      0.041666217148303986, 0.16666415333747864, 0.5, 1.0,
                      1.0], np.float32)


def _poly(r):
  p = jnp.float32(_COEFFS[0])
  for c in _COEFFS[1:]:
    p = p * r + jnp.float32(c)
  return p


def _pow2(k):
  """2^k as float32 from the exponent bits, k integral in [-126, 127]."""
  biased = k.astype(jnp.int32) + 127
  return lax.bitcast_convert_type(biased << 23, jnp.float32)


def _finish(d, k, r):
  e = _poly(r) * _pow2(jnp.clip(k, -126, 127))
  return jnp.where(d >= CUTOFF, e, jnp.float32(0))


def exp_shifted32(x: jax.Array, m: jax.Array) -> jax.Array:
  """exp(x - m) for float32 x and m (broadcast), as float32 in [0, 1].

  x - m must not be above 0 by more than 88; -inf x gives 0; x = m gives
  exactly 1.
  """
  f32 = jnp.float32
  x, m = x.astype(f32), m.astype(f32)
  d = x - m
  # TwoSum: d + d_lo == x - m exactly (IEEE round to nearest).
  b = d - x
  d_lo = (x - (d - b)) + (-m - b)
  k = jnp.round(d * f32(_LOG2E))
  r = ((d - k * f32(_C1)) - k * f32(_C2)) + d_lo
  return _finish(d, k, r)


def exp_shifted64(x: jax.Array, m: jax.Array) -> jax.Array:
  """exp(x - m) for float64 x and m: float64 range reduction, float32 exp(r)."""
  f64 = jnp.float64
  d = x.astype(f64) - m.astype(f64)
  k = jnp.round(d * f64(_LOG2E))
  r = (d - k * f64(_LN2_HI)) - k * f64(_LN2_LO)
  return _finish(d, k, r.astype(jnp.float32))


def exp_shifted(x: jax.Array, m: jax.Array) -> jax.Array:
  """`exp_shifted64` for float64 (and integer) x, else `exp_shifted32`."""
  if x.dtype == jnp.float64 or jnp.issubdtype(x.dtype, jnp.integer):
    return exp_shifted64(x, m)
  return exp_shifted32(x, m)
