"""Sharded ops equal their single-device twins bit for bit.

Mesh sizes 1, 2, 4, 8 (and 3, which divides none of the vocabularies),
vocabularies that do not divide evenly (7 over 8 shards leaves one shard
all padding), random and adversarial rows (dyadic_jax/testing/
adversarial.py), in the "loop" row mode and, on a subset of the cases, the
"batched" one (the accelerators' path). The default tier runs the
corners of the grid (every op once per mesh size, uneven and all-padding
splits, several scan blocks a shard); --runslow the whole grid, the full
vocabulary on the largest mesh included. Runs on emulated CPU devices (tests/conftest.py asks for 8) and
unchanged on GPUs; skips when the machine has fewer devices than a case
needs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax.testing import adversarial
import sharding
from dyadic_jax.testing import hlo
from tests import meshes

M = dj.M
pytestmark = pytest.mark.multidevice

SHARDS = [1, 2, 3, 4, 8]


_mesh = meshes.vocab_mesh


def _assert_same(single, sharded):
  """Sharded outputs equal single-device ones; padding ids hold zero.

  Vocabulary-sized outputs of the sharded ops keep the padded layout
  (sharding/ops.py), so they are compared on [..., :V].
  """
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
    a, b = np.asarray(a), np.asarray(b)
    if b.ndim and a.ndim and b.shape[-1] > a.shape[-1]:
      assert not np.any(b[..., a.shape[-1]:]), "mass at padding ids"
      b = b[..., :a.shape[-1]]
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


_rows = functools.lru_cache(maxsize=None)(
    lambda v: adversarial.weight_rows(v, SHARDS))
_logits = adversarial.logit_rows


# Every op once on every mesh size by default, both row modes among them,
# each on an uneven split: loop (CPU's mode) on 1 device and on 4 shards of
# 4099 (1025 ids a shard: several scan blocks of 256 each, the last one
# partial); batched (the accelerators') on 2 shards of 7 and on 8 shards of
# 7 (the last shard padding only). --runslow adds the rest of the grid:
# every size with a small and a mid vocabulary, 3 shards, and the full
# vocabulary on 8 shards in both modes.
CASES = [(1, 1001), (4, 4099)]
SLOW_CASES = [(1, 7), (2, 7), (2, 1001), (3, 1001), (4, 7), (4, 1001),
              (8, 7), (8, 1001), (8, dj.DEFAULT_VOCAB)]
BATCHED_CASES = [(2, 7), (8, 7)]
SLOW_BATCHED_CASES = [(1, 1001), (8, 4099), (8, dj.DEFAULT_VOCAB)]
# verify_chain composes the ops above; its own cost is compile time, so its
# corners are fewer: loop on 2 and 8 devices, batched on 4 shards of 1001
# (one vocabulary shard: tests/sharding/test_requests_mesh.py's 2x1 mesh);
# --runslow adds 1, 3 and 4 shards in loop mode and the full vocabulary on
# 8 shards in both modes.
VERIFY_CASES = [(2, 7), (8, 7)]
SLOW_VERIFY_CASES = [(1, 1001), (3, 1001), (4, 1001), (8, dj.DEFAULT_VOCAB)]
VERIFY_BATCHED_CASES = [(4, 1001)]
SLOW_VERIFY_BATCHED_CASES = [(2, 1001), (8, dj.DEFAULT_VOCAB)]


def _mode_cases(loop, batched, slow_loop=(), slow_batched=()):
  slow = pytest.mark.slow
  return pytest.mark.parametrize(
      "row_mode,n,v",
      [pytest.param(mode, n, v, id=f"{mode}-{n}-{v}",
                    marks=[slow] if is_slow else [])
       for mode, cases, is_slow in (("loop", loop, False),
                                    ("loop", slow_loop, True),
                                    ("batched", batched, False),
                                    ("batched", slow_batched, True))
       for n, v in cases],
      indirect=["row_mode"])


_MODES = _mode_cases(CASES, BATCHED_CASES, SLOW_CASES, SLOW_BATCHED_CASES)


@pytest.mark.qualify
@_MODES
def test_weights_equal(row_mode, n, v):
  del row_mode
  mesh = _mesh(n)
  logits = _logits(v)
  bias = np.linspace(-1, 1, v, dtype=np.float32)
  _assert_same(
      dj.draft_weights(logits, temperature=0.8, bias=bias),
      sharding.draft_weights(logits, temperature=0.8, bias=bias, mesh=mesh))
  _assert_same(dj.target_probs(logits),
                              sharding.target_probs(logits, mesh=mesh))


@pytest.mark.qualify
@_MODES
def test_dense_allocation_equal(row_mode, n, v):
  del row_mode
  w = _rows(v)
  _assert_same(dj.allocate_dense(w),
                              sharding.allocate_dense(w, mesh=_mesh(n)))


@pytest.mark.qualify
@_MODES
@pytest.mark.parametrize("k", [1, 32])  # k = 1, k < V and (V = 7) k >= V
def test_sparse_allocation_equal(row_mode, n, v, k):
  del row_mode
  w = _rows(v)
  k = min(k, v)
  _assert_same(dj.allocate_sparse(w, k),
                              sharding.allocate_sparse(w, k, mesh=_mesh(n)))


@pytest.mark.qualify
@_MODES
def test_proposal_rows_equal(row_mode, n, v):
  del row_mode
  mesh = _mesh(n)
  logits = _logits(v)
  u = jnp.asarray(np.random.default_rng(v).integers(0, M, len(logits)),
                  jnp.uint32)
  bias = np.linspace(-1, 1, v, dtype=np.float32)
  _assert_same(dj.propose_dense(logits, u, temperature=0.8, bias=bias),
               sharding.propose_dense(logits, u, temperature=0.8, bias=bias,
                                      mesh=mesh))
  k = min(32, v)
  _assert_same(dj.propose_sparse(logits, u, k),
               sharding.propose_sparse(logits, u, k, mesh=mesh))


@pytest.mark.qualify
@_MODES
def test_draws_equal(row_mode, n, v):
  del row_mode
  counts, _ = dj.allocate_dense(_rows(v))
  rng = np.random.default_rng(v)
  # Boundary draws of each row's cumulative counts, plus random ones.
  cum = np.cumsum(np.asarray(counts), -1)
  for u in (cum[:, v // 2] - 1, cum[:, v // 2], cum[:, 0],
            rng.integers(0, M, len(cum)), np.full(len(cum), M - 1)):
    u = jnp.asarray(np.clip(u, 0, M - 1), jnp.uint32)
    _assert_same(
        dj.sample_counts(counts, u),
        sharding.sample_counts(counts, u, mesh=_mesh(n)))


@pytest.mark.qualify
@_MODES
def test_target_only_sampler_equal(row_mode, n, v):
  del row_mode
  logits = _logits(v)
  keys = jax.vmap(lambda i: dj.rng_key(2, 0, 0, i, dj.Domain.TARGET_ONLY))(
      jnp.arange(len(logits)))
  _assert_same(
      dj.sample_target(logits, keys),
      sharding.sample_target(logits, keys, mesh=_mesh(n)))


@pytest.mark.qualify
@_mode_cases(VERIFY_CASES, VERIFY_BATCHED_CASES, SLOW_VERIFY_CASES,
             SLOW_VERIFY_BATCHED_CASES)
@pytest.mark.parametrize("representation", ["dense", "sparse"])
def test_verify_chain_equal(row_mode, n, v, representation):
  del row_mode
  target, dense, sparse, tokens, keys = adversarial.round_requests(v)
  q = dense if representation == "dense" else sparse
  anchors = jnp.arange(len(keys)) * 10

  def run(fn):
    return jax.vmap(lambda t, q, x, key, a: fn(t, q, x, key, anchor=a))(
        target, q, tokens, keys, anchors)

  single = run(dj.verify_chain)
  sharded = run(functools.partial(sharding.verify_chain, mesh=_mesh(n)))
  _assert_same(single, sharded)
  assert np.all(np.asarray(single[1]) >= 0)


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow),
                               pytest.param(2, marks=pytest.mark.slow), 8])
def test_verify_chain_refusals_and_depth_zero_equal(n):
  """Refused chains (target row, dense and sparse q) and D = 0 on shards."""
  v = 7
  target, dense, sparse, tokens, keys = adversarial.round_requests(
      v, requests=4)
  target = np.array(target)
  target[0, 2, 5] = np.nan                      # a refused target row
  counts = np.array(dense.counts)
  counts[1, 1, 0] += 1                          # WRONG_MASS
  counts[2, 0, :2] = [M, -counts[2, 0, 1]]      # NEGATIVE
  ids = np.array(sparse.ids)
  ids[3, 1, :2] = ids[3, 1, 1::-1]              # UNSORTED_IDS
  mesh = _mesh(n)
  sharded = functools.partial(sharding.verify_chain, mesh=mesh)
  for q in (dj.DenseQ(counts), dj.SparseQ(ids, sparse.counts, sparse.n)):
    run = lambda fn, q=q: jax.vmap(
        lambda t, q, x, key: fn(t, q, x, key, anchor=3))(target, q, tokens,
                                                        keys)
    single = run(dj.verify_chain)
    _assert_same(single, run(sharded))
    assert np.asarray(single[2]).tolist()[0] == dj.Status.NAN
  assert np.asarray(single[2]).tolist()[3] == dj.Status.UNSORTED_IDS
  # D = 0: the target-only BONUS draw, the same on every layout.
  for r in range(4):
    one = dj.verify_chain(target[r, 1:2], None, np.zeros(0, np.int32),
                          keys[r], anchor=r)
    _assert_same(one, sharded(target[r, 1:2], None, np.zeros(0, np.int32),
                              keys[r], anchor=r))
  # A dense q in the padded layout with mass at a padding id is refused.
  if sharding.padded_size(v, n) > v:
    padded = np.zeros((3, sharding.padded_size(v, n)), np.int32)
    padded[:, 0] = M - 1
    padded[:, v] = 1
    out = sharded(target[1], dj.DenseQ(padded), tokens[1], keys[1])
    assert [int(x) for x in out] == [0, -1, dj.Status.PADDING_NONZERO]


def test_one_device_mesh_is_the_direct_call():
  mesh = _mesh(1)
  w = _rows(1001)
  _assert_same(dj.allocate_sparse(w, 16),
                              sharding.allocate_sparse(w, 16, mesh=mesh))


def test_placement_pads_with_zero_mass():
  mesh = _mesh(2)
  x = sharding.place(np.ones((2, 7), np.float32), mesh)
  assert x.shape == (2, 8) and np.all(np.asarray(x)[:, 7] == 0)
  assert x.sharding.spec == sharding.vocab_spec(2)
  assert sharding.padded_size(7, 8) == 8 and sharding.padded_size(1001, 3) == 1002


def test_bad_mesh_is_refused():
  devices = np.asarray(jax.devices()[:1]).reshape(1, 1)
  mesh = jax.sharding.Mesh(devices, ("vocab", "other"))
  with pytest.raises(ValueError, match="must have axes"):
    sharding.allocate_dense(np.ones((1, 4)) / 4, mesh=mesh)


# The batched programs (the accelerators', where the bytes matter) on the
# largest vocabulary mesh by default; the loop programs and the requests x
# vocab mesh too under --runslow.
@pytest.mark.parametrize(
    "row_mode", [pytest.param("loop", marks=pytest.mark.slow), "batched"],
    indirect=True)
@pytest.mark.parametrize("requests", [
    1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.usefixtures("row_mode")
def test_no_collective_moves_vocabulary_sized_data(requests):
  """Compiled programs of every sharded op: collectives stay O(shards * k),
  on a vocabulary mesh of 8 and on a 2 x 4 requests x vocab mesh."""
  if requests == 1:
    _check_collectives(_mesh(8))
  elif jax.device_count() >= 8:
    _check_collectives(sharding.make_mesh(requests=2, vocab=4))
  else:
    pytest.skip(f"needs 8 devices, have {jax.device_count()}")


def _check_collectives(mesh):
  n, v = mesh.shape["vocab"], dj.DEFAULT_VOCAB
  block = -(-v // n)
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, v)).astype(np.float32))
  w, _ = dj.draft_weights(logits)
  counts, _ = dj.allocate_dense(w)
  u = jnp.zeros((2,), jnp.uint32)
  keys = jax.vmap(lambda i: dj.rng_key(0, 0, 0, i, dj.Domain.TARGET_ONLY))(
      jnp.arange(2))
  ids, scounts, nn, _ = dj.allocate_sparse(w, 32)
  chain = (jnp.zeros((2, 1), jnp.int32),
           jax.vmap(lambda i: dj.round_key(0, 0, i))(jnp.arange(2)))
  two = lambda x: jnp.stack([x[:2]] * 2)           # 2 requests, D = 1
  programs = {
      "draft_weights": hlo.program(sharding.draft_weights, logits, mesh=mesh),
      "target_probs": hlo.program(sharding.target_probs, logits, mesh=mesh),
      "allocate_dense": hlo.program(sharding.allocate_dense, w, mesh=mesh),
      "allocate_sparse": hlo.program(sharding.allocate_sparse, w, k=32,
                                     mesh=mesh),
      "sample_counts": hlo.program(sharding.sample_counts, counts, u,
                                   mesh=mesh),
      "sample_target": hlo.program(sharding.sample_target, logits, keys,
                                   mesh=mesh),
      "verify_batch dense": hlo.program(
          sharding.verify_batch, two(logits),
          dj.DenseQ(jnp.stack([counts[:1]] * 2)), *chain, mesh=mesh),
      "verify_batch sparse": hlo.program(
          sharding.verify_batch, two(logits),
          dj.SparseQ(*(jnp.stack([a[:1]] * 2) for a in (ids, scounts, nn))),
          *chain, mesh=mesh),
  }
  print(f"\ncollectives per op (V={v}, mesh {dict(mesh.shape)}, 2 rows; "
        "per call site):")
  for name, text in programs.items():
    found = hlo.collectives(text)
    assert found, f"{name}: no collectives found; the parser is broken"
    largest = hlo.largest_dimension(found)
    print(f"  {name:20s} {len(found):3d} sites, "
          f"{sum(c.nbytes for c in found):7d} bytes, largest dim {largest}")
    assert largest < block, f"{name} moves a vocabulary-sized array"
