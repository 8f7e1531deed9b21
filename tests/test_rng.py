"""The RNG key schedule: deterministic, separated by every coordinate."""

import itertools

import jax
import numpy as np

import dyadic_jax as dj


def _bits(key):
  return int(jax.random.bits(key, (), np.uint32))


def test_schedule_is_fold_in_chain():
  key = dj.rng_key(7, 1, 2, 3, dj.Domain.ACCEPT, 4)
  manual = jax.random.key(7)
  for x in (1, 2, 3, int(dj.Domain.ACCEPT), 4):
    manual = jax.random.fold_in(manual, x)
  assert _bits(key) == _bits(manual)
  assert _bits(dj.draw_key(dj.round_key(7, 1, 2), 3, dj.Domain.ACCEPT, 4)) \
      == _bits(key)


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
