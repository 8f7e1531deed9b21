"""The vocabulary mesh and shard ranges."""

import jax
import pytest

import sharding
from tests import meshes


@pytest.mark.parametrize("v,n", [(7, 8), (1001, 4), (129280, 3), (129280, 8),
                                 (1, 1)])
def test_ranges_cover_vocab_contiguously(v, n):
  ranges = sharding.shard_ranges(v, n)
  assert len(ranges) == n
  assert ranges[0].start == 0 and ranges[-1].stop == v
  for a, b in zip(ranges, ranges[1:]):
    assert a.stop == b.start
  size = ranges[0].size
  assert all(r.size == size for r in ranges) and n * size >= v > (n - 1) * (
      size - 1) - 1


def test_bad_ranges():
  with pytest.raises(ValueError):
    sharding.shard_ranges(0, 2)
  with pytest.raises(ValueError):
    sharding.shard_ranges(10, 0)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_vocab_mesh(n):
  mesh = meshes.vocab_mesh(n)
  assert mesh.axis_names == (sharding.REQUESTS_AXIS, sharding.VOCAB_AXIS)
  assert sharding.mesh_shape(mesh) == (1, n)
  assert mesh.devices.size == n


def test_vocab_mesh_too_many():
  with pytest.raises(ValueError, match="devices but .* available"):
    sharding.vocab_mesh(jax.device_count() + 1)


def test_vocab_mesh_error_says_how_to_get_cpu_devices():
  cpus = jax.devices("cpu")
  n = len(cpus) + 1
  with pytest.raises(ValueError, match=(
      rf"jax_num_cpu_devices\", {n}\).*"
      rf"xla_force_host_platform_device_count={n}")):
    sharding.vocab_mesh(n, cpus)
