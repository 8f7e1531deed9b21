"""RNG key schedule: one key per decision, derived by `fold_in`.

    request seed -> generation -> round -> absolute position -> domain -> counter

Each decision (one proposal draw, one acceptance test, one correction) owns a
scalar draw from its own key, so a draw never depends on how the vocabulary
is sharded, and proposal noise is never reused for a correction: the domains
differ, so the keys differ.

All 64 bits of every coordinate count. `jax.random.fold_in` takes 32 bits,
so each of generation, round, position and counter is folded as two words,
high then low (`fold_in64`): position 2^32 + 5 and position 5 get different
keys. The seed's two words are the threefry key data, so the round key
starts from `jax.random.key(seed)` of the 64-bit seed (threefry2x32 always,
whatever the process's default PRNG: the schedule is part of the wire's RNG
ABI). Coordinates are unsigned 64-bit values: Python ints in [0, 2^64) or
integer arrays (a 32-bit array holds the low word; its high word is 0).
"""

import enum

import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax import x64

_IMPL = "threefry2x32"
_WORD = 0xFFFFFFFF


class Domain(enum.IntEnum):
  """Who owns a draw. Values are folded into the key; never renumber them."""
  PROPOSAL = 1     # worker leader: which token the draft proposes
  ACCEPT = 2       # verifier: accept/reject test of a drafted token
  CORRECTION = 3   # verifier: draw from max(p - q, 0) after a rejection
  BONUS = 4        # verifier: extra token from p_{D+1} when all D accepted
  TARGET_ONLY = 5  # verifier: the ordinary target sampler (fallback path)


def words64(value: int | jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
  """(high, low) uint32 words of an unsigned 64-bit coordinate.

  A Python int is split on the host (any mode, must lie in [0, 2^64)); an
  integer array is split by its own width (a 32-bit array has high word 0).
  """
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    value = int(value)
    if not 0 <= value < 1 << 64:
      raise ValueError(f"rng: {value} is not an unsigned 64-bit value")
    return jnp.uint32(value >> 32), jnp.uint32(value & _WORD)
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"rng: coordinates are integers, got {value.dtype}")
  if value.dtype.itemsize < 8:
    return jnp.zeros(value.shape, jnp.uint32), value.astype(jnp.uint32)
  u = value.astype(jnp.uint64)
  return ((u >> jnp.uint64(32)).astype(jnp.uint32),
          (u & jnp.uint64(_WORD)).astype(jnp.uint32))


def fold_in64(key: jax.Array, value: int | jax.typing.ArrayLike) -> jax.Array:
  """`fold_in` of all 64 bits of `value`: the high word, then the low word."""
  hi, lo = words64(value)
  return jax.random.fold_in(jax.random.fold_in(key, hi), lo)


def seed_key(seed: int | jax.typing.ArrayLike) -> jax.Array:
  """The threefry key whose data is the seed's (high, low) words."""
  hi, lo = words64(seed)
  return jax.random.wrap_key_data(jnp.stack([hi, lo], -1), impl=_IMPL)


def round_key(seed: int | jax.typing.ArrayLike,
              generation: int | jax.typing.ArrayLike,
              round_id: int | jax.typing.ArrayLike) -> jax.Array:
  """Typed key for one round of one request: seed -> generation -> round."""
  return fold_in64(fold_in64(seed_key(seed), generation), round_id)


def draw_key(key: jax.Array, position: int | jax.typing.ArrayLike,
             domain: int | jax.typing.ArrayLike,
             counter: int | jax.typing.ArrayLike = 0) -> jax.Array:
  """Key of one draw inside a round: round key -> position -> domain -> counter.

  `position` is the absolute sequence position of the decision; `domain` a
  `Domain`; `counter` numbers repeated draws of one domain at one position.
  All three may be traced integers.
  """
  key = fold_in64(key, position)
  key = jax.random.fold_in(key, domain)
  return fold_in64(key, counter)


def rng_key(seed: int | jax.typing.ArrayLike,
            generation: int | jax.typing.ArrayLike,
            round_id: int | jax.typing.ArrayLike,
            position: int | jax.typing.ArrayLike,
            domain: int | jax.typing.ArrayLike,
            counter: int | jax.typing.ArrayLike = 0) -> jax.Array:
  """The full schedule in one call: seed, generation, round, position, domain, counter."""
  return draw_key(round_key(seed, generation, round_id), position, domain,
                  counter)


def draw24(key: jax.Array) -> jax.Array:
  """Uniform integer in [0, 2^24): the top 24 of 32 random bits (uint32).

  `key` may carry leading batch axes; one draw per key.
  """
  bits = _per_key(lambda k: jax.random.bits(k, (), jnp.uint32), key)
  return bits >> jnp.uint32(8)


@x64.scoped
def draw64(key: jax.Array) -> jax.Array:
  """Uniform integer in [0, 2^64) (uint64), one per key."""
  return _per_key(lambda k: jax.random.bits(k, (), jnp.uint64), key)


def _per_key(fn, key):
  for _ in range(key.ndim):
    fn = jax.vmap(fn)
  return fn(key)
