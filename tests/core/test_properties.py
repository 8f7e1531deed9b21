"""Hypothesis properties of dense and sparse allocation.

Derandomized under the "ci" profile (tests/conftest.py). Every example uses
the same padded shape so the op compiles once.
"""

import math

import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import numpy as np

import dyadic_jax as dj

M = dj.M
_V = 48

_raw = hnp.arrays(
    np.float64, st.integers(1, _V),
    elements=st.one_of(
        st.just(0.0),
        st.floats(1e-30, 1e6, allow_nan=False, allow_infinity=False),
        st.sampled_from([1.0, 2.0, 3.0, 0.5, 0.25])))  # ties on purpose


def _normalized_padded(raw):
  hypothesis.assume(raw.sum() > 0)
  w = raw / raw.sum()
  return np.pad(w, (0, _V - len(w)))


@hypothesis.given(_raw)
def test_dense_allocation_properties(raw):
  w = _normalized_padded(raw)
  counts, status = dj.allocate_dense(w[None])
  counts = np.asarray(counts[0]).astype(np.int64)
  hypothesis.assume(int(status[0]) == dj.Status.OK)
  assert counts.sum() == M
  assert np.all(np.abs(counts - w * M) < 1)        # |c_v - w_v M| < 1
  assert np.all(counts[w == 0] == 0)               # zero weight, no ticket
  # Ties by id: equal weights differ by at most one ticket, lower id first.
  for value in np.unique(w[w > 0]):
    tied = counts[w == value]
    assert tied.max() - tied.min() <= 1
    assert np.all(np.diff(tied) <= 0)


@hypothesis.given(_raw, st.sampled_from([1, 5, 16, _V]))  # few k: few compiles
def test_sparse_allocation_properties(raw, k):
  w = _normalized_padded(raw)
  ids, counts, n, status = (np.asarray(a[0]) for a in dj.allocate_sparse(
      w[None], k))
  assert int(status) == dj.Status.OK
  n = int(n)
  assert 1 <= n <= k
  assert counts[:n].sum() == M and np.all(counts[:n] > 0)
  assert np.all(np.diff(ids[:n]) > 0)              # strictly ascending ids
  assert np.all(ids[n:] == -1) and np.all(counts[n:] == 0)
  assert np.all(w[ids[:n]] > 0)
  # Support is the top-k: nothing outside it outweighs anything inside.
  outside = np.setdiff1d(np.arange(_V), ids[:n])
  if n == k and len(outside):
    assert w[outside].max() <= w[ids[:n]].min()
  # Within the support, |c - w/W * M| < 1 for the renormalized weights.
  support_total = math.fsum(np.sort(w)[::-1][:k])
  assert np.all(np.abs(counts[:n] - w[ids[:n]] / support_total * M) < 1 + 1e-6)
