"""What a user's own script runs into (issue 29): draws, keys, Capabilities.

* `dj.proposal_draws` is the hand-built per-position PROPOSAL draw, bit for
  bit, for one round key and for a batch, and the sampling audit's draws
  are the same function's.
* A non-key where a key belongs is a TypeError naming the argument, raised
  before anything is traced.
* `Capabilities(max_support=)` is ignored for dense q (the row width).

The bridge is imported inside its tests only: tests/core is collected
without the bridge's dependencies (tests/system/test_qualify.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj

V, D = 64, 4


def _hand_built(key, depth, anchor=0):
  """The README's former recipe: one PROPOSAL key per position."""
  return dj.draw24(jax.vmap(lambda i: dj.draw_key(
      key, anchor + i, dj.Domain.PROPOSAL))(np.arange(depth)))


def _hand_built_batch(keys, depth, anchors):
  return dj.draw24(jax.vmap(jax.vmap(
      lambda k, a, i: dj.draw_key(k, a + i, dj.Domain.PROPOSAL),
      in_axes=(None, None, 0)), in_axes=(0, 0, None))(
          keys, anchors, np.arange(depth)))


@pytest.mark.parametrize("anchor", [0, 7, 2 ** 32 + 5])
def test_proposal_draws_equal_the_hand_built_draws(anchor):
  key = dj.round_key(1, 0, 0)
  got = dj.proposal_draws(key, D, anchor)
  assert got.shape == (D,) and got.dtype == jnp.uint32
  with jax.enable_x64(True):         # a 64-bit anchor as a 64-bit position
    want = _hand_built(key, D, np.int64(anchor))
  np.testing.assert_array_equal(got, want)
  assert np.all(np.asarray(got) < 2 ** 24)


def test_proposal_draws_of_a_batch_equal_each_request_s():
  keys = jnp.stack([dj.round_key(3, g, r) for g, r in [(0, 0), (0, 1),
                                                       (2, 5)]])
  anchors = np.array([0, 11, 2 ** 33], np.int64)
  got = dj.proposal_draws(keys, D, anchors)
  assert got.shape == (3, D)
  with jax.enable_x64(True):
    np.testing.assert_array_equal(got, _hand_built_batch(keys, D, anchors))
  for b in range(3):
    np.testing.assert_array_equal(
        got[b], dj.proposal_draws(keys[b], D, int(anchors[b])))
  # A scalar anchor is every request's; keys [2, 3] give [2, 3, D].
  np.testing.assert_array_equal(dj.proposal_draws(keys, D, 11)[1], got[1])
  grid = dj.proposal_draws(jnp.stack([keys, keys]), D)
  assert grid.shape == (2, 3, D)
  np.testing.assert_array_equal(grid[1, 0], got[0])
  assert dj.proposal_draws(keys, 0).shape == (3, 0)


def test_proposal_draws_feed_the_proposal_ops():
  # The draws x_1..x_D are sampled by: the same tokens through either op.
  logits = np.random.default_rng(0).normal(size=(D, V)).astype(np.float32)
  key = dj.round_key(2, 0, 0)
  u = dj.proposal_draws(key, D, 5)
  counts, token, _ = dj.propose_dense(logits, u)
  np.testing.assert_array_equal(token, dj.sample_counts(counts,
                                                        _hand_built(key, D, 5)))


def test_proposal_draws_inside_a_jit():
  keys = jnp.stack([dj.round_key(1, 0, r) for r in range(2)])
  anchors = jnp.array([3, 4])
  fn = jax.jit(lambda k, a: dj.proposal_draws(k, D, a))
  with jax.enable_x64(True):
    np.testing.assert_array_equal(fn(keys, anchors),
                                  dj.proposal_draws(keys, D, anchors))
  if not jax.config.jax_enable_x64:
    with pytest.raises(dj.X64Required, match="proposal_draws"):
      fn(keys, anchors)


@pytest.mark.parametrize("depth, anchor, error", [
    (-1, 0, ValueError), (2.0, 0, ValueError), (True, 0, ValueError),
    (2, 1.5, TypeError), (2, np.zeros(3, np.int64), ValueError)])
def test_proposal_draws_refuses_bad_arguments(depth, anchor, error):
  with pytest.raises(error, match="proposal_draws"):
    dj.proposal_draws(dj.round_key(1, 0, 0), depth, anchor)


def test_the_audit_draws_are_the_core_draws():
  for name in ("zmq", "blake3", "crc32c"):
    pytest.importorskip(name)
  from dyadic_jax.bridge import audit  # pylint: disable=g-import-not-at-top
  seeds = np.array([2 ** 64 - 1, 7], np.uint64)
  gens, rounds = np.array([1, 0]), np.array([4, 9])
  anchors = np.array([2 ** 40, 3], np.int64)
  got = audit.proposal_draws(seeds, gens, rounds, anchors, D, pad_to=4)
  keys = jnp.stack([dj.round_key(int(s), int(g), int(r))
                    for s, g, r in zip(seeds, gens, rounds)])
  np.testing.assert_array_equal(got, dj.proposal_draws(keys, D, anchors))


