"""Chi-square helpers with a stated false-failure rate and power.

Shared by the tests and the experiments (numpy and scipy, the [experiments]
extra; no flags).

A statistical test in this suite runs with a fixed key, so its verdict is
reproducible; ALPHA is the probability that a correct implementation fails
it over the choice of key. With at most 10 such tests at ALPHA the suite's
total false-failure rate stays below 1e-6. POWER is the probability with
which `samples_for_tv` sizes a test to catch a given total variation.

Cells with probability 0 must stay empty: a hit there makes the sample
impossible under the hypothesis (statistic inf, p-value 0).
"""

import math
import typing

import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax import extras

_scipy_stats = extras.load("scipy.stats", "dyadic_jax.testing.stats")

ALPHA = 1e-7
POWER = 1 - 1e-4


def samples_for_tv(tv: float, df: int, alpha: float = ALPHA,
                   power: float = POWER) -> int:
  """Sample size at which a chi-square test detects total variation `tv`.

  Any alternative at TV distance tv has noncentrality lambda >= 4 N tv^2
  (Cauchy-Schwarz: sum |d_i| <= sqrt(sum d_i^2 / p_i)), so N is chosen such
  that the noncentral chi-square with lambda = 4 N tv^2 exceeds the level
  alpha critical value with probability `power`.
  """
  crit = _scipy_stats.chi2.isf(alpha, df)
  lo, hi = 1.0, 1e9
  while hi / lo > 1.001:
    mid = math.sqrt(lo * hi)
    if _scipy_stats.ncx2.sf(crit, df, mid) >= power:
      hi = mid
    else:
      lo = mid
  return int(math.ceil(hi / (4 * tv * tv)))


def goodness_of_fit(observed: ArrayLike, probs: ArrayLike | typing.Sequence[
    typing.Any]) -> tuple[float, int, float]:
  """(statistic, dof, p) of counts `observed` against probabilities `probs`.

  `probs` may hold Fractions. Cells with probability 0 are left out, unless
  one holds a count: then the sample is impossible (inf, dof, 0.0).
  """
  observed = np.asarray(observed, np.float64)
  probs = np.asarray([float(p) for p in np.ravel(probs)])
  live = probs > 0
  dof = int(live.sum() - 1)
  if np.any(observed[~live] > 0):
    return math.inf, dof, 0.0
  expected = observed.sum() * probs[live]
  stat = float(np.sum((observed[live] - expected) ** 2 / expected))
  return stat, dof, float(_scipy_stats.chi2.sf(stat, dof))


def chi_square(observed_tokens: ArrayLike, expected_probs: ArrayLike
               ) -> tuple[float, float, np.ndarray]:
  """(statistic, p, histogram) of tokens against expected probabilities."""
  expected_probs = np.asarray(expected_probs, np.float64)
  observed = np.bincount(np.asarray(observed_tokens),
                         minlength=len(expected_probs))
  assert len(observed) == len(expected_probs), "token out of range"
  stat, _, p = goodness_of_fit(observed, expected_probs)
  return stat, p, observed


def two_sample(a: ArrayLike, b: ArrayLike) -> tuple[float, int, float]:
  """(statistic, dof, p) of the chi-square homogeneity test of two histograms.

  A bin empty in both samples carries no degree of freedom.
  """
  table = np.stack([np.asarray(a), np.asarray(b)]).astype(np.float64)
  table = table[:, table.sum(0) > 0]
  expected = table.sum(1, keepdims=True) * table.sum(0) / table.sum()
  stat = float(np.sum((table - expected) ** 2 / expected))
  dof = table.shape[1] - 1
  return stat, dof, float(_scipy_stats.chi2.sf(stat, dof))


def pool_small(expected_counts: ArrayLike, *hists: ArrayLike,
               min_expected: float = 5.0) -> tuple[np.ndarray, ...]:
  """Merges the cells whose expected count is below `min_expected` into one.

  Returns the pooled expected counts, then each histogram pooled alike.
  """
  expected_counts = np.asarray(expected_counts, np.float64)
  big = expected_counts >= min_expected

  def pool(h):
    h = np.asarray(h)
    return np.append(h[big], h[~big].sum()) if (~big).any() else h[big]
  return (pool(expected_counts),) + tuple(pool(h) for h in hists)


def format_p(p: float) -> str:
  """A p-value for people: two significant digits, never rounded to 0.

  7.6e-27 prints as "7.6e-27" (not "0.0000"), 0.4512 as "0.45"; an exact 0
  (an impossible sample) prints as "0".
  """
  return f"{p:.2g}"


def report(name: str, observed: np.ndarray, expected_probs: ArrayLike,
           stat: float, pvalue: float, alpha: float = ALPHA) -> None:
  """Prints expected vs actual per cell, like jax's random_lax_test."""
  n = observed.sum()
  probs = np.asarray([float(p) for p in np.ravel(expected_probs)])
  print(f"\n{name}: N={n} chi2={stat:.2f} p={format_p(pvalue)} "
        f"alpha={alpha:g}")
  for v, (o, p) in enumerate(zip(observed, probs)):
    print(f"  token {v:3d}: expected {n * p:10.1f}  observed {o:8d}")
