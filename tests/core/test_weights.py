"""Draft/target weights, statuses, x64 scoping and the checked wrapper.

Tests of multi-row calls run in both row modes (`row_mode`,
tests/conftest.py).
"""

from fractions import Fraction
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import fastexp
from dyadic_jax import weights as wmod

S = dj.Status


def _np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.usefixtures("row_mode")
def test_matches_numpy_softmax_with_bias_and_temperature():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 1000)).astype(np.float32) * 4
  bias = rng.normal(size=(3, 1000)).astype(np.float32)
  w, status = dj.draft_weights(logits, temperature=0.7, bias=bias)
  assert w.dtype == np.float64 and np.all(np.asarray(status) == S.OK)
  want = _np_softmax((logits.astype(np.float64) + bias) / 0.7)
  np.testing.assert_allclose(np.asarray(w), want, rtol=1e-12, atol=0)


@pytest.mark.usefixtures("row_mode")
def test_per_row_temperature():
  logits = np.array([[0.0, 1.0], [0.0, 1.0]], np.float32)
  w, _ = dj.draft_weights(logits, temperature=np.array([1.0, 0.5]))
  np.testing.assert_allclose(np.asarray(w),
                             [_np_softmax(np.array([0.0, 1.0])),
                              _np_softmax(np.array([0.0, 2.0]))], rtol=1e-14)


def test_normalizer_is_exact_sum_of_terms():
  rng = np.random.default_rng(1)
  x = rng.normal(size=4000) * 30
  w, _ = dj.draft_weights(x[None].astype(np.float32))
  w = np.asarray(w[0])
  with jax.enable_x64(True):
    e = np.asarray(jnp.exp(jnp.asarray(x.astype(np.float32), jnp.float64)
                           - np.float32(x.astype(np.float32)).max()))
  exact = sum(Fraction(v) for v in e)
  z = float(exact)
  # w_v = e_v / Z with Z the exact sum rounded once (+ limb truncation).
  np.testing.assert_allclose(w, e / z, rtol=4e-16, atol=0)
  assert abs(Fraction(float(np.sum(w))) - 1) < Fraction(1, 2 ** 40)


def test_masked_logits_get_exactly_zero_weight():
  logits = np.array([[0.0, -np.inf, 2.0, -np.inf]], np.float32)
  w, status = dj.draft_weights(logits)
  assert int(status[0]) == S.OK
  assert np.asarray(w)[0, 1] == 0.0 and np.asarray(w)[0, 3] == 0.0
  counts, _ = dj.allocate_dense(w)
  assert np.asarray(counts)[0, [1, 3]].tolist() == [0, 0]


@pytest.mark.parametrize("row,temperature,status", [
    ([0.0, np.nan, 1.0], 1.0, S.NAN),
    ([0.0, np.inf, 1.0], 1.0, S.INF),
    ([-np.inf, -np.inf], 1.0, S.ZERO_MASS),
    ([np.nan, np.inf], 1.0, S.NAN),
    ([0.0, 1.0], 0.0, S.BAD_TEMPERATURE),
    ([0.0, 1.0], -1.0, S.BAD_TEMPERATURE),
    ([0.0, 1.0], np.inf, S.BAD_TEMPERATURE),
    ([0.0, 1.0], np.nan, S.BAD_TEMPERATURE),
])
def test_refusals(row, temperature, status):
  w, got = dj.draft_weights(np.array([row], np.float32),
                            temperature=temperature)
  assert int(got[0]) == status
  assert not np.any(np.asarray(w))


@pytest.mark.usefixtures("row_mode")
def test_target_probs_statuses_and_values():
  logits = np.array([[0.0, 1.0, -np.inf], [np.nan, 0, 0]], np.float32)
  p, status = dj.target_probs(logits)
  assert np.asarray(status).tolist() == [S.OK, S.NAN]
  np.testing.assert_allclose(np.asarray(p)[0, :2],
                             _np_softmax(np.array([0.0, 1.0])), rtol=2 ** -21)
  assert np.asarray(p)[0, 2] == 0 and not np.any(np.asarray(p)[1])


def _tv_to_softmax(logits):
  """TV(P / T, exact softmax) per row; the softmax in float64 (2^-50 off)."""
  p, status = dj.target_probs(logits)
  assert not np.any(np.asarray(status))
  with jax.enable_x64(True):
    fixed, total = dj.quantize_target(p)
  x = np.asarray(logits, np.float64)
  out = []
  for row, xr, t in zip(np.asarray(fixed), x, np.asarray(total)):
    # T within rounding of 2^38 * E / Z', E / Z' in [1, 1 + V 2^-32].
    assert int(row.sum()) == int(t) and 2 ** 38 - len(row) < int(t) < 2 ** 39
    soft = np.exp(xr - xr.max())
    soft /= math.fsum(soft)
    out.append(0.5 * math.fsum(np.abs(row / float(t) - soft)))
  return np.asarray(out)


