"""End to end: the first emitted token of verify_chain is distributed as p.

Harness: N independent rounds (fixed keys) of a depth-2 chain whose drafts
are drawn from q by the PROPOSAL draw; the first emitted token (x_1 if
accepted, else the correction) is tested against the exact target P / T
with a chi-square at level ALPHA = 1e-7. N is computed to detect a total
variation of TV_DETECT with power 1 - 1e-4. Two deliberately biased mutants
run through the same harness and must be rejected: a residual without the
max(., 0), and a correction that reuses the proposal's noise.

The chi-square tests of the correct implementation run in both row modes
(`row_mode`, tests/conftest.py). The modes give the same bits
(tests/core/test_row_modes.py), so the second run draws the very same tokens:
it checks the batched programs, and adds no false-failure chance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import cumulative
from dyadic_jax import reference as ref
from dyadic_jax import verification
from dyadic_jax.testing import stats
from tests import verify_cases as vc

M = dj.M
SEED = 20261130
TV_DETECT = 0.02

P = np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q = np.array([0.05, 0.10, 0.15, 0.20, 0.20, 0.10, 0.10, 0.10])
N = stats.samples_for_tv(TV_DETECT, df=len(P) - 1)


def _first_tokens(n=N, sparse=False):
  """First emitted token of n rounds, drafts drawn from q (PROPOSAL keys)."""
  logits = vc.logits_for(np.stack([P, P[::-1], P]))
  counts = np.asarray([vc.counts_for(Q), vc.counts_for(Q[::-1])], np.int32)
  q = vc.sparse_q(counts) if sparse else dj.DenseQ(jnp.asarray(counts))

  def one_round(r):
    key = dj.round_key(SEED, 0, r)
    draft = jnp.stack([
        dj.sample_counts(counts[i], dj.draw24(
            dj.draw_key(key, i, dj.Domain.PROPOSAL))) for i in range(2)])
    accepted, token, _ = dj.verify_chain(logits, q, draft, key)
    return jnp.where(accepted > 0, draft[0], token)

  chunks = [jax.vmap(one_round)(jnp.arange(i, min(i + N, n)))
            for i in range(0, n, N)]
  return np.concatenate([np.asarray(c) for c in chunks])


def _target():
  return [float(x) for x in ref.target_distribution(
      vc.target_fixed(vc.logits_for(P))[0])]


def _chi_square(name, **kwargs):
  tokens = _first_tokens(**kwargs)
  expected = _target()
  stat, pvalue, observed = stats.chi_square(tokens, expected)
  stats.report(name, observed, expected, stat, pvalue)
  return pvalue


@pytest.fixture
def fresh_traces():
  """Mutants patch module globals; drop compiled traces before and after."""
  jax.clear_caches()
  yield
  jax.clear_caches()


def test_sample_size_is_computed():
  assert 50_000 < N < 200_000, N


@pytest.mark.usefixtures("row_mode")
def test_first_token_matches_target(fresh_traces):
  del fresh_traces
  assert _chi_square("verify_chain") > stats.ALPHA


@pytest.mark.slow
@pytest.mark.usefixtures("row_mode")
@pytest.mark.parametrize("sparse", [False, True])
def test_first_token_matches_target_large(sparse, fresh_traces):
  # 16x the samples: detects TV 0.005 with the same alpha and power.
  del fresh_traces
  n = stats.samples_for_tv(TV_DETECT / 4, df=len(P) - 1)
  assert _chi_square(f"verify_chain large sparse={sparse}", n=n,
                     sparse=sparse) > stats.ALPHA


def test_mutant_residual_without_clamp_is_rejected(monkeypatch, fresh_traces):
  del fresh_traces
  # Exact output of this mutant: far from p, so the harness has power.
  p_fixed = vc.target_fixed(vc.logits_for(P))[0]
  counts = vc.counts_for(Q)
  unclamped = [abs(p * M - c * sum(p_fixed)) for p, c in zip(p_fixed, counts)]
  out = [0] * len(P)
  for x, c in enumerate(counts):
    given = ref.output_given_draft(p_fixed, counts, x, residual=unclamped)
    out = [o + c * g / M for o, g in zip(out, given)]
  assert ref.total_variation(out, ref.target_distribution(p_fixed)) > \
      2 * TV_DETECT

  monkeypatch.setattr(
      verification, "residual_weights",
      lambda p, c, t, red=None: cumulative.blocked(
          jnp.abs(p.astype(jnp.int64) * M - c * t)))
  assert _chi_square("mutant: |p - q| residual") < stats.ALPHA


def test_mutant_reused_proposal_noise_is_rejected(monkeypatch, fresh_traces):
  del fresh_traces
  def reused_bits(key, position, bonus):
    # The proposal's 24-bit uniform, scaled to 64 bits: the same noise.
    del bonus
    u = dj.draw24(dj.draw_key(key, position, dj.Domain.PROPOSAL))
    return u.astype(jnp.uint64) << jnp.uint64(40)

  monkeypatch.setattr(verification, "next_token_bits", reused_bits)
  assert _chi_square("mutant: correction reuses proposal noise") < stats.ALPHA
