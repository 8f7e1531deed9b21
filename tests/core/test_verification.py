"""verify_chain and sample_target against the exact oracle.

Two links tie the implementation to the contract: (1) the oracle's exact
output distribution of the implemented integer rules is within 2^-20 of the
target P / T (in fact within (V + 2) 2^-64), on adversarial (p, q); (2) the
library's decisions equal the oracle's integer replay of the same 64-bit
draws, so the distribution computed in (1) is the library's. Tests of
multi-row calls run in both row modes (`row_mode`, tests/conftest.py).
"""

from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import cumulative
from dyadic_jax import reference as ref
from dyadic_jax import verification
from dyadic_jax import weights
from dyadic_jax.testing import adversarial
from tests import verify_cases as vc

M = dj.M
S = dj.Status
TV_BOUND = Fraction(1, 2 ** 20)


_CASES = adversarial.verification_cases()


@pytest.mark.qualify
@pytest.mark.parametrize("name", sorted(_CASES))
def test_exact_output_distribution_within_bound(name):
  p, q = _CASES[name]
  p_fixed = vc.target_fixed(vc.logits_for(p / p.sum()))[0]
  counts = vc.counts_for(q)
  out = ref.verify_step_distribution(p_fixed, counts)
  target = ref.target_distribution(p_fixed)
  assert sum(out) == 1
  tv = ref.total_variation(out, target)
  assert tv <= TV_BOUND
  assert tv <= Fraction(len(p) + 2, 2 ** 64)  # the proved bound
  # The ideal rational rule reproduces P / T exactly.
  assert ref.ideal_step_distribution(target,
                                     [Fraction(c, M) for c in counts]) == target


def test_exact_bound_on_full_vocabulary():
  rng = np.random.default_rng(9)
  v = dj.DEFAULT_VOCAB
  logits = (rng.normal(size=v) * 3).astype(np.float32)
  p_fixed = vc.target_fixed(logits)[0]
  w, _ = dj.draft_weights((logits + rng.normal(size=v)).astype(np.float32)[
      None])
  ids, counts, n, _ = dj.allocate_sparse(w, 32)
  dense = [0] * v
  for i, c in zip(np.asarray(ids[0])[:int(n[0])],
                  np.asarray(counts[0])[:int(n[0])]):
    dense[int(i)] = int(c)
  out = ref.verify_step_distribution(p_fixed, dense)
  assert ref.total_variation(out, ref.target_distribution(p_fixed)) <= \
      Fraction(v + 2, 2 ** 64)


def _bits(key, position, domain):
  return int(dj.draw64(dj.draw_key(key, position, domain)))


def _oracle_rounds(representation, rounds=48, anchor=17):
  """(logits, q, drafts, keys, the oracle's (accepted, token) per round)."""
  rng = np.random.default_rng(12)
  v, depth = 12, 3
  # Draft close to the target on some rows so every outcome occurs.
  p = rng.dirichlet(np.ones(v) * 0.7, size=depth + 1)
  q = np.where(rng.random((depth, v)) < 0.3, 0.0, p[:depth] + 0.05)
  logits = vc.logits_for(p)
  p_rows = vc.target_fixed(logits)
  count_rows = [vc.counts_for(row) for row in q]
  qobj = (dj.DenseQ(np.asarray(count_rows, np.int32)) if representation ==
          "dense" else vc.sparse_q(count_rows))
  drafts, keys, wants = [], [], []
  for r in range(rounds):
    key = dj.round_key(5, 0, r)
    draft = [ref.sample_counts(count_rows[i], int(rng.integers(0, M)))
             for i in range(depth)]
    drafts.append(draft)
    keys.append(key)
    wants.append(ref.verify_chain_replay(
        p_rows, count_rows, draft,
        [_bits(key, anchor + i, dj.Domain.ACCEPT) for i in range(depth)],
        [_bits(key, anchor + i, dj.Domain.CORRECTION) for i in range(depth)],
        _bits(key, anchor + depth, dj.Domain.BONUS)))
  return logits, qobj, np.asarray(drafts, np.int32), keys, wants


