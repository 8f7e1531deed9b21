"""Shared construction of (target logits, q) cases for verification tests."""

import jax
import numpy as np

import dyadic_jax as dj
from dyadic_jax import reference as ref

M = dj.M


def logits_for(p):
  """float32 logits whose softmax is p; zeros become -inf (a grammar mask)."""
  p = np.asarray(p, np.float64)
  with np.errstate(divide="ignore"):
    return np.where(p > 0, np.log(p), -np.inf).astype(np.float32)


def target_fixed(logits):
  """P rows exactly as the library computes them, checked against the oracle."""
  probs, status = dj.target_probs(np.atleast_2d(logits))
  assert np.all(np.asarray(status) == dj.Status.OK)
  with jax.enable_x64(True):
    p_fixed, _ = dj.quantize_target(probs)
  p_fixed = np.asarray(p_fixed)
  for row, prow in zip(p_fixed, np.asarray(probs)):
    assert row.tolist() == ref.quantize_target(prow)
  return [[int(x) for x in row] for row in p_fixed]


def counts_for(q):
  """Dense dyadic counts of a normalized q (exact allocation)."""
  q = np.asarray(q, np.float64)
  counts, status = dj.allocate_dense((q / q.sum())[None])
  assert int(status[0]) == dj.Status.OK
  return np.asarray(counts[0]).tolist()


def sparse_q(counts_rows):
  """SparseQ with k = V from dense count rows (support = positive counts)."""
  rows = np.asarray(counts_rows, np.int32)
  k = rows.shape[-1]
  ids = np.full(rows.shape, -1, np.int32)
  counts = np.zeros(rows.shape, np.int32)
  n = (rows > 0).sum(-1).astype(np.int32)
  for i, row in enumerate(rows):
    support = np.flatnonzero(row)
    ids[i, :len(support)] = support
    counts[i, :len(support)] = row[support]
  del k
  return dj.SparseQ(ids, counts, n)
