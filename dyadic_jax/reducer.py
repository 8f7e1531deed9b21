"""How a row op reduces over the vocabulary axis: locally, or across shards.

Core row functions take a `Reducer` (default `LOCAL`) for every step that
looks across the vocabulary: sums, maxima, flag ORs, candidate gathers,
lookups by global id and the integer categorical scan. The `sharding`
package builds one from collectives over a mesh axis, so a sharded op runs
the same program as the single-device op with only these steps swapped,
and every swapped step is exact (integer or exact-integer float sums, max,
OR, concatenation in shard order), hence bit-identical results.
"""

import typing

import jax
import jax.numpy as jnp
from jax import lax

from dyadic_jax import cumulative


class Reducer(typing.NamedTuple):
  """The vocabulary-axis steps of a row op (all act on the last axis)."""
  sum: typing.Callable        # x[..., n] -> [...]; exact sums only
  max: typing.Callable        # x[..., n] -> [...]; NaN: see max_and_status
  bit_or: typing.Callable     # int32 x[..., n] -> [...]
  gather: typing.Callable     # x[..., m] -> [..., shards * m], shard order
  lookup: typing.Callable     # (x[..., n], global ids[..., j]) -> [..., j]
  first_cum_greater: typing.Callable  # (int w[..., n] or cumulative.Blocked,
                                      #  u[...] or u(total)) -> global id
  offset: typing.Any          # global id of local index 0
  vocab: int                  # global vocabulary size V (no padding)
  shards: int                 # number of shards (1: local)
  collective: bool            # True inside shard_map (results replicated)


def _lookup(x, ids):
  n = x.shape[-1]
  inside = (ids >= 0) & (ids < n)
  values = jnp.take_along_axis(x, jnp.clip(ids, 0, n - 1), -1)
  return jnp.where(inside, values, jnp.zeros((), x.dtype))


def local(vocab: int) -> Reducer:
  """The single-device reducer over rows of length `vocab`."""
  return Reducer(
      sum=lambda x: jnp.sum(x, -1),
      max=lambda x: jnp.max(x, -1),
      bit_or=lambda x: lax.reduce(x, jnp.int32(0), lax.bitwise_or,
                                  (x.ndim - 1,)),
      gather=lambda x: x,
      lookup=_lookup,
      first_cum_greater=cumulative.first_cum_greater,
      offset=0,
      vocab=vocab,
      shards=1,
      collective=False)


def of(x: jax.Array, red: Reducer | None) -> Reducer:
  """`red`, or the local reducer for rows shaped like x when red is None."""
  return local(x.shape[-1]) if red is None else red


SUM, MAX = "sum", "max"


def one_pass(red: Reducer, *terms: tuple[str, jax.Array]) -> list[jax.Array]:
  """Row reductions of several arrays in one pass: [(SUM | MAX, x), ...].

  One variadic reduction over the last axis keeps an accumulator per
  term, then `red` combines the per-shard partials (psum / max over
  shards). Sums must be exact in any order (integers); XLA CPU would turn
  sibling reductions of one input into a multi-output fusion several times
  slower than separate passes, and one variadic reduce is faster than
  either. Returns one [...] array per term.
  """
  ops = {SUM: lax.add, MAX: lax.max}
  kinds = [kind for kind, _ in terms]
  values = tuple(x for _, x in terms)
  inits = tuple(jnp.zeros((), x.dtype) if kind == SUM
                else jnp.array(-jnp.inf if jnp.issubdtype(x.dtype, jnp.floating)
                               else jnp.iinfo(x.dtype).min, x.dtype)
                for kind, x in terms)
  partial = lax.reduce(
      values, inits,
      lambda a, b: tuple(ops[k](p, q) for k, p, q in zip(kinds, a, b)),
      (values[0].ndim - 1,))
  combine = {SUM: red.sum, MAX: red.max}
  return [combine[k](p[..., None]) for k, p in zip(kinds, partial)]