@pytest.mark.qualify
@pytest.mark.usefixtures("row_mode")
@pytest.mark.parametrize("representation", ["dense", "sparse"])
def test_decisions_equal_oracle_replay(representation):
  logits, qobj, drafts, keys, wants = _oracle_rounds(representation)
  for r, (draft, key, want) in enumerate(zip(drafts, keys, wants)):
    got = dj.verify_chain(logits, qobj, draft, key, anchor=17)
    assert int(got[2]) == dj.Status.OK
    assert (int(got[0]), int(got[1])) == want, f"round {r}"
  # Rejections at every position, and all accepted.
  assert {w[0] for w in wants} == set(range(drafts.shape[1] + 1))


@pytest.mark.qualify
@pytest.mark.usefixtures("row_mode")
@pytest.mark.parametrize("representation", ["dense", "sparse"])
def test_verify_batch_equals_oracle_replay(representation):
  """The 48 rounds as one batch of 48 requests, each held to the oracle."""
  logits, qobj, drafts, keys, wants = _oracle_rounds(representation)
  b = len(keys)
  accepted, token, status = dj.verify_batch(
      np.stack([logits] * b), jax.tree.map(lambda a: np.stack([a] * b), qobj),
      drafts, jnp.stack(keys), np.full(b, 17))
  assert not np.any(np.asarray(status))
  assert list(zip(np.asarray(accepted).tolist(),
                  np.asarray(token).tolist())) == wants


def test_vmap_over_requests_equals_single_calls():
  rng = np.random.default_rng(2)
  v, depth, requests = 40, 4, 5
  logits = rng.normal(size=(requests, depth + 1, v)).astype(np.float32)
  w, _ = dj.draft_weights(logits[:, :depth] + 0.3 * rng.normal(
      size=(requests, depth, v)).astype(np.float32))
  ids, counts, n, _ = dj.allocate_sparse(w, 8)
  draft = np.asarray(ids)[..., 0]
  keys = jax.vmap(lambda s: dj.round_key(s, 1, 2))(np.arange(requests))
  anchors = np.arange(requests) * 100
  q = dj.SparseQ(ids, counts, n)
  batched = jax.vmap(lambda *a: dj.verify_chain(*a[:4], anchor=a[4]))(
      logits, q, draft, keys, anchors)
  for i in range(requests):
    single = dj.verify_chain(logits[i], dj.SparseQ(ids[i], counts[i], n[i]),
                             draft[i], keys[i], anchor=int(anchors[i]))
    chex.assert_trees_all_equal(single, tuple(b[i] for b in batched))


def _chain(logits, q, draft, key=None):
  key = dj.round_key(0, 0, 0) if key is None else key
  return tuple(int(x) for x in dj.verify_chain(logits, q, np.asarray(
      draft, np.int32), key))


