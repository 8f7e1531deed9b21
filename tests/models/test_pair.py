"""The protocol adapters: cached rows equal recompute, rollback is free.

A tiny random-init transformer stands for both models (the adapters'
bookkeeping does not depend on the weights). The reference for every row
is one uncached `forward` over the whole sequence, padded to max_len so it
compiles once (causal: the padding changes no earlier row).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dyadic_jax.models import pair
from dyadic_jax.models import transformer as tf

TOL = 1e-4  # float32 rounding; logits are O(1)
D = 4
V = 53
CONFIG = tf.Config(vocab=V, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                   max_len=320)


@pytest.fixture(scope="module")
def params():
  return tf.init(CONFIG, jax.random.key(7))


@pytest.fixture(scope="module")
def reference(params):
  forward = jax.jit(tf.forward)

  def rows(tokens, first, last):
    """forward(tokens)[first:last], tokens padded to max_len."""
    padded = np.zeros(CONFIG.max_len, np.int32)
    padded[:len(tokens)] = tokens
    return np.asarray(forward(params, padded[None])[0, first:last])
  return rows


@pytest.fixture(scope="module")
def propose(params):
  """The proposer's shape: D draft steps in one jitted call, under x64."""
  draft = pair.TransformerDraft(params, CONFIG, max_depth=8)

  @jax.jit
  def run(state, first, chain):
    out = []
    token = first
    for i in range(D):
      logits, state = draft.step(state, token)
      out.append(logits)
      token = chain[i]
    return jnp.stack(out), state

  def call(state, first, chain):
    with jax.enable_x64(True):
      logits, state = run(state, jnp.int32(first), jnp.asarray(chain))
    assert logits.dtype == jnp.float32 and state.length.dtype == jnp.int32
    return np.asarray(logits), state
  return draft, call


def _record_feeds(monkeypatch):
  fed = []
  real = tf.feed

  def spy(params, cache, tokens, start, *rest):
    fed.append((int(start), int(np.shape(tokens)[0])))
    return real(params, cache, tokens, start, *rest)
  monkeypatch.setattr(tf, "feed", spy)
  return fed


def test_fifty_rounds_equal_recompute(params, reference, propose):
  """Simulated verifier: a random accepted count each round."""
  rng = np.random.default_rng(0)
  target = pair.TransformerTarget(params, CONFIG)
  draft, run = propose
  prefix = rng.integers(0, V, 3).astype(np.int32)
  t_state, d_state = target.init_state(), draft.init_state()
  worst_t = worst_d = 0.0
  for _ in range(50):
    chain = rng.integers(0, V, D).astype(np.int32)
    d_state = draft.catch_up(d_state, prefix, int(prefix[-1]), prefix.size)
    q_logits, d_state = run(d_state, prefix[-1], chain)
    rows, t_state = target.logits(t_state, prefix, chain)
    expect = reference(np.concatenate([prefix, chain]), prefix.size - 1,
                       prefix.size + D)
    worst_t = max(worst_t, float(np.abs(np.asarray(rows) - expect).max()))
    worst_d = max(worst_d, float(np.abs(q_logits - expect[:D]).max()))
    accepted = int(rng.integers(0, D + 1))
    prefix = np.concatenate([prefix, chain[:accepted],
                             rng.integers(0, V, 1)]).astype(np.int32)
  assert worst_t < TOL, f"target: cached vs recomputed max abs diff {worst_t:.3g}"
  assert worst_d < TOL, f"draft: cached vs recomputed max abs diff {worst_d:.3g}"


@pytest.mark.parametrize("accepted", range(D + 1))
def test_target_rollback_feeds_only_the_new_chunk(params, reference,
                                                  monkeypatch, accepted):
  rng = np.random.default_rng(accepted)
  target = pair.TransformerTarget(params, CONFIG)
  prefix = rng.integers(0, V, 20).astype(np.int32)
  chain = rng.integers(0, V, D).astype(np.int32)
  _, state = target.logits(None, prefix, chain)
  fed = _record_feeds(monkeypatch)
  prefix2 = np.concatenate([prefix, chain[:accepted], [7]]).astype(np.int32)
  chain2 = rng.integers(0, V, D).astype(np.int32)
  rows, state = target.logits(state, prefix2, chain2)
  # One pass over [prefix2[-1], chain2]: nothing before it is recomputed.
  assert fed == [(prefix2.size - 1, D + 1)]
  expect = reference(np.concatenate([prefix2, chain2]), prefix2.size - 1,
                     prefix2.size + D)
  assert np.abs(np.asarray(rows) - expect).max() < TOL
  np.testing.assert_array_equal(state.tokens,
                                np.concatenate([prefix2, chain2]))


