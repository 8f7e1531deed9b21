"""Proposal rows: draft weights, dyadic counts and the token in one row op.

    propose_dense(logits, draw)      == draft_weights -> allocate_dense ->
                                        sample_counts
    propose_sparse(logits, draw, k)  == draft_weights -> allocate_sparse ->
                                        sample_counts -> ids[slot]

bit for bit (tests/core/test_proposal.py), as one row op: in "loop" row mode
each [V] row goes through softmax, allocation and the draw while it is in
cache, instead of three programs streaming the whole batch three times;
and the allocation skips its weight-status pass, because a softmax row
that is OK is finite, nonnegative and has a weight >= 1 / V (a positive
normal), which is exactly what that pass would find. This is what a draft
worker runs for every drafted position (dyadic_jax/bridge/proposer.py).

Status: the first refusal wins, in the order the separate ops would report
it: the draft row's (NAN, INF, ZERO_MASS, BAD_TEMPERATURE), then the
allocation's (INCONSISTENT_MASS). A refused row has zero counts (dense),
n = 0 and padding (sparse), and token -1.
"""

import functools

import jax
import jax.numpy as jnp

from dyadic_jax import allocation
from dyadic_jax import cumulative
from dyadic_jax import rowops
from dyadic_jax import weights
from dyadic_jax import x64
from dyadic_jax.constants import M, Status


def _draft(logits, t, t_ok, bias, red, block=None):
  """(e, scale, status) of draft rows: the weights are fl(e * scale), the
  bits of `draft_weights` (scale = fl(1 / Z) on OK rows; 0 on refused
  rows and temperatures, giving their +0 weights); with `block`, e's
  block maxima last (`weights.draft_parts`)."""
  e, inv, status, *block_max = weights.draft_parts(logits, t, bias, red,
                                                   block)
  status = jnp.where(t_ok, status, Status.BAD_TEMPERATURE).astype(jnp.int32)
  return (e, jnp.where(status == Status.OK, inv, 0.0), status, *block_max)


def dense_rows(logits, t, t_ok, draw, bias=None, *, red=None):
  """(counts, token, status) of draft rows: the body of `propose_dense`."""
  e, scale, status = _draft(logits, t, t_ok, bias, red)
  counts, status = allocation.largest_remainder(e * scale[..., None], M, red,
                                                status=status)
  token = red.first_cum_greater(counts, draw.astype(jnp.int64))
  ok = status == Status.OK
  return counts, jnp.where(ok, token, -1).astype(jnp.int32), status


def sparse_rows(logits, t, t_ok, draw, bias=None, *, k, red=None):
  """(ids, counts, n, token, status): the body of `propose_sparse`.

  The weights row is never stored: the top-k reads fl(e * scale) as it
  goes, and the support's weights are the same products at k ids. The
  normalizer's pass over e also takes e's block maxima, which the top-k
  would otherwise read e once more for.
  """
  e, scale, status, block_max = _draft(logits, t, t_ok, bias, red,
                                       allocation.CANDIDATE_BLOCK)
  ids, counts, n, status = allocation.allocate_sparse_rows(
      e, k, red, status=status, scale=scale, block_max=block_max)
  # The support is replicated: its draw is a local scan over k counts.
  slot = cumulative.first_cum_greater(counts, draw.astype(jnp.int64))
  token = jnp.take_along_axis(ids, jnp.minimum(slot, k - 1)[..., None],
                              -1)[..., 0]
  ok = (status == Status.OK) & (slot < k)
  return ids, counts, n, jnp.where(ok, token, -1).astype(jnp.int32), status


def _specs(bias):
  specs = (rowops.Arg(1, -jnp.inf), rowops.Arg(0), rowops.Arg(0),
           rowops.Arg(0))
  return specs + (() if bias is None else (rowops.Arg(1, 0.0),))


def _run(body, vocab_out, logits, temperature, draw, bias, executor):
  t, t_ok = weights.temperature_status(temperature, logits.shape[:-1])
  args = (logits, t, t_ok, draw) + (() if bias is None else (bias,))
  return executor.run(rowops.declare(body, _specs(bias), vocab_out,
                                     logits.shape[-1]), *args)


@functools.partial(jax.jit, static_argnames="executor")
def _propose_dense(logits, temperature, draw, bias, executor):
  return _run(dense_rows, (True, False, False), logits, temperature, draw,
              bias, executor)


@functools.partial(jax.jit, static_argnames=("k", "executor"))
def _propose_sparse(logits, temperature, draw, bias, k, executor):
  return _run(functools.partial(sparse_rows, k=k), (False,) * 5, logits,
              temperature, draw, bias, executor)


def _inputs(name: str, logits: jax.typing.ArrayLike,
            draw: jax.typing.ArrayLike, temperature: jax.typing.ArrayLike,
            bias: jax.typing.ArrayLike | None
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  x, u = jnp.asarray(logits), jnp.asarray(draw)
  weights.check_rows(name, x)
  if u.shape != x.shape[:-1]:
    raise ValueError(f"{name}: draw shape {u.shape} must be the batch "
                     f"shape {x.shape[:-1]} of the logits")
  b = None if bias is None else jnp.broadcast_to(jnp.asarray(bias), x.shape)
  return x, u, jnp.asarray(temperature, jnp.float64), b


@x64.scoped
def propose_dense(logits: jax.typing.ArrayLike, draw: jax.typing.ArrayLike,
                  *, temperature: jax.typing.ArrayLike = 1.0,
                  bias: jax.typing.ArrayLike | None = None,
                  executor: rowops.Executor = rowops.LOCAL
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A dense proposal row: counts of the draft softmax and the drawn token.

  The same bits as `draft_weights(logits, temperature=, bias=)`, then
  `allocate_dense` of those weights, then `sample_counts(counts, draw)`.

  Args:
    logits: float[..., V] draft logits (-inf allowed).
    draw: uint32[...] 24-bit draws (`rng.draw24` of the PROPOSAL key), one
      per row.
    temperature, bias, executor: as `draft_weights`.

  Returns:
    (counts int32[..., V] summing to M, token int32[...], status int32[...]);
    refused rows have zero counts and token -1 (module docstring).
  """
  x, u, t, b = _inputs("propose_dense", logits, draw, temperature, bias)
  return _propose_dense(x, t, u, b, executor)


@x64.scoped
def propose_sparse(logits: jax.typing.ArrayLike, draw: jax.typing.ArrayLike,
                   k: int, *, temperature: jax.typing.ArrayLike = 1.0,
                   bias: jax.typing.ArrayLike | None = None,
                   executor: rowops.Executor = rowops.LOCAL
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array,
                              jax.Array]:
  """A sparse top-k proposal row: its support, counts and drawn token.

  The same bits as `draft_weights`, then `allocate_sparse(w, k)`, then the
  token `ids[sample_counts(counts, draw)]`.

  Returns:
    (ids int32[..., k], counts int32[..., k], n int32[...], token int32[...],
    status int32[...]), ids/counts/n as `allocate_sparse`; refused rows have
    n = 0 and token -1.
  """
  x, u, t, b = _inputs("propose_sparse", logits, draw, temperature, bias)
  k = int(k)
  if not 1 <= k <= x.shape[-1]:
    raise ValueError(f"propose_sparse: k={k} not in [1, {x.shape[-1]}]")
  return _propose_sparse(x, t, u, b, k, executor)
