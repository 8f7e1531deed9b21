"""Admission: fixed depth, sequential stopping rules, selection-bias toy."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import reference as ref
from dyadic_jax.testing import stats
from tests import verify_cases as vc

M = dj.M


def test_fixed_depth_draws_exactly_depth():
  calls = []

  def draw(i, prefix):
    calls.append((i, prefix))
    return 10 + i

  chain = dj.draft_chain(dj.FixedDepth(depth=3), draw, max_depth=5)
  assert chain == (10, 11, 12)
  assert calls == [(0, ()), (1, (10,)), (2, (10, 11))]


def test_rule_sees_only_the_past_and_never_reopens():
  seen = []

  class StopAfterSeven:
    def admit(self, ctx):
      seen.append(ctx)
      # x_i does not exist yet: the context holds exactly i drafted tokens.
      assert len(ctx.drafted) == ctx.position
      return 7 not in ctx.drafted

  tokens = iter([3, 7, 1, 2])
  chain = dj.draft_chain(StopAfterSeven(), lambda i, p: next(tokens),
                         max_depth=4, committed=(1, 2), load=0.5)
  assert chain == (3, 7)
  assert [c.position for c in seen] == [0, 1, 2]  # stopped, never asked again
  assert all(c.committed == (1, 2) and c.load == 0.5 for c in seen)
  assert not hasattr(seen[0], "token") and "x" not in seen[0]._fields


def test_fixed_depth_validation():
  with pytest.raises(ValueError, match="depth"):
    dj.FixedDepth(depth=0)
  with pytest.raises(TypeError):
    dj.FixedDepth(5)  # keyword-only


def test_selection_bias_exact():
  dist = ref.selection_bias_toy()
  assert dist["fixed_depth"] == [Fraction(1, 2), Fraction(1, 2)]
  assert dist["inspecting"] == [Fraction(3, 4), Fraction(1, 4)]


# Empirical regression through the real ops: q = p uniform on {0, 1}.
_N = stats.samples_for_tv(0.05, df=1)


def _toy_outputs(inspect):
  logits = vc.logits_for(np.full((2, 2), 0.5))
  counts = jnp.asarray([[M // 2, M // 2]], jnp.int32)

  def one(r):
    key = dj.round_key(77, 0, r)
    x1 = dj.sample_counts(counts[0], dj.draw24(
        dj.draw_key(key, 0, dj.Domain.PROPOSAL)))
    accepted, token, _ = dj.verify_chain(logits, dj.DenseQ(counts),
                                         x1[None], key)
    emitted = jnp.where(accepted > 0, x1, token)
    if not inspect:
      return emitted
    # The biased scheduler looked at x_1 and dropped it unless it was 0.
    fallback, _ = dj.sample_target(
        logits[0], dj.draw_key(key, 0, dj.Domain.TARGET_ONLY))
    return jnp.where(x1 == 0, emitted, fallback)

  return np.asarray(jax.vmap(one)(jnp.arange(_N)))


@pytest.mark.parametrize("inspect,expected", [(False, [0.5, 0.5]),
                                              (True, [0.75, 0.25])])
def test_selection_bias_empirical(inspect, expected):
  tokens = _toy_outputs(inspect)
  stat, pvalue, observed = stats.chi_square(tokens, expected)
  stats.report(f"selection toy inspect={inspect}", observed, expected, stat,
               pvalue)
  assert pvalue > stats.ALPHA
  # The same harness rejects the other hypothesis: it has power here.
  other = [0.75, 0.25] if not inspect else [0.5, 0.5]
  assert stats.chi_square(tokens, other)[1] < stats.ALPHA
