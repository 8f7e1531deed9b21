"""The vocabulary-axis reducer built from collectives over the mesh axis.

Inside `jax.shard_map` over VOCAB_AXIS each shard holds a contiguous block
of `size` ids starting at `shard * size`. Every step a row op takes across
the vocabulary is one of these, and each is exact, so a sharded op gives
the same bits as the single-device op:

  sum                 local sum, then psum (integers or float64 integers
                      below 2^53: exact in any order)
  max, bit_or         local reduction, gather of one scalar per shard, then
                      the same reduction in shard order
  gather              all_gather of small candidate vectors (O(shards * k))
  lookup              the owner's value, psum with zeros from the others
  first_cum_greater   shard totals -> owning shard -> local scan -> global id

None of them moves a vocabulary-sized array.
"""

import inspect

import jax
import jax.numpy as jnp
from jax import lax

from dyadic_jax import cumulative
from dyadic_jax import reducer
from sharding.mesh import VOCAB_AXIS


def _gather_all_gather(x):
  """`lax.all_gather(..., to="invarying")`: typed invariant across the axis."""
  return lax.all_gather(x, VOCAB_AXIS, axis=x.ndim - 1, tiled=True,
                        to="invarying")


def _gather_psum(x):
  """The same gather from one psum, for a JAX whose all_gather lacks `to=`.

  Each shard writes its block into zeros at its own position and the
  blocks are summed over the axis: every slot has one nonzero contributor.
  Floats are summed as their unsigned bit patterns and bools as int32, so
  the result is bit-identical to the all_gather (-0.0 and NaN payloads
  included); a psum result is invariant across the axis.
  """
  n = lax.axis_size(VOCAB_AXIS)
  me = lax.axis_index(VOCAB_AXIS)
  dtype = x.dtype
  if dtype == jnp.bool_:
    bits = x.astype(jnp.int32)
  elif jnp.issubdtype(dtype, jnp.floating):
    bits = lax.bitcast_convert_type(
        x, jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}"))
  else:
    bits = x
  placed = jnp.zeros(bits.shape[:-1] + (n, bits.shape[-1]), bits.dtype)
  placed = lax.dynamic_update_index_in_dim(placed, bits, me, bits.ndim - 1)
  out = lax.psum(placed, VOCAB_AXIS).reshape(bits.shape[:-1] + (-1,))
  if dtype == jnp.bool_:
    return out != 0
  if jnp.issubdtype(dtype, jnp.floating):
    return lax.bitcast_convert_type(out, dtype)
  return out


def _all_gather_has_to():
  try:
    return "to" in inspect.signature(lax.all_gather).parameters
  except (TypeError, ValueError):  # pragma: no cover - unintrospectable
    return False


# How `gather` is done, chosen once by what this JAX offers (jax 0.10 and
# 0.11 have `to=`); tests run both implementations.
GATHERS = {"all_gather": _gather_all_gather, "psum": _gather_psum}
GATHER = "all_gather" if _all_gather_has_to() else "psum"


def gather(x: jax.Array) -> jax.Array:
  """[..., m] per shard -> [..., shards * m], shard order, replicated.

  The result is typed as invariant across the axis, so it may leave
  shard_map with a replicated out_spec under check_vma. GATHER names the
  implementation (read at trace time).
  """
  return GATHERS[GATHER](x)


def _reduce_gathered(local, op):
  return op(gather(local[..., None]), -1)


def shard_reducer(vocab: int, size: int, shards: int) -> reducer.Reducer:
  """The Reducer of one shard of `size` ids (call inside shard_map)."""
  me = lax.axis_index(VOCAB_AXIS)
  offset = me * size

  def lookup(x, ids):
    local = ids - offset
    inside = (local >= 0) & (local < x.shape[-1])
    values = jnp.take_along_axis(x, jnp.clip(local, 0, x.shape[-1] - 1), -1)
    return lax.psum(jnp.where(inside, values, jnp.zeros((), x.dtype)),
                    VOCAB_AXIS)

  def first_cum_greater(w, u):
    if not isinstance(w, cumulative.Blocked):
      w = cumulative.blocked(w)
    totals = gather(w.cum[..., -1:])                              # [..., S]
    cum = jnp.cumsum(totals, -1)
    u = u(cum[..., -1]) if callable(u) else u
    owner = jnp.sum(cum <= u[..., None], -1, dtype=jnp.int32)
    before = jnp.take_along_axis(
        cum, jnp.maximum(owner - 1, 0)[..., None], -1)[..., 0]
    before = jnp.where(owner > 0, before, 0)
    idx = cumulative.scan(w, u - before) + offset
    token = lax.psum(jnp.where(owner == me, idx, 0), VOCAB_AXIS)
    return jnp.where(owner >= shards, vocab, token).astype(jnp.int32)

  return reducer.Reducer(
      sum=lambda x: lax.psum(jnp.sum(x, -1), VOCAB_AXIS),
      max=lambda x: _reduce_gathered(jnp.max(x, -1), jnp.max),
      bit_or=lambda x: _reduce_gathered(
          lax.reduce(x, jnp.int32(0), lax.bitwise_or, (x.ndim - 1,)),
          lambda g, axis: lax.reduce(g, jnp.int32(0), lax.bitwise_or,
                                     (g.ndim - 1,))),
      gather=gather,
      lookup=lookup,
      first_cum_greater=first_cum_greater,
      offset=offset,
      vocab=vocab,
      shards=shards,
      collective=True)
