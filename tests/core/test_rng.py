"""The RNG key schedule: deterministic, separated by every coordinate."""

import itertools

import jax
import numpy as np
import pytest

import dyadic_jax as dj


def _bits(key):
  return int(jax.random.bits(key, (), np.uint32))


def _fold64(key, value):
  key = jax.random.fold_in(key, value >> 32)
  return jax.random.fold_in(key, value & 0xFFFFFFFF)


def test_schedule_is_fold_in_chain():
  key = dj.rng_key(7, 1, 2, 3, dj.Domain.ACCEPT, 4)
  manual = jax.random.key(7, impl="threefry2x32")
  for x in (1, 2, 3):
    manual = _fold64(manual, x)
  manual = _fold64(jax.random.fold_in(manual, int(dj.Domain.ACCEPT)), 4)
  assert _bits(key) == _bits(manual)
  assert _bits(dj.draw_key(dj.round_key(7, 1, 2), 3, dj.Domain.ACCEPT, 4)) \
      == _bits(key)


def test_all_64_bits_of_every_coordinate_count():
  # Before, each coordinate was folded as uint32: 2^32 + 5 reused 5's key.
  big = (1 << 32) + 5
  base = [3, 1, 2, 5, dj.Domain.ACCEPT, 5]
  for i in (0, 1, 2, 3, 5):
    coords = list(base)
    coords[i] = big
    assert _bits(dj.rng_key(*coords)) != _bits(dj.rng_key(*base)), i
  # The seed's 64 bits are the threefry key data of jax.random.key(seed).
  seed = (1 << 63) + 12345
  with jax.enable_x64(True):
    want = jax.random.key(np.uint64(seed), impl="threefry2x32")
    traced = jax.jit(lambda s, p: dj.rng_key(s, 0, 0, p, 1))(
        np.uint64(seed), np.int64(big))
  assert np.array_equal(jax.random.key_data(dj.rng.seed_key(seed)),
                        jax.random.key_data(want))
  # Python ints and 64-bit arrays fold the same words.
  assert _bits(traced) == _bits(dj.rng_key(seed, 0, 0, big, 1))
  # 32-bit arrays (x64 off) hold the low word, high word 0: same key.
  assert _bits(dj.rng_key(3, 0, 0, np.int32(5), 1)) == _bits(
      dj.rng_key(3, 0, 0, 5, 1))
  with pytest.raises(ValueError, match="unsigned 64-bit"):
    dj.rng_key(-1, 0, 0, 0, 1)
  with pytest.raises(ValueError, match="unsigned 64-bit"):
    dj.rng_key(0, 0, 0, 1 << 64, 1)


def test_every_coordinate_separates_keys():
  seen = set()
  for coords in itertools.product([0, 1], [0, 1], [0, 1], [0, 1],
                                  list(dj.Domain), [0, 1]):
    seen.add(_bits(dj.rng_key(*coords)))
  assert len(seen) == 2 ** 5 * len(dj.Domain)


def test_draw24_is_top_24_bits():
  key = dj.rng_key(1, 0, 0, 0, dj.Domain.PROPOSAL)
  assert int(dj.draw24(key)) == _bits(key) >> 8
  keys = jax.vmap(lambda i: dj.rng_key(1, 0, 0, i, dj.Domain.PROPOSAL))(
      np.arange(4096))
  u = np.asarray(dj.draw24(keys))
  assert u.dtype == np.uint32 and u.shape == (4096,)
  assert u.max() < dj.M and len(np.unique(u)) > 4000


def test_draw64_batched_matches_scalar():
  keys = jax.vmap(lambda i: dj.rng_key(3, 0, 0, i, dj.Domain.ACCEPT))(
      np.arange(5))
  batched = np.asarray(dj.draw64(keys))
  assert batched.dtype == np.uint64
  assert [int(dj.draw64(keys[i])) for i in range(5)] == batched.tolist()


def test_domains_are_stable_abi():
  assert [(d.name, int(d)) for d in dj.Domain] == [
      ("PROPOSAL", 1), ("ACCEPT", 2), ("CORRECTION", 3), ("BONUS", 4),
      ("TARGET_ONLY", 5)]