def _chain():
  rng = np.random.default_rng(1)
  target = rng.normal(size=(D + 1, V)).astype(np.float32)
  counts, _ = dj.allocate_dense(dj.draft_weights(target[:D])[0])
  return target, dj.DenseQ(np.asarray(counts)), np.arange(D, dtype=np.int32)


_NOT_KEYS = [7, np.int64(7), np.uint32([0, 7]), np.zeros(3, np.uint32)]


def _key_calls():
  target, q, draft = _chain()
  batch = lambda x: np.stack([x, x])
  return {
      "verify_chain": (lambda k: dj.verify_chain(target, q, draft, k), "key"),
      "verify_batch": (lambda k: dj.verify_batch(
          batch(target), dj.DenseQ(batch(q.counts)), batch(draft), k),
                       "keys"),
      "sample_target": (lambda k: dj.sample_target(target[0], k), "key"),
      "draw_key": (lambda k: dj.draw_key(k, 0, dj.Domain.ACCEPT), "key"),
      "draw24": (dj.draw24, "key"),
      "draw64": (dj.draw64, "key"),
      "proposal_draws": (lambda k: dj.proposal_draws(k, D), "key"),
  }


@pytest.mark.parametrize("op", sorted(_key_calls()))
@pytest.mark.parametrize("not_key", _NOT_KEYS,
                         ids=["int", "int64", "raw_key", "uint32_3"])
def test_a_non_key_is_a_type_error_naming_the_argument(op, not_key):
  call, arg = _key_calls()[op]
  with pytest.raises(TypeError) as e:
    call(not_key)
  assert str(e.value).startswith(f"{op}: {arg} must be a typed JAX key")
  if np.ndim(not_key):
    assert "raw key" in str(e.value)
  # Raised by the check, not from inside a JAX trace.
  assert e.traceback[-1].name == "check_key"
  assert len(e.traceback) <= 8


def test_typed_keys_pass_traced_and_a_batch_is_not_one_key():
  target, q, draft = _chain()
  key = dj.round_key(1, 0, 0)
  with pytest.raises(ValueError, match="verify_chain: key must be typed keys "
                     r"of shape \(\)"):
    dj.verify_chain(target, q, draft, jnp.stack([key, key]))
  # vmap of verify_chain: each traced key is one key.
  keys = jnp.stack([key, dj.round_key(1, 0, 1)])
  accepted, token, status = jax.vmap(
      lambda k: dj.verify_chain(target, q, draft, k))(keys)
  want = dj.verify_batch(np.stack([target] * 2),
                         dj.DenseQ(np.stack([q.counts] * 2)),
                         np.stack([draft] * 2), keys)
  for a, b in zip((accepted, token, status), want):
    np.testing.assert_array_equal(a, b)


def test_the_key_check_adds_nothing_to_the_program():
  key = dj.round_key(1, 0, 0)
  jaxpr = jax.make_jaxpr(lambda k: dj.draw24(dj.draw_key(
      k, 3, dj.Domain.PROPOSAL)))(key)
  bare = jax.make_jaxpr(lambda k: jax.random.bits(
      dj.rng.fold_in64(jax.random.fold_in(dj.rng.fold_in64(k, 3),
                                          dj.Domain.PROPOSAL), 0),
      (), jnp.uint32) >> jnp.uint32(8))(key)
  assert str(jaxpr) == str(bare)


def _hello():
  for name in ("zmq", "blake3", "crc32c"):
    pytest.importorskip(name)
  from dyadic_jax.bridge import hello  # pylint: disable=g-import-not-at-top
  return hello


@pytest.mark.parametrize("max_support", [1, 8, 32, 10 ** 6])
@pytest.mark.parametrize("shards", [1, 2])
def test_capabilities_max_support_is_ignored_for_dense_q(max_support, shards):
  hello = _hello()
  dense = hello.Representation.DENSE
  caps = hello.Capabilities(vocab=V + 1, representation=dense, shards=shards,
                            max_support=max_support)
  assert caps.max_support == caps.width == -(-(V + 1) // shards)
  assert caps == hello.Capabilities(vocab=V + 1, representation=dense,
                                    shards=shards)
  assert "ignored" in hello.Capabilities.__doc__


def test_capabilities_max_support_bounds_sparse_q():
  hello = _hello()
  assert hello.Capabilities(vocab=V, max_support=8).width == 8
  for bad in (0, V + 1):
    with pytest.raises(ValueError, match=f"max_support {bad} not in"):
      hello.Capabilities(vocab=V, max_support=bad)
  greedy = hello.Capabilities(vocab=V, mode=hello.Mode.GREEDY, max_support=8)
  assert greedy.max_support == 0
