"""Shared construction of (target logits, q) cases for verification tests.

The constructors live in `dyadic_jax.testing.adversarial` (users' tests can
run the same cases); `target_fixed` adds the oracle check the tests rely on.
"""

import jax
import numpy as np

import dyadic_jax as dj
from dyadic_jax import reference as ref
from dyadic_jax.testing.adversarial import counts_for, logits_for, sparse_q

__all__ = ["counts_for", "logits_for", "sparse_q", "target_fixed"]

M = dj.M


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
