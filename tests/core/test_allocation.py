"""allocate_dense / allocate_sparse against the exact oracle, bit for bit.

Tests of batched calls take `row_mode` (tests/conftest.py): they run in the
"loop" and the "batched" row mode.
"""

import functools

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import allocation
from dyadic_jax import reducer
from dyadic_jax import reference as ref
from dyadic_jax import rowwise
from dyadic_jax.testing import adversarial

M = dj.M
S = dj.Status


def _dense(w):
  counts, status = dj.allocate_dense(np.asarray(w, np.float64)[None])
  return np.asarray(counts[0]).tolist(), int(status[0])


def _sparse(w, k):
  ids, counts, n, status = dj.allocate_sparse(
      np.asarray(w, np.float64)[None], k)
  return (np.asarray(ids[0]).tolist(), np.asarray(counts[0]).tolist(),
          int(n[0]), int(status[0]))


def _assert_dense_matches_oracle(w):
  want_counts, want_status = ref.allocate_dense(w)
  got_counts, got_status = _dense(w)
  assert got_status == want_status
  assert got_counts == want_counts
  if want_status == S.OK:
    assert sum(got_counts) == M


def _assert_sparse_matches_oracle(w, k):
  want = ref.allocate_sparse(w, k)
  got = _sparse(w, k)
  assert got == (want[0], want[1], want[2], int(want[3]))


_normalized = adversarial.normalized
_ADVERSARIAL = adversarial.allocation_rows()
_PAD = 512  # rows padded with zero weights to one shape: one compile per op


def _padded_batch(rows):
  return adversarial.pad_rows(list(rows), _PAD)


# Keyed on the row mode: a result computed in one mode must not stand in
# for the other's.
@functools.lru_cache(maxsize=None)
def _dense_adversarial(mode):
  del mode
  counts, status = dj.allocate_dense(_padded_batch(w for _, w in _ADVERSARIAL))
  return np.asarray(counts), np.asarray(status)


@functools.lru_cache(maxsize=None)
def _sparse_adversarial(k, mode):
  del mode
  return tuple(np.asarray(a) for a in dj.allocate_sparse(
      _padded_batch(w for _, w in _ADVERSARIAL), k))


@pytest.mark.qualify
@pytest.mark.parametrize("row", range(len(_ADVERSARIAL)),
                         ids=[name for name, _ in _ADVERSARIAL])
def test_dense_adversarial_matches_oracle(row, row_mode):
  w = np.pad(_ADVERSARIAL[row][1], (0, _PAD - len(_ADVERSARIAL[row][1])))
  counts, status = _dense_adversarial(row_mode)
  want_counts, want_status = ref.allocate_dense(w)
  assert int(status[row]) == want_status == S.OK
  assert counts[row].tolist() == want_counts


def test_oracle_check_fails_a_moved_ticket(monkeypatch):
  # Power of the qualification's oracle check: a batched allocate_dense
  # that moves one ticket of row 0 to the next id fails it, and the loop
  # mode (which the mutant leaves alone) still passes. The mutant works on
  # the op's output, so no jit cache holds it after the test, and the
  # check runs uncached so that it neither reads nor keeps a result.
  exact = dj.allocate_dense

  def moved_ticket(w, *args, **kwargs):
    counts, status = exact(w, *args, **kwargs)
    if rowwise.row_mode() != "batched" or np.ndim(w) < 2 or len(w) < 2:
      return counts, status
    counts = np.array(counts)
    top = counts[0].argmax()
    counts[0, top] -= 1
    counts[0, (top + 1) % counts.shape[-1]] += 1
    return counts, status

  monkeypatch.setattr(dj, "allocate_dense", moved_ticket)
  monkeypatch.setitem(globals(), "_dense_adversarial",
                      _dense_adversarial.__wrapped__)
  with rowwise.scope("batched") as mode:
    with pytest.raises(AssertionError):
      test_dense_adversarial_matches_oracle(0, mode)
  with rowwise.scope("loop") as mode:
    test_dense_adversarial_matches_oracle(0, mode)


@functools.lru_cache(maxsize=None)
def _random_rows(v, n, seed):
  rng = np.random.default_rng(seed)
  return np.stack([_normalized(np.exp(rng.normal(size=v) *
                                      rng.uniform(0.1, 12)))
                   for _ in range(n)])


@pytest.mark.qualify
@pytest.mark.usefixtures("row_mode")
def test_dense_random_matches_oracle():
  w = _random_rows(1999, 12, 0)
  counts, status = dj.allocate_dense(w)
  for i in range(len(w)):
    want_counts, want_status = ref.allocate_dense(w[i])
    assert int(status[i]) == want_status
    assert np.asarray(counts[i]).tolist() == want_counts, f"row {i}"


