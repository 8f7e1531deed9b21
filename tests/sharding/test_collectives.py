"""Both implementations of the shard gather give the same bits.

`sharding.collectives.gather` uses `lax.all_gather(..., to="invarying")`
where JAX has it (0.10 and 0.11 do) and a psum of bit patterns otherwise.
Both are run here inside `jax.shard_map` (check_vma on) on 1, 2, 4 and 8
devices, on every dtype the library gathers and on values a float sum
would change (-0.0, NaN payloads), and a whole sharded op is run with the
psum path forced.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax.testing import adversarial
from dyadic_jax.testing import hlo as hlo_lib
import sharding
from sharding import collectives
from tests import meshes

pytestmark = pytest.mark.multidevice


_mesh = meshes.vocab_mesh


def _blocks(dtype, n, width=3, rows=2):
  """[rows, n * width] values of dtype; floats with -0.0 and NaN payloads."""
  rng = np.random.default_rng(n)
  if dtype == np.bool_:
    return rng.random((rows, n * width)) < 0.5
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, (rows, n * width), dtype=dtype,
                        endpoint=True)
  x = rng.normal(size=(rows, n * width)).astype(dtype)
  x[0, 0] = -0.0
  bits = np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")
  nan = np.array(np.nan, dtype).view(bits) | 1  # a NaN with a payload bit
  x[-1, -1] = np.array(nan).view(dtype)
  return x


def _gathered(impl, x, mesh):
  # Each shard holds [rows, width]; the gather returns the whole row,
  # replicated (out_specs P()), which check_vma accepts only when the
  # result is typed invariant across the axis.
  fn = jax.shard_map(collectives.GATHERS[impl], mesh=mesh,
                     in_specs=P(None, sharding.VOCAB_AXIS), out_specs=P(),
                     check_vma=True)
  return np.asarray(jax.jit(fn)(x))


@pytest.mark.qualify
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32,
                                   np.int64, np.bool_])
def test_gather_implementations_are_bit_identical(n, dtype):
  mesh = _mesh(n)
  with jax.enable_x64(True):
    x = _blocks(dtype, n)
    a = _gathered("all_gather", x, mesh)
    b = _gathered("psum", x, mesh)
  assert a.dtype == b.dtype == x.dtype
  # The gather of the blocks in shard order is the input itself.
  np.testing.assert_array_equal(a.view(np.uint8), x.view(np.uint8))
  np.testing.assert_array_equal(b.view(np.uint8), x.view(np.uint8))


@pytest.mark.qualify
def test_this_jax_has_the_modern_spelling():
  assert collectives.GATHER == "all_gather"
  mesh = _mesh(2)
  w = adversarial.weight_rows(1001)
  hlo = hlo_lib.program(sharding.allocate_sparse, w, k=7, mesh=mesh)
  assert "all-gather" in {c.kind for c in hlo_lib.collectives(hlo)}


@pytest.fixture
def psum_gather(monkeypatch):
  """Forces the psum gather; traces of either path dropped around it."""
  jax.clear_caches()
  monkeypatch.setattr(collectives, "GATHER", "psum")
  yield
  jax.clear_caches()


@pytest.mark.usefixtures("psum_gather")
@pytest.mark.parametrize("n", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_sharded_ops_through_the_psum_gather(n):
  mesh = _mesh(n)
  v = 1001
  w = adversarial.weight_rows(v)
  # The ops that gather: max and OR (statuses), the tie ranking of
  # allocation and the top-k candidate merge, the categorical scan.
  for single, sharded in [
      (dj.allocate_dense(w), sharding.allocate_dense(w, mesh=mesh)),
      (dj.allocate_sparse(w, 7), sharding.allocate_sparse(w, 7, mesh=mesh))]:
    for a, b in zip(single, sharded):
      np.testing.assert_array_equal(np.asarray(a),
                                    np.asarray(b)[..., :np.shape(a)[-1]]
                                    if np.ndim(a) > 1 else np.asarray(b))
  hlo = hlo_lib.program(sharding.allocate_sparse, w, k=7, mesh=mesh)
  kinds = {c.kind for c in hlo_lib.collectives(hlo)}
  assert "all-gather" not in kinds and "all-reduce" in kinds, kinds
  logits = adversarial.logit_rows(v)
  keys = jax.vmap(lambda i: dj.rng_key(2, 0, 0, i, dj.Domain.TARGET_ONLY))(
      jnp.arange(len(logits)))
  for a, b in zip(dj.sample_target(logits, keys),
                  sharding.sample_target(logits, keys, mesh=mesh)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