@pytest.mark.parametrize("v", [1000, dj.DEFAULT_VOCAB, dj.MAX_VOCAB])
def test_target_distance_to_exact_softmax_within_contract(v):
  # docs/numerics.md section 6: TV(P / T, softmax) <= 2^-22 + V 2^-39.
  rng = np.random.default_rng(v)
  rows = [
      rng.normal(size=v) * 3,                       # typical
      rng.normal(size=v) * 30,                      # peaked
      np.zeros(v),                                  # flat: T spread thin
      rng.normal(size=v) * 3 + 3e4,                 # inexact float32 x - max
      np.where(rng.random(v) < 0.5, -np.inf, rng.normal(size=v) * 0.01),
      -np.abs(rng.normal(size=v)) * 90,              # terms below the cutoff
  ]
  logits = np.stack(rows).astype(np.float32)
  bound = 2.0 ** -22 + v * 2.0 ** -39
  tv = _tv_to_softmax(logits)
  assert np.all(tv <= bound), (np.log2(tv), np.log2(bound))
  assert np.all(tv <= 2.0 ** -20)
  # The float64 path (float64 logits) holds the same bound.
  assert np.all(_tv_to_softmax(logits.astype(np.float64)[:2]) <= bound)


@pytest.mark.parametrize("v", [7, 1001, 4096, dj.DEFAULT_VOCAB])
def test_a_nan_anywhere_is_refused(row_mode, v):
  # XLA CPU's vectorized max reduction drops NaN (at V = 4096 it returned
  # a finite max, or -inf for a NaN in the last slot): the status must not
  # depend on it.
  del row_mode
  x = np.random.default_rng(v).normal(size=(6, v)).astype(np.float32)
  for row, pos in enumerate((0, 1, v // 3, v // 2, v - 1)):
    x[row, pos] = np.nan
  x[5, v - 1], x[5, 0] = np.nan, np.inf       # NaN beside +inf
  for op in (dj.draft_weights, dj.target_probs):
    w, status = op(x)
    np.testing.assert_array_equal(np.asarray(status), dj.Status.NAN)
    assert not np.any(np.asarray(w))
  counts, token, status = dj.propose_dense(x, np.zeros(6, np.uint32))
  np.testing.assert_array_equal(np.asarray(status), dj.Status.NAN)
  assert not np.any(np.asarray(counts)) and np.all(np.asarray(token) == -1)


def test_subnormal_and_bad_temperatures_are_refused():
  row = np.array([[0.0, 1.0]], np.float32)
  for t in (5e-324, 2.2e-308, -5e-324, 0.0, -0.0):
    w, status = dj.draft_weights(row, temperature=t)
    assert int(status[0]) == S.BAD_TEMPERATURE, t
    assert not np.any(np.asarray(w))
  # The smallest normal float64 is a temperature: one-hot at the max, or
  # INF where a score overflows.
  w, status = dj.draft_weights(row, temperature=2.2250738585072014e-308)
  assert int(status[0]) == S.OK and np.asarray(w)[0].tolist() == [0.0, 1.0]
  _, status = dj.draft_weights(row * 100, temperature=1e-307)
  assert int(status[0]) == S.INF


@pytest.mark.parametrize("op,args", [
    ("draft_weights", ()), ("target_probs", ()), ("allocate_dense", ()),
    ("allocate_sparse", (1,)), ("quantize_target", ())])
def test_zero_d_input_is_a_clear_error(op, args):
  with pytest.raises(ValueError, match=f"{op}: .*0-d"):
    getattr(dj, op)(np.float32(1.0), *args)


def test_vocabulary_bounds():
  with pytest.raises(ValueError, match="vocabulary size"):
    dj.draft_weights(np.zeros((1, 0), np.float32))


@pytest.mark.qualify
def test_x64_is_scoped_to_the_library():
  before = jax.config.jax_enable_x64
  w, _ = dj.draft_weights(np.zeros((1, 4), np.float32))
  assert w.dtype == np.float64
  assert jax.config.jax_enable_x64 == before
  # Caller code outside the library still gets its own default dtypes.
  if not before:
    assert jnp.zeros(2, dtype=float).dtype == jnp.float32


@pytest.mark.qualify
def test_library_ops_inside_a_callers_jit():
  @jax.jit
  def propose(logits, draw):
    w, status = dj.draft_weights(logits)
    counts, status2 = dj.allocate_dense(w)
    return dj.sample_counts(counts, draw), status | status2

  logits = np.log(np.array([[0.25, 0.75]], np.float32))
  with jax.enable_x64(True):
    token, status = propose(logits, np.array([dj.M // 4], np.uint32))
    assert int(token[0]) == 1 and int(status[0]) == 0
    token, _ = propose(logits, np.array([dj.M // 4 - 1], np.uint32))
    assert int(token[0]) == 0
  if not jax.config.jax_enable_x64:
    with pytest.raises(dj.X64Required, match="enable_x64"):
      jax.jit(lambda x: dj.draft_weights(x)[1])(logits)


@pytest.mark.usefixtures("row_mode")
def test_vmap_needs_no_x64():
  logits = np.log(np.array([[0.25, 0.75], [0.5, 0.5]], np.float32))
  w, status = jax.vmap(dj.draft_weights)(logits)
  assert w.dtype == np.float64 and np.asarray(status).tolist() == [0, 0]


@pytest.mark.usefixtures("row_mode")
def test_checked_wrapper_raises_typed_error():
  logits = np.array([[0.0, 1.0], [np.nan, 0.0], [-np.inf, -np.inf]],
                    np.float32)
  with pytest.raises(dj.DyadicError) as info:
    dj.checked(dj.draft_weights)(logits)
  err = info.value
  assert err.op == "draft_weights"
  assert err.status == S.NAN
  assert err.rows == (1, 2) and err.statuses == (S.NAN, S.ZERO_MASS)
  assert "NAN" in str(err)
  w = dj.checked(dj.draft_weights)(logits[:1])
  assert w.shape == (1, 2)


@pytest.mark.usefixtures("row_mode")
def test_checked_wrapper_multi_output_and_batch_rank():
  w = np.array([[[0.5, 0.5], [0.5, np.nan]]])
  with pytest.raises(dj.DyadicError) as info:
    dj.checked(dj.allocate_sparse)(w, 1)
  assert info.value.op == "allocate_sparse" and info.value.rows == ((0, 1),)
  ids, counts, n = dj.checked(dj.allocate_sparse)(w[:, :1], 1)
  assert np.asarray(n).tolist() == [[1]]


@pytest.mark.qualify
def test_fixed_point_limbs_are_exact_floors():
  with jax.enable_x64(True):
    e = jnp.asarray([1.0, 0.5, 2.0 ** -70, 0.1, 0.0, np.nextafter(1.0, 0)])
    hi, lo = wmod.fixed_point_limbs(e)
  for v, h, l in zip(np.asarray(e), np.asarray(hi), np.asarray(lo)):
    x = Fraction(float(v)) * 2 ** 32
    assert h == int(x) and l == int((x - int(x)) * 2 ** 32)
    assert h <= 2 ** 32 and l < 2 ** 32  # limb sums over 2^21 stay < 2^53


def test_fastexp_relative_error_within_proved_bound():
  # docs/numerics.md 6.1: |e / exp(x - m) - 1| <= 2^-22 for x - m >= -87.
  # Every float32 exponent in range, 4096 mantissas each, m = 0 (the
  # polynomial and reduction), random (x, m) pairs (the TwoSum path) and
  # float64 logits (the float64 reduction). The whole range is measured by
  # `python -m experiments.bench_core --exp_accuracy` (max 2^-23.41).
  rng = np.random.default_rng(0)
  exps = np.arange(0, int(np.float32(87).view(np.uint32) >> 23) + 1)
  mant = rng.integers(0, 1 << 23, (len(exps), 4096))
  bits = ((exps[:, None] << 23) | mant).astype(np.uint32).ravel()
  d = -bits.view(np.float32)
  d = d[d >= fastexp.CUTOFF]
  x = (rng.normal(size=1 << 18) * 30).astype(np.float32)
  m = np.maximum(x, (rng.normal(size=1 << 18) * 30).astype(np.float32))
  with jax.enable_x64(True):
    e0 = np.asarray(jax.jit(fastexp.exp_shifted32)(d, np.float32(0)))
    e1 = np.asarray(jax.jit(fastexp.exp_shifted32)(x, m))
    e2 = np.asarray(jax.jit(fastexp.exp_shifted64)(
        x.astype(np.float64) * 1.1, m.astype(np.float64) * 1.1))
  for e, arg in ((e0, d.astype(np.float64)),
                 (e1, x.astype(np.float64) - m),
                 (e2, x.astype(np.float64) * 1.1 - m.astype(np.float64) * 1.1)):
    live = arg >= fastexp.CUTOFF
    rel = np.abs(e[live].astype(np.float64) / np.exp(arg[live]) - 1)
    assert rel.max() <= fastexp.EXP_REL_ERROR, np.log2(rel.max())
    assert not np.any(e[~live])
  assert e0.max() <= 1 and float(jax.jit(fastexp.exp_shifted32)(
      np.float32(3.5), np.float32(3.5))) == 1.0
