"""The 24-bit draw-to-token map against the oracle, at every boundary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import cumulative
from dyadic_jax import draws
from dyadic_jax import reference as ref

M = dj.M


def _boundary_draws(counts):
  cum = np.cumsum(counts)
  pts = {0, M - 1}
  for c in cum[:-1]:
    pts.update({int(c) - 1, int(c), int(c) + 1})
  return sorted(p for p in pts if 0 <= p < M)


_ROWS = {
    "one_hot": [0, 0, M, 0],
    "two": [1, M - 1],
    "zeros_between": [5, 0, 0, M - 10, 0, 5],
    "uniform_8": [M // 8] * 8,
    "single": [M],
}


@pytest.mark.parametrize("name", sorted(_ROWS))
def test_every_boundary_draw_maps_as_oracle(name):
  counts = np.asarray(_ROWS[name], np.int32)
  pts = _boundary_draws(counts)
  got = dj.sample_counts(np.broadcast_to(counts, (len(pts), len(counts))),
                         np.asarray(pts, np.uint32))
  want = [ref.sample_counts(counts, p) for p in pts]
  assert np.asarray(got).tolist() == want
  assert all(counts[v] > 0 for v in want)  # zero counts never drawn


def test_exhaustive_small_row_counts_exactly():
  # With M = 2^24 draws, token v must come up exactly c_v times.
  counts = np.asarray([3, 0, M - 7, 4], np.int32)
  allu = np.arange(M, dtype=np.uint32)
  with pytest.raises(ValueError, match="batch shape"):
    dj.sample_counts(np.broadcast_to(counts, (1, 4)), allu[None, :1])
  with jax.enable_x64(True):
    tokens = np.asarray(jax.jit(jax.vmap(
        lambda u: cumulative.first_cum_greater(jnp.asarray(counts), u)))(allu))
  np.testing.assert_array_equal(np.bincount(tokens, minlength=4), counts)


@pytest.mark.parametrize("v", [255, 256, 257, 129280])
def test_multi_block_rows_match_oracle(v):
  rng = np.random.default_rng(v)
  w = rng.random(v) * (rng.random(v) < 0.3)
  counts, _ = dj.allocate_dense((w / w.sum())[None])
  counts = np.asarray(counts[0])
  pts = np.concatenate([_boundary_draws(counts)[:200],
                        _boundary_draws(counts)[-200:],
                        rng.integers(0, M, 50)]).astype(np.uint32)
  got = np.asarray(dj.sample_counts(np.broadcast_to(counts, (len(pts), v)),
                                    pts))
  assert got.tolist() == [ref.sample_counts(counts, int(p)) for p in pts]


def test_draw_beyond_total_returns_length():
  got = dj.sample_counts(np.array([[1, 2, 3]], np.int32),
                         np.array([6], np.uint32))
  assert int(got[0]) == 3


def test_draw_below_matches_exact_interval_map():
  rng = np.random.default_rng(0)
  bits = rng.integers(0, 2 ** 64, 1000, dtype=np.uint64)
  bits[:3] = [0, 2 ** 64 - 1, 2 ** 63]
  for n in [1, 3, 2 ** 62 - 1, 12345678901234]:
    with jax.enable_x64(True):
      got = np.asarray(draws.draw_below(jnp.asarray(bits),
                                        jnp.asarray(n, jnp.uint64)))
    assert got.tolist() == [(int(b) * n) >> 64 for b in bits]
