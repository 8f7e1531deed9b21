"""The vocabulary mesh of n emulated devices, or a skip naming the shortfall
(tests/conftest.py asks for 8 CPU devices; a run with fewer skips the rest)."""

import functools

import jax
import pytest

import sharding


@functools.lru_cache(maxsize=None)
def vocab_mesh(n: int) -> jax.sharding.Mesh:
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, have {jax.device_count()}")
  return sharding.vocab_mesh(n)
