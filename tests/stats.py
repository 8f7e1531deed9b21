"""Chi-square goodness of fit with a stated false-failure rate and power.

Each statistical test in this suite runs with a fixed key, so its verdict is
reproducible; ALPHA is the probability that a correct implementation fails
it over the choice of key. With at most 10 such tests the suite's total
false-failure rate stays below 1e-6 (DESIGN.md section 7).
"""

import math

import numpy as np
from scipy import stats

ALPHA = 1e-7
POWER = 1 - 1e-4


def samples_for_tv(tv, df, alpha=ALPHA, power=POWER):
  """Sample size at which a chi-square test detects total variation `tv`.

  Any alternative at TV distance tv has noncentrality lambda >= 4 N tv^2
  (Cauchy-Schwarz: sum |d_i| <= sqrt(sum d_i^2 / p_i)), so N is chosen such
  that the noncentral chi-square with lambda = 4 N tv^2 exceeds the level
  alpha critical value with probability `power`.
  """
  crit = stats.chi2.isf(alpha, df)
  lo, hi = 1.0, 1e9
  while hi / lo > 1.001:
    mid = math.sqrt(lo * hi)
    if stats.ncx2.sf(crit, df, mid) >= power:
      hi = mid
    else:
      lo = mid
  return int(math.ceil(hi / (4 * tv * tv)))


def chi_square(observed_tokens, expected_probs):
  """(statistic, p-value, table) of tokens against expected probabilities.

  Cells with zero expected probability must be empty (any hit is a
  certain failure: p-value 0).
  """
  expected_probs = np.asarray(expected_probs, np.float64)
  n = len(observed_tokens)
  observed = np.bincount(observed_tokens, minlength=len(expected_probs))
  assert len(observed) == len(expected_probs), "token out of range"
  live = expected_probs > 0
  if np.any(observed[~live]):
    return math.inf, 0.0, observed
  expected = n * expected_probs[live]
  stat = float(np.sum((observed[live] - expected) ** 2 / expected))
  return stat, float(stats.chi2.sf(stat, live.sum() - 1)), observed


def report(name, observed, expected_probs, stat, pvalue):
  """Prints expected vs actual per cell, like jax's random_lax_test."""
  n = observed.sum()
  print(f"\n{name}: N={n} chi2={stat:.2f} p={pvalue:.3g} alpha={ALPHA:g}")
  for v, (o, p) in enumerate(zip(observed, expected_probs)):
    print(f"  token {v:3d}: expected {n * p:10.1f}  observed {o:8d}")