@pytest.mark.usefixtures("row_mode")
def test_refused_inputs_give_sentinel_and_status():
  p = np.full((3, 4), 0.25)
  logits = vc.logits_for(p)
  good = dj.DenseQ(np.full((2, 4), M // 4, np.int32))
  accepted, token, status = _chain(logits, good, [0, 1])
  assert token >= 0 and status == S.OK
  bad_logits = logits.copy()
  bad_logits[2, 1] = np.nan
  assert _chain(bad_logits, good, [0, 1]) == (0, -1, S.NAN)
  bad_logits[1, 0] = np.inf  # the first refused target row wins
  assert _chain(bad_logits, good, [0, 1]) == (0, -1, S.INF)
  masked = logits.copy()
  masked[0] = -np.inf
  assert _chain(masked, good, [0, 1]) == (0, -1, S.ZERO_MASS)
  wrong_sum = dj.DenseQ(good.counts.copy())
  wrong_sum.counts[1, 0] += 1
  assert _chain(logits, wrong_sum, [0, 1]) == (0, -1, S.WRONG_MASS)
  negative = dj.DenseQ(good.counts.copy())
  negative.counts[1] = [M // 2, M // 2, M // 4, -(M // 4)]
  assert _chain(logits, negative, [0, 1]) == (0, -1, S.NEGATIVE)
  above = dj.DenseQ(good.counts.copy())
  above.counts[0] = [M + M // 2, -(M // 2), 0, 0]  # NEGATIVE comes first
  assert _chain(logits, above, [0, 1]) == (0, -1, S.NEGATIVE)
  # A target row refusal is reported before a q row refusal.
  assert _chain(bad_logits, negative, [0, 1])[2] == S.INF


_GOOD_SPARSE = ([[0, 2, -1], [1, 3, -1]], [[M // 2, M // 2, 0]] * 2, [2, 2])


@pytest.mark.parametrize("name,edit,status", [
    ("ok", lambda ids, c, n: None, S.OK),
    ("missing", lambda ids, c, n: n.__setitem__(1, 0), S.MISSING_Q),
    ("id_out_of_range", lambda ids, c, n: ids.__setitem__((1, 1), 4),
     S.ID_OUT_OF_RANGE),
    ("duplicate", lambda ids, c, n: ids.__setitem__((0, 1), 0),
     S.DUPLICATE_ID),
    ("unsorted", lambda ids, c, n: ids.__setitem__(0, [2, 0, -1]),
     S.UNSORTED_IDS),
    ("negative", lambda ids, c, n: c.__setitem__(1, [M, -1, 0]),
     S.NEGATIVE),
    ("wrong_mass", lambda ids, c, n: c.__setitem__((1, 0), 1), S.WRONG_MASS),
    ("above_m", lambda ids, c, n: c.__setitem__(1, [2 * M, 0, 0]),
     S.WRONG_MASS),
])
def test_sparse_q_statuses(name, edit, status):
  del name
  logits = vc.logits_for(np.full((3, 4), 0.25))
  ids, counts, n = (np.asarray(a, np.int32) for a in _GOOD_SPARSE)
  edit(ids, counts, n)
  accepted, token, got = _chain(logits, dj.SparseQ(ids, counts, n), [0, 1])
  assert got == status
  if status != S.OK:
    assert (accepted, token) == (0, -1)
  else:
    assert token >= 0


def test_depth_zero_is_the_target_only_bonus_draw():
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(64, 1, 9)).astype(np.float32)
  logits[:, :, 4] = -np.inf
  keys = jax.vmap(lambda r: dj.round_key(11, 0, r))(np.arange(64))
  anchors = np.arange(64) * 3
  empty = dj.DenseQ(np.zeros((64, 0, 9), np.int32))
  accepted, token, status = jax.vmap(
      lambda t, q, key, a: dj.verify_chain(t, q, np.zeros(0, np.int32), key,
                                           anchor=a))(logits, empty, keys,
                                                      anchors)
  bonus_keys = jax.vmap(lambda k, a: dj.draw_key(k, a, dj.Domain.BONUS))(
      keys, anchors)
  want, want_status = dj.sample_target(logits[:, 0], bonus_keys)
  np.testing.assert_array_equal(np.asarray(token), np.asarray(want))
  assert not np.any(np.asarray(accepted)) and not np.any(np.asarray(status))
  assert np.all(np.asarray(token) != 4) and not np.any(np.asarray(want_status))
  # q may be None (and a sparse q with no rows is accepted too).
  single = _chain(logits[0], None, [], keys[0])
  sparse = dj.SparseQ(np.zeros((0, 3), np.int32), np.zeros((0, 3), np.int32),
                      np.zeros(0, np.int32))
  assert single == _chain(logits[0], sparse, [], keys[0]) == (
      0, int(token[0]), S.OK)
  bad = logits[0].copy()
  bad[0, 0] = np.nan
  assert _chain(bad, None, [], keys[0]) == (0, -1, S.NAN)


@pytest.mark.usefixtures("row_mode")
def test_zero_q_or_out_of_range_draft_is_rejected():
  logits = vc.logits_for(np.full((3, 4), 0.25))
  q = dj.DenseQ(np.array([[0, M // 2, M // 2, 0]] * 2, np.int32))
  for r in range(20):
    key = dj.round_key(1, 0, r)
    for bad in (0, 3, 4, -1):
      accepted, token, status = dj.verify_chain(logits, q, np.array([bad, 1]),
                                                key)
      assert int(accepted) == 0 and 0 <= int(token) < 4
      assert int(status) == S.OK


def test_shape_errors():
  logits = np.zeros((3, 4), np.float32)
  q = dj.DenseQ(np.full((2, 4), M // 4, np.int32))
  key = dj.round_key(0, 0, 0)
  with pytest.raises(ValueError, match="D\\+1"):
    dj.verify_chain(logits[:2], q, np.array([0, 1]), key)
  with pytest.raises(ValueError, match="columns"):
    dj.verify_chain(np.zeros((3, 5), np.float32), q, np.array([0, 1]), key)
  with pytest.raises(TypeError, match="DenseQ or SparseQ"):
    dj.verify_chain(logits, np.zeros((2, 4)), np.array([0, 1]), key)
  with pytest.raises(TypeError, match="DenseQ or SparseQ"):
    dj.verify_chain(logits, None, np.array([0, 1]), key)  # None only at D=0
  with pytest.raises(ValueError, match="D\\+1"):
    dj.verify_chain(logits, q, np.int32(0), key)
  with pytest.raises(ValueError, match="sparse q"):
    dj.verify_chain(logits, dj.SparseQ(np.zeros((2, 3), np.int32),
                                       np.zeros((2, 3), np.int32),
                                       np.zeros(3, np.int32)),
                    np.array([0, 1]), key)


@pytest.mark.qualify
@pytest.mark.usefixtures("row_mode")
def test_target_only_sampler_replay_and_distribution():
  rng = np.random.default_rng(3)
  p = rng.dirichlet(np.ones(9), size=64)
  p[:, 4] = 0.0
  logits = vc.logits_for(p / p.sum(-1, keepdims=True))
  p_rows = vc.target_fixed(logits)
  keys = jax.vmap(lambda i: dj.rng_key(9, 0, 0, i, dj.Domain.TARGET_ONLY))(
      np.arange(64))
  tokens, status = dj.sample_target(logits, keys)
  assert np.all(np.asarray(status) == 0)
  bits = np.asarray(dj.draw64(keys))
  for row, b, t in zip(p_rows, bits, np.asarray(tokens)):
    assert int(t) == ref.sample_counts(row, (int(b) * sum(row)) >> 64)
    assert int(t) != 4
  dist = ref.categorical_int_distribution(p_rows[0])
  assert ref.total_variation(dist, ref.target_distribution(p_rows[0])) <= \
      Fraction(9, 2 ** 64)


def test_recomputed_residual_row_is_the_row_of_target_probs():
  # Verification keeps only each row's max, Z' and T; the one row it needs
  # whole is recomputed from the logits (docs/numerics.md 6.1). Its P must
  # be the P that entered T: quantize_target(target_probs(...)).
  rng = np.random.default_rng(8)
  v = dj.DEFAULT_VOCAB
  logits = (rng.normal(size=(3, v)) * np.array([[1.0], [6.0], [30.0]])
            + 2e4 * (np.arange(3) == 2)[:, None]).astype(np.float32)
  logits[0, ::3] = -np.inf
  probs, _ = dj.target_probs(logits)
  with jax.enable_x64(True):
    want, want_total = dj.quantize_target(probs)
    rows, _ = jax.jit(weights.target_summary)(
        logits, jnp.zeros(3, jnp.int32))
    got = jax.jit(lambda x, r: jax.vmap(
        lambda i: verification.fixed_row(x, r, i))(jnp.arange(3)))(
            logits, rows)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(rows.total).astype(np.int64),
                                np.asarray(want_total))


@pytest.mark.parametrize("v", [7, 256, 1001, dj.DEFAULT_VOCAB])
def test_residual_limbs_scan_as_the_int64_residual(v):
  # residual_weights never forms W = max(P M - c T, 0) as an int64 row
  # (docs/numerics.md 6.2): its limbs must scan exactly as that row does,
  # at the boundaries of W's cumulative sums, including the P M fallback
  # when W is all zero (q = P / T exactly) and the bonus row (c = 0).
  rng = np.random.default_rng(v)
  with jax.enable_x64(True):
    logits = (rng.normal(size=(1, v)) * 4).astype(np.float32)
    want_p, total = dj.quantize_target(dj.target_probs(logits)[0])
    p = np.asarray(want_p[0], np.int64)
    total = int(total[0])
    # A valid q (sum M) near p, one equal to P / T where T divides into M
    # (W = 0 everywhere: the fallback), and the bonus row's c = 0.
    c_near = np.asarray(dj.allocate_dense(dj.draft_weights(
        logits + rng.normal(size=(1, v)).astype(np.float32))[0])[0][0],
                        np.int64)
    cases = {"near": (p, total, c_near), "bonus": (p, total, np.zeros(v, int))}
    if v == 7:
      p_eq = np.asarray([1, 0, 3, 0, 0, 4, 0], np.int64) << 35
      cases["fallback"] = (p_eq, int(p_eq.sum()), p_eq * M // p_eq.sum())
    for name, (p_row, t, c) in cases.items():
      w = np.maximum(p_row * M - c * t, 0)
      if not w.any():
        w = p_row * M
      cum = np.cumsum(w)
      us = sorted({0, int(cum[-1]) - 1} | {int(x) + d for x in cum[:-1]
                                             for d in (-1, 0, 1)
                                             if 0 <= int(x) + d < cum[-1]})
      us = np.asarray(us[:300] + us[-300:], np.int64)
      blocked = verification.residual_weights(
          jnp.asarray(p_row, jnp.float64), jnp.asarray(c), jnp.int64(t))
      assert int(blocked.cum[-1]) == int(cum[-1]), name
      got = jax.vmap(lambda u: cumulative.scan(blocked, u))(jnp.asarray(us))
      want = np.searchsorted(cum, us, side="right")
      np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


def _bound_rows(v, rng):
  """Score rows that push T away from 2^38: every term truncated in Z'
  (terms below 2^-9 carry bits under 2^-32), one dominant term (Z' near
  1, where 64 V / Z' is largest), all-equal terms (Z' = V, nothing
  truncated) and plain random rows."""
  rows = [rng.normal(size=v) * 4,
          np.where(np.arange(v) == 0, 0.0, -7.0 - rng.random(v)),
          np.where(np.arange(v) == 0, 0.0, -12.0 + 0.1 * rng.random(v)),
          np.zeros(v),
          np.where(np.arange(v) % 2 == 0, 0.0, -rng.random(v) * 80)]
  return np.asarray(rows, np.float32)


@pytest.mark.parametrize("v", [1, 2, 7, 1001, dj.DEFAULT_VOCAB, dj.MAX_VOCAB])
def test_total_bounds_bracket_the_total(v):
  # The walk's ACCEPT test decides from weights.total_bounds alone unless
  # the draw falls between them (docs/numerics.md 6.2): they must bracket
  # T on every row. The rows move T off 2^38 by up to tens of thousands of
  # units (asserted below, so a bound of (2^38, 2^38) would fail here).
  logits = _bound_rows(v, np.random.default_rng(v))
  with jax.enable_x64(True):
    rows, _ = jax.jit(weights.target_rows)(logits)
    lo, hi = weights.total_bounds(rows.inv, v)
    total = np.asarray(rows.total).astype(np.int64)
    lo, hi = np.asarray(lo), np.asarray(hi)
  assert np.all(rows.status == S.OK)
  assert np.all(lo <= total) and np.all(total <= hi), (lo, total, hi)
  if v >= 1001:
    assert np.max(np.abs(total - 2 ** dj.TARGET_BITS)) > v // 8, total
    # Tight enough to decide almost every draw: hi - lo <= V + 64 V / Z'
    # + 4 <= 65 V + 4, a fraction 2^-14 of T at V = 2^18.
    assert np.all(hi - lo <= 65 * v + 4), (hi - lo)


def test_accepts_uses_the_total_only_between_the_bounds():
  # verification.accepts(bits, c, p, (lo, hi), total) must be the exact
  # test draw_below(bits, T c) < P M for T in [lo, hi], calling total()
  # only where the bounds cannot decide. total() returns a poisoned T
  # (outside the bounds): a verdict that follows the poison shows the exact
  # branch ran; everywhere else the verdict must be the true T's.
  rng = np.random.default_rng(11)
  two64 = 2 ** 64
  cases = []
  for _ in range(400):
    t = 2 ** 38 + int(rng.integers(-2 ** 17, 2 ** 20))
    c = int(rng.integers(1, M + 1))
    p = int(rng.integers(0, min(2 ** 38, t * c // M + 2 ** 30)))
    width = int(rng.integers(0, 2 ** 18))
    lo, hi = t - int(rng.integers(0, width + 1)), t + width
    # Bits near the cut of the true T, of lo and of hi, and uniform.
    cuts = [(p * M * two64) // (n * c) for n in (t, lo, hi)]
    for b in [int(rng.integers(0, 2 ** 63)) * 2 + int(rng.integers(2))] + [
        min(max(x + d, 0), two64 - 1) for x in cuts for d in (-1, 0, 1)]:
      cases.append((b, c, p, lo, hi, t))
  b, c, p, lo, hi, t = (np.asarray([x[i] for x in cases], np.uint64 if i == 0
                                   else np.int64) for i in range(6))
  poison = np.full_like(t, 2 ** 38 + 2 ** 30)   # above every hi

  with jax.enable_x64(True):
    def verdict(b, c, p, lo, hi, total):
      return jax.vmap(lambda *a: verification.accepts(
          a[0], a[1], a[2], (a[3], a[4]), lambda: a[5]))(b, c, p, lo, hi,
                                                          total)
    got = np.asarray(jax.jit(verdict)(b, c, p, lo, hi, jnp.asarray(t)))
    # Without vmap the cond is a real branch: run a sample one by one.
    one = jax.jit(lambda *a: verification.accepts(
        a[0], a[1], a[2], (a[3], a[4]), lambda: a[5]))
    sample = rng.choice(len(cases), 300, replace=False)
    poisoned = {i: bool(one(b[i], c[i], p[i], lo[i], hi[i], poison[i]))
                for i in sample}
  want = [(bi * (ti * ci)) // two64 < pi * M
          for bi, ci, pi, ti in zip(b.tolist(), c.tolist(), p.tolist(),
                                    t.tolist())]
  assert got.tolist() == want
  branch = 0
  for i, v in poisoned.items():
    bi, ci, pi = int(b[i]), int(c[i]), int(p[i])
    sure = ((bi * int(hi[i]) * ci) // two64 < pi * M
            or (bi * int(lo[i]) * ci) // two64 >= pi * M)
    if sure:
      assert v == want[i], i
    else:
      branch += 1
      assert v == ((bi * int(poison[i]) * ci) // two64 < pi * M), i
  assert branch > 10, branch   # the near-cut bits reach the exact branch
