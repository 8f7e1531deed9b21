"""RNG key schedule: one key per decision, derived by `fold_in`.

    request seed -> generation -> round -> absolute position -> domain -> counter

Each decision (one proposal draw, one acceptance test, one correction) owns a
scalar draw from its own key, so a draw never depends on how the vocabulary
is sharded, and proposal noise is never reused for a correction: the domains
differ, so the keys differ.
"""

import enum

import jax
import jax.numpy as jnp

from dyadic_jax import x64


class Domain(enum.IntEnum):
  """Who owns a draw. Values are folded into the key; never renumber them."""
  PROPOSAL = 1     # worker leader: which token the draft proposes
  ACCEPT = 2       # verifier: accept/reject test of a drafted token
  CORRECTION = 3   # verifier: draw from max(p - q, 0) after a rejection
  BONUS = 4        # verifier: extra token from p_{D+1} when all D accepted
  TARGET_ONLY = 5  # verifier: the ordinary target sampler (fallback path)


def round_key(seed, generation, round_id):
  """Typed key for one round of one request: seed -> generation -> round."""
  key = jax.random.key(seed)
  key = jax.random.fold_in(key, generation)
  return jax.random.fold_in(key, round_id)


def draw_key(key, position, domain, counter=0):
  """Key of one draw inside a round: round key -> position -> domain -> counter.

  `position` is the absolute sequence position of the decision; `domain` a
  `Domain`; `counter` numbers repeated draws of one domain at one position.
  All three may be traced integers.
  """
  key = jax.random.fold_in(key, position)
  key = jax.random.fold_in(key, domain)
  return jax.random.fold_in(key, counter)


def rng_key(seed, generation, round_id, position, domain, counter=0):
  """The full schedule in one call: seed, generation, round, position, domain, counter."""
  return draw_key(round_key(seed, generation, round_id), position, domain,
                  counter)


def draw24(key):
  """Uniform integer in [0, 2^24): the top 24 of 32 random bits (uint32).

  `key` may carry leading batch axes; one draw per key.
  """
  bits = _per_key(lambda k: jax.random.bits(k, (), jnp.uint32), key)
  return bits >> jnp.uint32(8)


@x64.scoped
def draw64(key):
  """Uniform integer in [0, 2^64) (uint64), one per key."""
  return _per_key(lambda k: jax.random.bits(k, (), jnp.uint64), key)


def _per_key(fn, key):
  for _ in range(key.ndim):
    fn = jax.vmap(fn)
  return fn(key)
