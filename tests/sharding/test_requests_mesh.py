"""The requests x vocab mesh and batched verification, bit for bit.

Every op on a ("requests", "vocab") mesh equals its single-device twin:
batch rows split over "requests" (batch sizes that the axis does not
divide included: rows are padded with copies and dropped), the vocabulary
over "vocab" (uneven splits included). `verify_batch` equals a loop of
`verify_chain`, on one device and on meshes, refused chains and D = 0
included. The default run covers one mesh of each kind (requests only,
both axes with each one larger, an axis of 3 that divides neither batch
nor vocabulary); `--runslow` runs every (r, v) with r x v <= 8.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
import sharding
from dyadic_jax.testing import adversarial

M = dj.M
pytestmark = pytest.mark.multidevice

ALL_MESHES = [(r, v) for r in range(1, 9) for v in range(1, 9) if r * v <= 8]
# Corners by default: requests only (2x1), requests padded to a multiple
# of the mesh (3x2), all 8 devices (2x4); every other shape of <= 8
# devices under --runslow.
MESHES = [(2, 1), (3, 2), (2, 4)]
SLOW_MESHES = [m for m in ALL_MESHES if m not in MESHES]


def _meshes(cases=MESHES, slow=SLOW_MESHES):
  return pytest.mark.parametrize(
      "r,v", [pytest.param(*m, id=f"{m[0]}x{m[1]}") for m in cases]
      + [pytest.param(*m, id=f"{m[0]}x{m[1]}", marks=pytest.mark.slow)
         for m in slow])


@functools.lru_cache(maxsize=None)
def _mesh(r, v):
  if jax.device_count() < r * v:
    pytest.skip(f"needs {r * v} devices, have {jax.device_count()}")
  return sharding.make_mesh(requests=r, vocab=v)


def _assert_same(single, sharded):
  """Equal outputs; vocabulary-sized ones compared on [..., :V] (padding
  ids hold zero)."""
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded),
                  strict=True):
    a, b = np.asarray(a), np.asarray(b)
    if b.ndim and a.ndim and b.shape[-1] > a.shape[-1]:
      assert not np.any(b[..., a.shape[-1]:]), "mass at padding ids"
      b = b[..., :a.shape[-1]]
    assert a.dtype == b.dtype and a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_array_equal(a, b)


V = 1001  # divides by none of 2, 3, 4, 8


@_meshes()
def test_row_ops_equal(r, v):
  mesh = _mesh(r, v)
  logits = adversarial.logit_rows(V)[:3]            # 3 rows: uneven for r=2
  bias = np.linspace(-1, 1, V, dtype=np.float32)
  _assert_same(dj.draft_weights(logits, temperature=0.8, bias=bias),
               sharding.draft_weights(logits, temperature=0.8, bias=bias,
                                      mesh=mesh))
  _assert_same(dj.target_probs(logits), sharding.target_probs(logits,
                                                              mesh=mesh))
  w = adversarial.weight_rows(V)                    # 9 rows (with ties)
  counts, _ = dj.allocate_dense(w)
  _assert_same((counts, _), sharding.allocate_dense(w, mesh=mesh))
  _assert_same(dj.allocate_sparse(w, 32),
               sharding.allocate_sparse(w, 32, mesh=mesh))
  u = jnp.asarray(np.random.default_rng(r * 10 + v).integers(
      0, M, len(w)), jnp.uint32)
  _assert_same(dj.sample_counts(counts, u),
               sharding.sample_counts(counts, u, mesh=mesh))
  keys = jax.vmap(lambda i: dj.rng_key(2, 0, 0, i, dj.Domain.TARGET_ONLY))(
      jnp.arange(len(logits)))
  _assert_same(dj.sample_target(logits, keys),
               sharding.sample_target(logits, keys, mesh=mesh))


def test_batch_shapes_are_kept():
  """Leading batch axes [2, 3] (and none) flatten over "requests" and come
  back in their shape."""
  mesh = _mesh(2, 2)
  w = adversarial.weight_rows(V)[:6].reshape(2, 3, V)
  single, sharded = dj.allocate_dense(w), sharding.allocate_dense(w,
                                                                  mesh=mesh)
  assert sharded[0].shape == (2, 3, sharding.padded_size(V, 2))
  assert sharded[1].shape == (2, 3)
  _assert_same(single, sharded)
  _assert_same(dj.allocate_dense(w[0, 0]),
               sharding.allocate_dense(w[0, 0], mesh=mesh))


def _loop(target, q, tokens, keys, anchors, verify=dj.verify_chain):
  """verify_chain request by request, stacked."""
  out = [verify(target[i], jax.tree.map(lambda a, i=i: a[i], q), tokens[i],
                keys[i], anchor=anchors[i]) for i in range(len(keys))]
  return tuple(np.stack([np.asarray(o[j]) for o in out]) for j in range(3))


def _round(v=V, requests=6):
  target, dense, sparse, tokens, keys = adversarial.round_requests(
      v, requests=requests)
  return target, dense, sparse, tokens, keys, np.arange(requests) * 7 + 3


@pytest.mark.usefixtures("row_mode")
@pytest.mark.parametrize("representation", ["dense", "sparse"])
def test_verify_batch_is_a_loop_of_verify_chain(representation):
  target, dense, sparse, tokens, keys, anchors = _round()
  q = dense if representation == "dense" else sparse
  loop = _loop(target, q, tokens, keys, anchors)
  _assert_same(loop, dj.verify_batch(target, q, tokens, keys, anchors))
  assert np.all(loop[1] >= 0) and np.any(loop[0] < tokens.shape[1])


def test_verify_batch_refusals_and_depth_zero():
  target, dense, sparse, tokens, keys, anchors = _round(v=7, requests=4)
  target = np.array(target)
  target[0, 2, 5] = np.nan                      # a refused target row
  counts = np.array(dense.counts)
  counts[1, 1, 0] += 1                          # WRONG_MASS
  q = dj.DenseQ(counts)
  batch = dj.verify_batch(target, q, tokens, keys, anchors)
  _assert_same(_loop(target, q, tokens, keys, anchors), batch)
  assert np.asarray(batch[2]).tolist()[:2] == [dj.Status.NAN,
                                               dj.Status.WRONG_MASS]
  assert np.asarray(batch[1]).tolist()[:2] == [-1, -1]
  empty = np.zeros((4, 0), np.int32)
  zero = dj.verify_batch(target[:, :1], None, empty, keys, anchors)
  _assert_same(_loop(target[:, :1], dj.DenseQ(np.zeros((4, 0, 7), np.int32)),
                     empty, keys, anchors), zero)


@_meshes()
@pytest.mark.parametrize("representation", ["dense", "sparse"])
def test_verify_batch_on_meshes(r, v, representation):
  target, dense, sparse, tokens, keys, anchors = _round()
  q = dense if representation == "dense" else sparse
  _assert_same(_loop(target, q, tokens, keys, anchors),
               sharding.verify_batch(target, q, tokens, keys, anchors,
                                     mesh=_mesh(r, v)))


def test_mesh_none_is_one_device():
  w = adversarial.weight_rows(V)
  _assert_same(dj.allocate_sparse(w, 8), sharding.allocate_sparse(w, 8))
  assert sharding.executor(None) is dj.rowops.LOCAL


def test_verify_batch_checks_its_shapes():
  target, dense, _, tokens, keys, anchors = _round(v=7, requests=2)
  with pytest.raises(ValueError, match=r"\[B, D\+1, V\]"):
    dj.verify_batch(target[0], dense, tokens, keys, anchors)
  with pytest.raises(ValueError, match="q rows"):
    dj.verify_batch(target, dj.DenseQ(dense.counts[:1]), tokens, keys)
  with pytest.raises(ValueError, match="one key per request"):
    dj.verify_batch(target, dense, tokens, keys[:1])
  with pytest.raises(TypeError, match="DenseQ or SparseQ"):
    dj.verify_batch(target, dense.counts, tokens, keys)


def test_make_mesh_refuses_bad_shapes():
  with pytest.raises(ValueError, match="requests=0"):
    sharding.make_mesh(requests=0, vocab=1)
  with pytest.raises(ValueError, match="jax_num_cpu_devices"):
    sharding.make_mesh(requests=jax.device_count() + 1, vocab=1,
                       devices=jax.devices("cpu"))
  mesh = sharding.make_mesh(requests=1, vocab=1)
  assert mesh.axis_names == sharding.AXES
  assert sharding.vocab_mesh(1).axis_names == sharding.AXES