@pytest.mark.parametrize("accepted", range(D + 1))
def test_draft_rollback_feeds_only_the_new_tokens(params, reference, propose,
                                                  monkeypatch, accepted):
  rng = np.random.default_rng(10 + accepted)
  draft, run = propose
  prefix = rng.integers(0, V, 20).astype(np.int32)
  chain = rng.integers(0, V, D).astype(np.int32)
  state = draft.catch_up(None, prefix, int(prefix[-1]), prefix.size)
  _, state = run(state, prefix[-1], chain)   # covers prefix + chain[:D-1]
  fed = _record_feeds(monkeypatch)
  prefix2 = np.concatenate([prefix, chain[:accepted], [7]]).astype(np.int32)
  state = draft.catch_up(state, prefix2, 7, prefix2.size)
  # The cache already holds prefix + chain[:min(accepted, D - 1)]; only
  # the accepted token it lacks (accepted == D) is fed.
  assert fed == ([(prefix.size + D - 1, 1)] if accepted == D else [])
  assert int(state.length) == prefix2.size - 1
  chain2 = rng.integers(0, V, D).astype(np.int32)
  logits, _ = run(state, 7, chain2)
  expect = reference(np.concatenate([prefix2, chain2]), prefix2.size - 1,
                     prefix2.size + D - 1)
  assert np.abs(logits - expect).max() < TOL


def test_draft_step_matches_target_extend(params):
  """Jitted x64 draft steps give the target adapter's rows (same weights)."""
  rng = np.random.default_rng(5)
  prefix = rng.integers(0, V, 9).astype(np.int32)
  chain = rng.integers(0, V, D).astype(np.int32)
  target = pair.TransformerTarget(params, CONFIG)
  draft = pair.TransformerDraft(params, CONFIG, max_depth=8)
  rows, _ = target.logits(None, prefix, chain)
  state = draft.catch_up(None, prefix, int(prefix[-1]), prefix.size)
  step = jax.jit(draft.step)
  token = prefix[-1]
  with jax.enable_x64(True):
    for i in range(D + 1):
      logits, state = step(state, jnp.asarray(token, jnp.int32))
      assert logits.dtype == jnp.float32 and logits.shape == (V,)
      np.testing.assert_allclose(logits, rows[i], atol=TOL, rtol=0)
      token = chain[i] if i < D else 0


def test_reasking_and_context_none(params, reference):
  target = pair.TransformerTarget(params, CONFIG)
  draft = pair.TransformerDraft(params, CONFIG, max_depth=8)
  prefix = np.arange(1, 11, dtype=np.int32)
  chain = np.asarray([3, 4], np.int32)
  first, state = target.logits(None, prefix, chain)
  # The cache covers all of prefix + chain: the same question again rolls
  # back one token and refeeds it (another chunk shape: float rounding).
  again, _ = target.logits(state, prefix, chain)
  np.testing.assert_allclose(again, first, atol=TOL, rtol=0)
  bonus, _ = target.logits(state, np.concatenate([prefix, chain]), chain[:0])
  np.testing.assert_allclose(bonus[0], first[-1], atol=TOL, rtol=0)
  # context None: the draft sees last_token alone.
  state = draft.catch_up(draft.catch_up(None, prefix, 10, 10), None, 5, 10)
  assert int(state.length) == 0
  logits, _ = draft.step(state, jnp.int32(5))
  np.testing.assert_allclose(logits, reference(np.asarray([5]), 0, 1)[0],
                             atol=TOL, rtol=0)


def test_long_contexts(params, reference):
  target = pair.TransformerTarget(params, CONFIG)
  draft = pair.TransformerDraft(params, CONFIG, max_depth=8)
  rng = np.random.default_rng(9)
  long = rng.integers(0, V, 400).astype(np.int32)
  with pytest.raises(ValueError, match="max_len 320"):
    target.logits(None, long[:318], long[318:321])
  # The draft keeps a left-truncated window that moves in steps of
  # capacity / 2 = 156 tokens.
  assert draft.capacity == 312
  assert [draft.window_start(n) for n in (312, 313, 468, 469)] == [
      0, 156, 156, 312]
  state = draft.catch_up(None, long, int(long[-1]), long.size)
  assert int(state.length) == 399 - 156
  logits, _ = draft.step(state, jnp.int32(long[-1]))
  expect = reference(long[156:], 399 - 156, 400 - 156)[0]
  np.testing.assert_allclose(logits, expect, atol=TOL, rtol=0)


@pytest.mark.parametrize("call, message", [
    (lambda t, d: t.logits(None, np.zeros(0, np.int32), [1]),
     "at least one token"),
    (lambda t, d: t.logits(None, [1, V], [1]), "outside"),
    (lambda t, d: t.logits(None, [[1]], [1]), "1-D integer"),
    (lambda t, d: d.catch_up(None, [1, 2], 3, 2), "ending in last_token"),
    (lambda t, d: d.catch_up(None, [1, 2], 2, 3), "anchor=3"),
    (lambda t, d: pair.TransformerDraft(d.params, CONFIG, max_depth=0),
     "max_depth"),
])
def test_bad_arguments(params, call, message):
  target = pair.TransformerTarget(params, CONFIG)
  draft = pair.TransformerDraft(params, CONFIG, max_depth=8)
  with pytest.raises(ValueError, match=message):
    call(target, draft)
