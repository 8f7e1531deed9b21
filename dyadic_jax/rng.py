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

Which key when (who owns which draw):

* `round_key(seed, generation, round)`: one request's round. This is the
  key the ops take: `verify_chain` (`verify_batch`: one per request) derive
  their ACCEPT, CORRECTION and BONUS keys from it, and `proposal_draws`
  its PROPOSAL draws. Hold one per request and round; never build the
  verifier's decision keys yourself. `round_keys` is the same of R
  requests at once (the engine's, the proposer's batched draw's and the
  sampling audit's: one vmapped schedule).
* `proposal_draws(round_key, depth, anchor)`: the worker leader's PROPOSAL
  draws, uint32[D], the draw of x_{i+1} at position anchor + i (anchor =
  the absolute position of x_1, the request's length so far). Pass them to
  `sample_counts` or `propose_dense`/`propose_sparse`; the verifier's
  sampling audit recomputes the same draws.
* `draw_key(round_key, position, domain, counter)`: one decision's key, for
  a draw you own outside the ops: the verifier's target-only fallback,
  `sample_target(logits, draw_key(round_key, anchor, Domain.TARGET_ONLY))`.
* `rng_key(seed, generation, round, position, domain, counter)`: the same
  key as `draw_key(round_key(seed, generation, round), ...)`, when the
  round key is not at hand.

Every function that takes a key checks, before any trace, that it is a
typed JAX key array (`check_key`): an int or a raw uint32 key is a
TypeError naming the argument, not an error from deep inside JAX.
"""

import enum
import functools
import typing

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


def round_keys(seeds: jax.typing.ArrayLike, generations: jax.typing.ArrayLike,
               rounds: jax.typing.ArrayLike) -> jax.Array:
  """Typed round keys [R]: `round_key` of each (seeds, generations and
  rounds [R]; traceable: under jit one vmapped computation)."""
  return jax.vmap(round_key)(seeds, generations, rounds)


def check_key(op: str, arg: str, key: typing.Any,
              shape: tuple[int, ...] | None = None) -> None:
  """Raises TypeError unless `key` is a typed JAX key array, ValueError
  unless its shape is `shape` (None: any shape).

  A Python-level check of dtype and shape (a tracer has both), so it costs
  nothing inside jit. Ints and raw uint32 keys (`jax.random.PRNGKey`) are
  refused: the schedule's keys are typed threefry keys.
  """
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape is not None and jnp.shape(key) != shape:
      raise ValueError(f"{op}: {arg} must be typed keys of shape {shape}, "
                       f"got shape {jnp.shape(key)}")
    return
  if dtype is None:
    got = type(key).__name__
  else:
    got = f"an array {dtype}{list(jnp.shape(key))}"
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
      got += " (a raw key: typed keys only)"
  raise TypeError(
      f"{op}: {arg} must be a typed JAX key array, e.g. "
      f"dyadic_jax.round_key(seed, generation, round), got {got}")


def draw_key(key: jax.Array, position: int | jax.typing.ArrayLike,
             domain: int | jax.typing.ArrayLike,
             counter: int | jax.typing.ArrayLike = 0) -> jax.Array:
  """Key of one draw inside a round: round key -> position -> domain -> counter.

  `key` is a typed key (`round_key`; TypeError otherwise); `position` the
  absolute sequence position of the decision; `domain` a `Domain`;
  `counter` numbers repeated draws of one domain at one position. All
  three may be traced integers.
  """
  check_key("draw_key", "key", key)
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

  `key` is a typed key array (TypeError otherwise) and may carry leading
  batch axes; one draw per key.
  """
  check_key("draw24", "key", key)
  bits = _per_key(lambda k: jax.random.bits(k, (), jnp.uint32), key)
  return bits >> jnp.uint32(8)


@x64.scoped
def draw64(key: jax.Array) -> jax.Array:
  """Uniform integer in [0, 2^64) (uint64), one per key (typed keys only)."""
  check_key("draw64", "key", key)
  return _per_key(lambda k: jax.random.bits(k, (), jnp.uint64), key)


def proposal_draw(key: jax.Array,
                  position: int | jax.typing.ArrayLike) -> jax.Array:
  """The PROPOSAL draw (uint32 in [0, 2^24)) at `position` of round `key`."""
  return draw24(draw_key(key, position, Domain.PROPOSAL))


@functools.partial(jax.jit, static_argnums=2)
def _proposal_draws(key, anchor, depth):
  def chain(k, a):
    positions = a + jnp.arange(depth, dtype=jnp.int64)
    return jax.vmap(lambda p: proposal_draw(k, p))(positions)

  for _ in range(key.ndim):
    chain = jax.vmap(chain)
  return chain(key, anchor)


@x64.scoped
def proposal_draws(key: jax.Array, depth: int,
                   anchor: int | jax.typing.ArrayLike = 0) -> jax.Array:
  """The PROPOSAL draws of a drafted chain: what x_1..x_D are sampled by.

  Args:
    key: typed round key(s) of shape [...] (`round_key`; one per request
      for a batch); TypeError otherwise.
    depth: D >= 0, a Python int (static: one compile per depth).
    anchor: int64 scalar or [...]: the absolute position of x_1 (the
      request's length so far), as `verify_chain`'s `anchor`; may be
      traced.

  Returns:
    uint32[..., D] in [0, 2^24): entry i is `draw24(draw_key(key, anchor +
    i, Domain.PROPOSAL))`, bit for bit, the draw `sample_counts` maps to
    x_{i+1}. Inside your own jit, 64-bit mode is needed (`X64Required`),
    as for every op.
  """
  check_key("proposal_draws", "key", key)
  if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or (
      depth < 0):
    raise ValueError(f"proposal_draws: depth must be an int >= 0, got "
                     f"{depth!r}")
  if not jnp.issubdtype(jnp.result_type(anchor), jnp.integer):
    raise TypeError(f"proposal_draws: anchor must be an integer position, "
                    f"got {jnp.result_type(anchor)}")
  anchor = jnp.asarray(anchor, jnp.int64)
  if anchor.shape not in ((), key.shape):
    raise ValueError(f"proposal_draws: anchor shape {anchor.shape} must be "
                     f"() or the keys' shape {key.shape}")
  return _proposal_draws(key, jnp.broadcast_to(anchor, key.shape), int(depth))


def _per_key(fn, key):
  for _ in range(key.ndim):
    fn = jax.vmap(fn)
  return fn(key)