@pytest.mark.parametrize("v", [1, 2, 3, 255, 256, 257])
def test_dense_small_and_block_edge_sizes(v):
  _assert_dense_matches_oracle(_random_rows(v, 1, v)[0])


def test_dense_all_equal_full_vocab():
  v = dj.DEFAULT_VOCAB
  counts, status = _dense(np.full(v, 1 / v))
  assert status == S.OK
  base, extra = divmod(M, v)
  # Every remainder is equal, so the lowest ids take the extra tickets.
  assert counts == [base + 1] * extra + [base] * (v - extra)


@pytest.mark.qualify
def test_dense_large_random_matches_oracle():
  rng = np.random.default_rng(7)
  w = _normalized(np.exp(rng.normal(size=dj.DEFAULT_VOCAB) * 3))
  _assert_dense_matches_oracle(w)


@pytest.mark.qualify
@pytest.mark.usefixtures("row_mode")
def test_dense_batch_equals_rows():
  rng = np.random.default_rng(3)
  w = np.stack([_normalized(rng.random(50)) for _ in range(6)]).reshape(
      2, 3, 50)
  counts, status = dj.allocate_dense(w)
  assert counts.shape == (2, 3, 50) and status.shape == (2, 3)
  for i in range(2):
    for j in range(3):
      assert np.asarray(counts[i, j]).tolist() == ref.allocate_dense(
          w[i, j])[0]


@pytest.mark.parametrize("w,status", [
    ([0.5, np.nan, 0.5], S.NAN),
    ([0.5, np.inf, 0.5], S.INF),
    ([0.5, -np.inf, 0.5], S.INF),
    ([0.75, -0.25, 0.5], S.NEGATIVE),
    ([0.0, 0.0, 0.0], S.ZERO_MASS),
    ([0.5, 0.5, 0.5], S.INCONSISTENT_MASS),      # sum 1.5: R < 0
    ([0.25, 0.25, 0.25], S.INCONSISTENT_MASS),   # sum 0.75: R too large
    ([1e-30, 1e-30], S.INCONSISTENT_MASS),       # near-zero total
    ([3.0, -2.0], S.NEGATIVE),
    ([1.0 + 2 ** -20, 0.0], S.INCONSISTENT_MASS),  # 16 tickets too many
])
def test_dense_refusals(w, status):
  counts, got = _dense(w)
  assert got == status
  assert counts == [0] * len(w)
  assert ref.allocate_dense(w)[1] == status


def test_dense_one_ticket_slack_is_exact():
  # Sum off by less than one ticket is accepted, one full ticket is refused.
  w = np.array([0.5, 0.5 - 0.9 / M])
  assert _dense(w)[1] == S.OK == ref.allocate_dense(w)[1]
  w = np.array([0.5, 0.5 - 1.0 / M])
  assert _dense(w)[1] == S.INCONSISTENT_MASS == ref.allocate_dense(w)[1]


