"""experiments/overlap.py: exact acceptance sum min(p, q) against oracles.

Small rows (V = 7 and 64) scored by `row_acceptance` must equal the same
figures computed in exact rationals (`fractions.Fraction`) from the same
p and the same dyadic counts, and numpy's sort for the mass outside the
top k; a sparse q never accepts more than p's own top-k mass (the ceiling
the held-out report prints); `held_out` is `row_acceptance` over every
position of the windows.
"""

import fractions

import jax
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax.models import transformer
from experiments import overlap

_F = fractions.Fraction


def _logits(rng, rows, vocab, scale=3.0):
  return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


@pytest.mark.parametrize("vocab, ks", [(7, [1, 2, 3, 6]), (64, [4, 16, 32])])
def test_acceptance_equals_the_rational_oracle(vocab, ks):
  rng = np.random.default_rng(vocab)
  tl, dl = _logits(rng, 5, vocab), _logits(rng, 5, vocab)
  got = overlap.row_acceptance(tl, dl, ks)
  p = np.asarray(dj.target_probs(tl)[0], np.float64)
  w = np.asarray(dj.draft_weights(dl)[0], np.float64)
  dense = np.asarray(dj.allocate_dense(w)[0])
  for r in range(5):
    pr = [_F(float(x)) for x in p[r]]
    # Dense q = c / M: the rule's acceptance, exactly.
    oracle = sum(min(a, _F(int(c), dj.M)) for a, c in zip(pr, dense[r]))
    assert got["dense"][r] == pytest.approx(float(oracle), abs=1e-15)
    assert sum(_F(int(c), dj.M) for c in dense[r]) == 1
    assert got["ideal"][r] == pytest.approx(
        float(sum(min(a, _F(float(b))) for a, b in zip(pr, w[r]))),
        abs=1e-15)
    for k in ks:
      ids, counts, n, _ = dj.allocate_sparse(w[r:r + 1], k)
      ids, counts, n = (np.asarray(x)[0] for x in (ids, counts, n))
      q = {int(i): _F(int(c), dj.M) for i, c in zip(ids[:n], counts[:n])}
      assert sum(q.values()) == 1 and len(q) <= k
      oracle = sum(min(pr[i], c) for i, c in q.items())
      assert got[f"k{k}"][r] == pytest.approx(float(oracle), abs=1e-15)
      # The ceiling: a q on k ids accepts at most p's top-k mass.
      top = sorted(p[r])[::-1][:k]
      assert got[f"outside_p_k{k}"][r] == pytest.approx(p[r].sum() - sum(top),
                                                        abs=1e-12)
      assert got[f"k{k}"][r] <= p[r].sum() - got[f"outside_p_k{k}"][r] + 1e-12
      top_w = sorted(w[r])[::-1][:k]
      assert got[f"outside_w_k{k}"][r] == pytest.approx(w[r].sum() - sum(top_w),
                                                        abs=1e-12)
    kl = sum(a * (np.log(a) - np.log(b)) for a, b in zip(p[r], w[r]) if a)
    assert got["kl"][r] == pytest.approx(kl, rel=1e-9, abs=1e-12)


def test_identical_rows_accept_everything_dense_and_their_top_k_sparse():
  rng = np.random.default_rng(1)
  logits = _logits(rng, 4, 64)
  got = overlap.row_acceptance(logits, logits, [8])
  # p and w differ only by the two softmaxes' rounding: alpha ~ 1.
  assert np.all(got["ideal"] > 1 - 1e-6) and np.all(got["dense"] > 1 - 1e-5)
  # q = w's top 8 renormalized: alpha = p's mass on those 8 ids.
  assert got["k8"] == pytest.approx(1 - got["outside_p_k8"], abs=1e-5)


def test_temperature_scales_both_rows():
  rng = np.random.default_rng(2)
  tl, dl = _logits(rng, 3, 32), _logits(rng, 3, 32)
  hot = overlap.row_acceptance(tl, dl, [4], temperature=2.0)
  plain = overlap.row_acceptance(tl / 2, dl / 2, [4])
  for name in ("ideal", "dense", "k4", "kl"):
    np.testing.assert_allclose(hot[name], plain[name], rtol=1e-6, atol=1e-7)


def test_held_out_is_every_position_of_the_windows():
  config = transformer.Config(vocab=40, d_model=8, n_layers=1, n_heads=2,
                              d_ff=16, max_len=16)
  target = transformer.init(config, jax.random.key(0))
  draft = transformer.init(config, jax.random.key(1))
  windows = np.random.default_rng(0).integers(0, 40, (3, 10)).astype(np.int32)
  record = overlap.held_out(target, draft, windows, ks=[4, 64], batch=2,
                            chunk=7)
  # One forward of all three windows: the same rows up to float rounding
  # of a batch of another shape.
  rows = overlap.row_acceptance(
      transformer.forward(target, windows).reshape(-1, 40),
      transformer.forward(draft, windows).reshape(-1, 40), [4])
  assert record["positions"] == 30 and "k64" not in record   # k >= V
  for name in ("dense", "ideal", "k4", "kl", "outside_p_k4"):
    assert record[name] == pytest.approx(float(rows[name].mean()), rel=1e-5)
  assert record["k4_share_of_dense"] == pytest.approx(
      record["k4"] / record["dense"])
  assert overlap.table({"before": record, "after": record}, [4])[2].split()[
      -2:] == [f"{record['ideal']:.4f}"] * 2
