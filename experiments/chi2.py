"""Chi-square helpers shared by the experiments (no flags: importable)."""

import numpy as np
import scipy.stats


def goodness_of_fit(observed, probs):
  """(stat, dof, p) of counts `observed` against probabilities `probs`.

  Cells with probability 0 are left out, unless one holds a count: then the
  sample is impossible under `probs` (stat inf, p 0).
  """
  observed = np.asarray(observed, np.float64)
  probs = np.asarray([float(p) for p in probs])
  live = probs > 0
  if np.any(observed[~live] > 0):
    return float("inf"), int(live.sum() - 1), 0.0
  expected = observed.sum() * probs[live]
  stat = float(np.sum((observed[live] - expected) ** 2 / expected))
  dof = int(live.sum() - 1)
  return stat, dof, float(scipy.stats.chi2.sf(stat, dof))


def two_sample(a, b):
  """(stat, dof, p) of the chi-square homogeneity test of two histograms."""
  table = np.stack([a, b]).astype(np.float64)
  table = table[:, table.sum(0) > 0]  # a bin empty in both carries no df
  expected = table.sum(1, keepdims=True) * table.sum(0) / table.sum()
  stat = float(np.sum((table - expected) ** 2 / expected))
  dof = table.shape[1] - 1
  return stat, dof, float(scipy.stats.chi2.sf(stat, dof))


def pool_small(expected_counts, *hists, min_expected=5.0):
  """Merges the cells whose expected count is below `min_expected` into one.

  Returns the pooled expected counts, then each histogram pooled alike.
  """
  expected_counts = np.asarray(expected_counts, np.float64)
  big = expected_counts >= min_expected
  def pool(h):
    h = np.asarray(h)
    return np.append(h[big], h[~big].sum()) if (~big).any() else h[big]
  return (pool(expected_counts),) + tuple(pool(h) for h in hists)