@pytest.mark.usefixtures("row_mode")
def test_dense_status_is_per_row():
  w = np.array([[0.5, 0.5], [np.nan, 1.0], [1.0, 0.0]])
  counts, status = dj.allocate_dense(w)
  assert np.asarray(status).tolist() == [S.OK, S.NAN, S.OK]
  assert np.asarray(counts).tolist() == [[M // 2, M // 2], [0, 0], [M, 0]]


def test_dense_float32_input_is_widened_exactly():
  w32 = np.array([0.1, 0.2, 0.7], np.float32)
  counts, status = dj.allocate_dense(w32[None])
  want, want_status = ref.allocate_dense(w32.astype(np.float64))
  assert int(status[0]) == want_status
  assert np.asarray(counts[0]).tolist() == want


@pytest.mark.qualify
@pytest.mark.parametrize("k", [1, 2, 5, 32])
@pytest.mark.parametrize("row", range(len(_ADVERSARIAL)),
                         ids=[name for name, _ in _ADVERSARIAL])
def test_sparse_adversarial_matches_oracle(row, k, row_mode):
  w = np.pad(_ADVERSARIAL[row][1], (0, _PAD - len(_ADVERSARIAL[row][1])))
  ids, counts, n, status = _sparse_adversarial(k, row_mode)
  want = ref.allocate_sparse(w, k)
  assert (ids[row].tolist(), counts[row].tolist(), int(n[row]),
          int(status[row])) == (want[0], want[1], want[2], int(want[3]))


@pytest.mark.qualify
@pytest.mark.usefixtures("row_mode")
@pytest.mark.parametrize("k", [37, 300])
def test_sparse_random_matches_oracle(k):
  w = _random_rows(2999, 10, 100)
  ids, counts, n, status = dj.allocate_sparse(w, k)
  for i in range(len(w)):
    want = ref.allocate_sparse(w[i], k)
    assert (np.asarray(ids[i]).tolist(), np.asarray(counts[i]).tolist(),
            int(n[i]), int(status[i])) == (want[0], want[1], want[2],
                                           int(want[3])), f"row {i}"


def test_sparse_ties_straddling_k_go_to_lowest_ids():
  w = _normalized([1, 3, 2, 2, 2, 2, 0.5])
  ids, counts, n, status = _sparse(w, 3)
  assert status == S.OK and n == 3
  assert ids == [1, 2, 3]  # 3 first, then the two lowest of the tied 2s
  _assert_sparse_matches_oracle(w, 3)


def test_sparse_float32_ties_resolved_in_float64():
  # Distinct float64 weights that round to the same float32 key: the exact
  # path must order them by their float64 values, not by id.
  base = 0.01
  w = np.array([base, base * (1 + 2 ** -40), base * (1 + 2 ** -41), 0.5,
                base * (1 + 2 ** -39)])
  w = w / w.sum()
  assert len(set(w[[0, 1, 2, 4]].astype(np.float32).tolist())) == 1
  ids, _, _, _ = _sparse(w, 3)
  assert ids == [1, 3, 4]
  _assert_sparse_matches_oracle(w, 3)


def test_sparse_fewer_positive_than_k():
  w = np.zeros(100)
  w[[7, 70, 3]] = [0.5, 0.25, 0.25]
  ids, counts, n, status = _sparse(w, 32)
  assert status == S.OK and n == 3
  assert ids[:3] == [3, 7, 70] and ids[3:] == [-1] * 29
  assert counts[:3] == [M // 4, M // 2, M // 4] and counts[3:] == [0] * 29


def test_sparse_drops_zero_counts():
  # The 4th support entry is far below one ticket after renormalization.
  w = _normalized([0.5, 0.3, 0.2, 1e-12, 0.0])
  ids, counts, n, status = _sparse(w, 4)
  assert status == S.OK and n == 3
  assert ids == [0, 1, 2, -1] and counts[3] == 0 and sum(counts) == M


def test_sparse_full_vocab_all_equal_uses_lowest_ids():
  v = dj.DEFAULT_VOCAB
  ids, counts, n, status = _sparse(np.full(v, 1 / v), 32)
  assert status == S.OK and n == 32
  assert ids == list(range(32)) and counts == [M // 32] * 32


@pytest.mark.qualify
def test_sparse_large_random_matches_oracle():
  rng = np.random.default_rng(11)
  w = _normalized(np.exp(rng.normal(size=dj.DEFAULT_VOCAB) * 2))
  for k in (16, 32, 256):
    _assert_sparse_matches_oracle(w, k)


def test_sparse_refusals_and_bad_k():
  for w, status in [([np.nan, 1.0], S.NAN), ([np.inf, 1.0], S.INF),
                    ([-1.0, 2.0], S.NEGATIVE), ([0.0, 0.0], S.ZERO_MASS)]:
    ids, counts, n, got = _sparse(w, 2)
    assert (ids, counts, n, got) == ([-1, -1], [0, 0], 0, status)
  with pytest.raises(ValueError, match="k=0"):
    dj.allocate_sparse(np.ones((1, 4)) / 4, 0)
  with pytest.raises(ValueError, match="k=5"):
    dj.allocate_sparse(np.ones((1, 4)) / 4, 5)


def test_sparse_unnormalized_weights_same_as_normalized_support():
  rng = np.random.default_rng(5)
  w = rng.random(200)
  _assert_sparse_matches_oracle(w * 1e6, 16)


@pytest.mark.qualify
@pytest.mark.usefixtures("row_mode")
def test_vmap_and_single_rows_equal_batched_call():
  # Batched calls run row by row in "loop" mode and at once in "batched"
  # mode (dyadic_jax/rowwise.py), vmapped calls fold the vmapped axis into
  # those rows, single rows run directly: all must agree bit for bit.
  w = _random_rows(300, 6, 21).reshape(2, 3, 300)
  batched = dj.allocate_dense(w)
  chex.assert_trees_all_equal(batched,
                              jax.vmap(jax.vmap(dj.allocate_dense))(w))
  chex.assert_trees_all_equal(
      tuple(a[1, 2] for a in batched), dj.allocate_dense(w[1, 2]))
  sparse = dj.allocate_sparse(w, 7)
  chex.assert_trees_all_equal(
      sparse, jax.vmap(lambda x: dj.allocate_sparse(x, 7))(w))
  chex.assert_trees_all_equal(
      tuple(a[0, 1] for a in sparse), dj.allocate_sparse(w[0, 1], 7))


# ---------------------------------------------------------------------------
# Signs and subnormals are judged on bit patterns (XLA CPU flushes float64
# subnormals to zero in compares: -1e-310 < 0 is false there).


@pytest.mark.parametrize("w,status", [
    ([0.5, 0.5, -1e-310], S.NEGATIVE),             # OK before (flushed)
    ([0.5, 0.5, -5e-324], S.NEGATIVE),
    ([1.0, -0.0, 0.0], S.OK),                      # -0.0 is zero
    ([1.0, 1e-310, 0.0], S.OK),                    # a subnormal is zero
    ([1e-310, 5e-324, 0.0], S.ZERO_MASS),          # only subnormal mass
    ([np.nan, -1e-310, 1.0], S.NAN),               # NaN first
])
def test_sign_and_subnormals_on_bits(w, status):
  counts, got = _dense(w)
  assert got == status == ref.allocate_dense(w)[1]
  assert counts == ref.allocate_dense(w)[0]
  if status == S.OK:
    assert counts[1] == 0 and sum(counts) == M
  ids, scounts, n, got = _sparse(w, 2)
  want = ref.allocate_sparse(w, 2)
  assert (ids, scounts, n, got) == (want[0], want[1], want[2], int(want[3]))
  assert got == status


# ---------------------------------------------------------------------------
# select_top: the threshold search, its three endings, and its cost.


def _select(x, r):
  with jax.enable_x64(True):
    return np.asarray(jax.jit(allocation.select_top)(
        jnp.asarray(x, jnp.float64), jnp.asarray(r, jnp.int64)))


def _passes(x, r, upper=allocation._INF_BITS):
  x = np.asarray(x, np.float64)
  with jax.enable_x64(True):
    red = reducer.local(x.shape[-1])
    return int(jax.jit(lambda x, r: allocation._search(
        x, jnp.maximum(r, 1), upper, red)[1])(
            jnp.asarray(x), jnp.asarray(r, jnp.int64)))


def _top_oracle(x, r):
  order = np.lexsort((np.arange(len(x)), -np.asarray(x, np.float64)))
  mask = np.zeros(len(x), bool)
  mask[order[:r]] = True
  return mask


_KEY_ROWS = {
    "uniform": lambda g, n: g.random(n),
    "skewed": lambda g, n: g.random(n) ** 20,
    "few_values": lambda g, n: g.integers(0, 7, n) / 8.0,
    "all_equal": lambda g, n: np.full(n, 0.25),
    "zeros_and_values": lambda g, n: np.where(g.random(n) < 0.5, 0.0,
                                              g.random(n)),
    "all_zero": lambda g, n: np.zeros(n),
    "two_huge_groups": lambda g, n: np.repeat([0.75, 0.5], [n // 2,
                                                             n - n // 2]),
}


@pytest.mark.parametrize("name", sorted(_KEY_ROWS))
def test_select_top_matches_oracle_every_rank_class(name):
  n = 3000
  x = _KEY_ROWS[name](np.random.default_rng(len(name)), n)
  rs = [0, 1, 2, 63, 64, 65, n // 3, n // 2, n - 1, n]
  got = _select(np.broadcast_to(x, (len(rs), n)), rs)
  for mask, r in zip(got, rs):
    np.testing.assert_array_equal(mask, _top_oracle(x, r), err_msg=str(r))


@hypothesis.given(st.lists(st.sampled_from(
    [0.0, 2.0 ** -1000, 0.25, 0.5, 0.5 + 2.0 ** -52, 0.75, 1.0, 3.0]),
    min_size=1, max_size=200), st.data())
def test_select_top_hypothesis(values, data):
  r = data.draw(st.integers(0, len(values)))
  x = np.zeros(200)
  x[:len(values)] = values
  np.testing.assert_array_equal(_select(x[None], [r])[0],
                                _top_oracle(x, r))


def test_search_work_is_bounded():
  # Work, not time: the number of passes over the row. Typical rows end in
  # a handful; ties end at once; the bound holds for every input.
  rng = np.random.default_rng(0)
  v = dj.DEFAULT_VOCAB
  for scale in (0.3, 1.0, 3.0, 10.0):
    w = _normalized(np.exp(rng.normal(size=v) * scale))
    s = w * M
    r = int(M - np.floor(s).sum())
    assert _passes(s - np.floor(s), r, allocation._ONE_BITS) <= 12, scale
  assert _passes(np.full(v, 0.25), v // 3) <= 4        # one tie group
  assert _passes(rng.integers(0, 7, v) / 8.0, v // 3) <= 6
  worst = np.asarray([2.0 ** -e for e in range(1, 1001)])
  assert _passes(worst, 500) < allocation._MAX_STEPS
