"""The numeric half of a round: target rows, verification, the fallback.

    engine = Engine(caps, target, verify_fn=verify_batch)
    outcomes = engine.run(chains, codes, rows, counts)

What every verifier runs once a round's q is known, with no socket and no
session: the bridge's `Verifier` (the leader and each follower rank, on
the plan they share) and the one-process link `generate.Local` (on its
proposer's rows). Each chain of the round is one request (`Chain`: its
committed prefix, seed and round tag); its row of `rows` holds its drafted
tokens and q layout, and `counts` the validated q.

* `target_rows(chains, drafts)`: the target's float32[len(draft) + 1, V]
  rows after each chain's prefix and drafted tokens (`TargetModel.logits`,
  processors applied). Each request's handle (a KV cache) is kept between
  rounds under its request id until `drop`. The only place a round calls
  the target: batching the target over requests changes this method.
* `verify(chains, logits, rows, counts, index, lengths)`: the plan rows
  `index` verified in one `verify_fn` call, padded to `caps.max_requests`
  rows (copies of the first; one compiled shape for every round and
  depth): accepted, token and status int32[R], R = len(chains). Keys:
  each chain's round key, `rng.round_key(seed, generation, round)`
  (`round_keys`), anchor the prefix's length. Chains of several lengths
  (`lengths`: adaptive depth, a session that agreed on ADAPTIVE_DEPTH or
  `generate.Local` with a rule) are verified in one call per length, each
  on its first d rows and the target's d + 1 rows (the correction or
  bonus row the one after its last drafted token). A greedy session (no
  q) verifies by the target's argmax instead (`greedy_verify`), status 0.
* `fallback(chains)`: one token per chain from the target alone: its row
  after the prefix (an empty draft), drawn by `sample_fn` with the
  TARGET_ONLY key of (seed, generation, round, anchor).
* `run(chains, codes, rows, counts, lengths)`: a round's `Outcome` per row: the
  fallback's token where codes[i] != 0 (the proposal was discarded), else
  the verified one; a row that `verify_fn` refuses (status != 0, e.g. NaN
  target logits) becomes a fallback too, its Code in `Outcome.code`.
* `warmup(prefix, example_q)`: compiles all of the above before a first
  round.

`verify_fn` is `dyadic_jax.verify_batch` or the sharded
`sharding.verify_batch` with its mesh bound (the bridge never imports
`sharding`), `sample_fn` `dyadic_jax.sample_target` or its sharded twin;
both are called eagerly (a caller may pass timed wrappers).
"""

import functools
import typing

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax import models, rng, verification
from dyadic_jax.models import pool
from dyadic_jax.bridge import hello
from dyadic_jax.bridge.effects import Counts
from dyadic_jax.errors import raise_for_status
from dyadic_jax.wire import qformats
from dyadic_jax.wire import status as status_lib
from dyadic_jax.wire.layouts import Feature

__all__ = ["Chain", "Engine", "Outcome", "SampleFn", "TargetFn", "Verified",
           "VerifyFn", "greedy_verify", "round_keys"]

# target_fn(prefix, draft): float32[len(draft) + 1, V] target logits.
TargetFn = typing.Callable[[np.ndarray, np.ndarray], jax.Array]
# verify_fn(target_logits [B, D+1, V], q [B, D, ...], draft [B, D], keys
# [B], anchors [B]) -> (accepted [B], token [B], status [B]):
# `dyadic_jax.verify_batch`, or the sharded one.
VerifyFn = typing.Callable[
    [jax.typing.ArrayLike, qformats.Q, jax.typing.ArrayLike, jax.Array,
     jax.typing.ArrayLike],
    tuple[jax.Array, jax.Array, jax.Array]]
# sample_fn(logits [V], key) -> (token, status): the target alone.
SampleFn = typing.Callable[[jax.Array, jax.Array],
                           tuple[jax.Array, jax.Array]]


class Chain(typing.NamedTuple):
  """One request in one round, as the engine reads it (host values)."""
  rid: int                        # whose target handle
  prefix: typing.Sequence[int]    # committed tokens, prompt first; the
                                  # anchor (position of x_1) is its length
  seed: int                       # uint64 request seed
  generation: int                 # uint32
  round: int                      # uint32


class Verified(typing.NamedTuple):
  """`Engine.verify`'s result for R chains (host arrays)."""
  accepted: np.ndarray   # int32[R] drafted tokens accepted
  token: np.ndarray      # int32[R] correction or bonus token
  status: np.ndarray     # int32[R] 0, or the row's refusal Status


class Outcome(typing.NamedTuple):
  """What a rank's execution of one plan row committed."""
  accepted: int
  token: int
  code: int = 0       # nonzero: verification refused, a counted fallback


def greedy_verify(target_logits: jax.typing.ArrayLike,
                  draft_tokens: np.ndarray) -> tuple[int, int]:
  """Greedy point-mass verification: accept while x_i is the target argmax."""
  best = np.argmax(np.asarray(target_logits), axis=-1)
  accepted = 0
  while accepted < len(draft_tokens) and draft_tokens[accepted] == best[
      accepted]:
    accepted += 1
  return accepted, int(best[accepted])


_round_keys = jax.jit(rng.round_keys)


@jax.jit
@jax.vmap
def _fallback_keys(seed: jax.Array, generation: jax.Array,
                   round_id: jax.Array, anchor: jax.Array) -> jax.Array:
  return rng.draw_key(rng.round_key(seed, generation, round_id), anchor,
                      rng.Domain.TARGET_ONLY)


def seed_view(seeds: ArrayLike) -> np.ndarray:
  """uint64 seeds as the int64 view the keys are traced with."""
  return np.asarray(seeds, np.uint64).view(np.int64)


def _coordinates(seeds: ArrayLike, generations: ArrayLike,
                 rounds: ArrayLike) -> tuple[np.ndarray, ...]:
  return (seed_view(seeds), np.asarray(generations, np.uint32),
          np.asarray(rounds, np.uint32))


def fallback_keys_traced(seeds: jax.Array, generations: jax.Array,
                         rounds: jax.Array, anchors: jax.Array) -> jax.Array:
  """`fallback_keys` inside a caller's trace (64-bit mode on): seeds as
  `seed_view`, generations and rounds uint32, anchors int64, each [R]."""
  return _fallback_keys(seeds, generations, rounds, anchors)


def round_keys(seeds: ArrayLike, generations: ArrayLike,
               rounds: ArrayLike) -> jax.Array:
  """Typed round keys [R] of R requests in one dispatch: the same keys as
  `rng.round_key(seed, generation, round)` of each (seeds uint64[R],
  generations and rounds in the uint32 range)."""
  with jax.enable_x64(True):
    return _round_keys(*_coordinates(seeds, generations, rounds))


def fallback_keys(seeds: ArrayLike, generations: ArrayLike,
                  rounds: ArrayLike, anchors: ArrayLike) -> jax.Array:
  """Typed TARGET_ONLY keys [R] in one dispatch: `rng.draw_key(round_key,
  anchor, Domain.TARGET_ONLY)` of each request (anchors int64[R])."""
  with jax.enable_x64(True):
    return _fallback_keys(*_coordinates(seeds, generations, rounds),
                          np.asarray(anchors, np.int64))


class Engine:
  """A round's numeric half for one verifier (see the module docstring)."""

  def __init__(self, caps: hello.Capabilities, target: models.TargetModel,
               *, verify_fn: VerifyFn = verification.verify_batch,
               sample_fn: SampleFn = verification.sample_target) -> None:
    self.caps = caps
    self.target = target
    self.verify_fn = verify_fn
    self.sample_fn = sample_fn
    self.states: dict[int, models.State] = {}    # rid -> target handle
    # Where the target offers slabs: one per group of requests in flight
    # (`max_slots`), each of `max_requests` slots.
    self.batch: pool.TargetPool | None = None
    if hasattr(target, "batch"):
      batch = typing.cast(typing.Any, target).batch
      self.batch = pool.TargetPool(lambda: batch(caps.max_requests),
                                   caps.max_slots)

  def drop(self, rid: int) -> None:
    """Forgets request `rid`'s target handle."""
    self.states.pop(rid, None)
    if self.batch is not None:
      self.batch.drop(rid)

  def target_rows(self, chains: typing.Sequence[Chain],
                  drafts: typing.Sequence[np.ndarray]) -> list[jax.Array]:
    """float32[len(draft) + 1, V] per chain (see the module docstring)."""
    if self.batch is not None and chains:
      return self._batched_rows(chains, drafts)
    out = []
    for chain, draft in zip(chains, drafts):
      state = self.states.pop(chain.rid, None)
      if state is None:
        state = self.target.init_state()
      rows, self.states[chain.rid] = self.target.logits(
          state, np.asarray(chain.prefix, np.int32), draft)
      out.append(rows)
    return out

  def _batched_rows(self, chains: typing.Sequence[Chain],
                    drafts: typing.Sequence[np.ndarray]) -> list[jax.Array]:
    """`target_rows` through the slab: one call per distinct draft length
    (one call in a fixed-depth round)."""
    assert self.batch is not None
    out: list[jax.Array | None] = [None] * len(chains)
    lengths = [len(d) for d in drafts]
    for d in sorted(set(lengths)):
      group = [i for i, n in enumerate(lengths) if n == d]
      rows = self.batch.rows(
          [chains[i].rid for i in group],
          [np.asarray(chains[i].prefix, np.int32) for i in group],
          np.stack([np.asarray(drafts[i], np.int32) for i in group])
          .reshape(len(group), d))
      for j, i in enumerate(group):
        out[i] = rows[j]
    return typing.cast(list[jax.Array], out)

  def verify(self, chains: typing.Sequence[Chain],
             logits: typing.Sequence[jax.Array], rows: qformats.Rows,
             counts: Counts,
             index: typing.Sequence[int] | None = None,
             lengths: ArrayLike | None = None) -> Verified:
    """Rows `index` of `rows` and `counts` (default all), one per chain,
    verified on their logits (see the module docstring). lengths: each
    chain's drafted rows (int[R], parallel to `chains`; None: every row
    of `rows`); chain i's logits then hold lengths[i] + 1 rows."""
    index = list(range(len(chains)) if index is None else index)
    depth = rows.tokens.shape[-1]
    sizes = (np.full(len(chains), depth) if lengths is None
             else np.asarray(lengths).reshape(len(chains)))
    if self.caps.greedy:
      out = [greedy_verify(x, np.asarray(rows.tokens[i][:d]))
             for x, i, d in zip(logits, index, sizes)]
      return Verified(np.asarray([a for a, _ in out], np.int32),
                      np.asarray([t for _, t in out], np.int32),
                      np.zeros(len(out), np.int32))
    if (sizes != depth).any():
      # One call per length: each verified on its own rows.
      got = np.zeros((3, len(chains)), np.int32)
      for d in np.unique(sizes):
        group = [int(j) for j in np.flatnonzero(sizes == d)]
        part = self._verify_rows(
            [chains[j] for j in group], [logits[j] for j in group], rows,
            counts, [index[j] for j in group], int(d))
        got[:, group] = part
      return Verified(*got)
    return Verified(*self._verify_rows(chains, logits, rows, counts, index,
                                       depth))

  def _verify_rows(self, chains: typing.Sequence[Chain],
                   logits: typing.Sequence[jax.Array], rows: qformats.Rows,
                   counts: Counts, index: list[int], depth: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`verify` of chains that all draft `depth` rows (their first
    `depth` rows of `rows`): (accepted, token, status)."""
    pad = self.caps.max_requests - len(chains)
    padded = index + [index[0]] * pad
    idx = np.asarray(padded)
    if padded != list(range(len(rows.tokens))):
      assert counts is not None     # sampled rows carry their counts
      counts = counts[idx]
    take = rows.take(idx)
    if depth < rows.tokens.shape[-1]:
      take = qformats.Rows(
          take.tokens[:, :depth], take.n[:, :depth],
          None if take.ids is None else take.ids[:, :depth],
          None if take.values is None else take.values[:, :depth])
      assert counts is not None
      counts = counts[:, :depth]
    q = self.caps.format.to_q(counts, take)
    zeros = [0] * pad
    keys = round_keys([c.seed for c in chains] + zeros,
                      [c.generation for c in chains] + zeros,
                      [c.round for c in chains] + zeros)
    anchors = np.asarray([len(c.prefix) for c in chains] + zeros, np.int64)
    batch = jnp.stack(list(logits) + [logits[0]] * pad)
    accepted, token, status = (
        np.asarray(a)[:len(chains)]
        for a in self.verify_fn(batch, q, take.tokens, keys, anchors))
    return accepted, token, status

  def fallback(self, chains: typing.Sequence[Chain]) -> list[int]:
    """One target-only token per chain (see the module docstring)."""
    if not chains:
      return []
    logits = self.target_rows(chains, [np.zeros(0, np.int32)] * len(chains))
    # Padded to max_requests: one compiled shape however many fall back.
    zeros = [0] * max(0, self.caps.max_requests - len(chains))
    keys = fallback_keys([c.seed for c in chains] + zeros,
                         [c.generation for c in chains] + zeros,
                         [c.round for c in chains] + zeros,
                         [len(c.prefix) for c in chains] + zeros)
    out = []
    for row, key in zip(logits, keys):
      token, status = self.sample_fn(row[0], key)
      raise_for_status("sample_fn", status)
      out.append(int(token))
    return out

  def run(self, chains: typing.Sequence[Chain], codes: np.ndarray,
          rows: qformats.Rows, counts: Counts,
          lengths: ArrayLike | None = None) -> list[Outcome]:
    """The Outcome of every row (see the module docstring). lengths:
    each row's drafted rows (int[R]; None: all of `rows`' D)."""
    sizes = (np.full(len(chains), rows.tokens.shape[-1]) if lengths is None
             else np.asarray(lengths).reshape(len(chains)))
    outcomes: list[Outcome | None] = [None] * len(chains)
    discarded = [i for i in range(len(chains)) if codes[i]]
    for i, token in zip(discarded, self.fallback([chains[i]
                                                  for i in discarded])):
      outcomes[i] = Outcome(0, token)
    verified = [i for i in range(len(chains)) if not codes[i]]
    if verified:
      mine = [chains[i] for i in verified]
      logits = self.target_rows(mine, [np.array(rows.tokens[i][:sizes[i]])
                                       for i in verified])
      got = self.verify(mine, logits, rows, counts, verified,
                        sizes[verified])
      for j, i in enumerate(verified):
        status, token = int(got.status[j]), int(got.token[j])
        if status or token < 0:
          # The verifier refused the row (e.g. NaN target logits): a
          # counted fallback to the target alone, never a committed -1.
          code = int(status_lib.codes([status or 1])[0])
          logging.log_every_n_seconds(
              logging.WARNING, "verify_fn refused request %d: status %d",
              1.0, chains[i].rid, status)
          outcomes[i] = Outcome(0, self.fallback([chains[i]])[0], code)
        else:
          outcomes[i] = Outcome(int(got.accepted[j]), token)
    return typing.cast(list[Outcome], outcomes)

  def warmup(self, prefix: typing.Sequence[int],
             example_q: typing.Callable[[int], qformats.Q],
             say: typing.Callable[[str], None] = lambda _: None) -> None:
    """Compiles (and runs once) what a round calls: the target on a fresh
    handle, on a handle that holds the prefix (a round after a rejection)
    and on the fallback's single row, `verify_fn` on a full batch of
    `example_q(max_depth)` (`Validator.example_q`: a q of max_requests
    rows as the rounds hand it over; None: no q, no verification to
    compile; with capabilities that name ADAPTIVE_DEPTH, every depth
    below it too), the keys and `sample_fn`, in this order (on several ranks
    some are collectives). prefix: a committed prefix of the rounds'
    shape; say: told what compiles next. Handles made here are kept
    nowhere."""
    d, r = self.caps.max_depth, self.caps.max_requests
    committed = np.asarray(prefix, np.int32)
    draft = np.zeros(d, np.int32)
    later = np.append(committed, draft[0])     # x_1 rejected, x_1 drawn
    if self.batch is not None:
      logits = self._warm_batch(committed, later, draft, say)
    else:
      target = self.target
      say("the target's rows of a new request (its prompt and a chain)")
      logits, state = target.logits(target.init_state(), committed, draft)
      say("the target's rows of a round and of a fallback")
      _, state = target.logits(state, later, draft)
      target.logits(state, later, draft[:0])   # the fallback's row
    zeros = np.zeros(r, np.int64)
    q = example_q(d)
    if q is not None:
      say("verification of a full batch")
      keys = round_keys(zeros, zeros, zeros)
      # Capabilities that name ADAPTIVE_DEPTH: chains of 1..D rows.
      short = (range(d - 1, 0, -1)
               if self.caps.features & Feature.ADAPTIVE_DEPTH else ())
      for depth in (d, *short):
        jax.block_until_ready(self.verify_fn(
            jnp.stack([logits[:depth + 1]] * r),
            q if depth == d else example_q(depth),
            np.zeros((r, depth), np.int32), keys,
            np.full(r, len(committed))))
    say("the target-only sampler")
    key = fallback_keys(zeros, zeros, zeros, zeros)[0]
    jax.block_until_ready(self.sample_fn(logits[0], key))

  def _warm_batch(self, committed: np.ndarray, later: np.ndarray,
                  draft: np.ndarray, say: typing.Callable[[str], None]
                  ) -> jax.Array:
    """`warmup`'s target part on the slab: a full batch of new requests,
    of rounds and of fallbacks (a call has a row per slot whatever the
    batch); the slots are freed after."""
    assert self.batch is not None
    r = self.caps.max_requests
    rids = [-1 - i for i in range(r)]           # ids no request has
    try:
      say("the target's rows of new requests (their prompts and a chain)")
      logits = self.batch.rows(rids, [committed] * r, np.stack([draft] * r))
      say("the target's rows of a round and of a fallback")
      self.batch.rows(rids, [later] * r, np.stack([draft] * r))
      self.batch.rows(rids, [later] * r, np.zeros((r, 0), np.int32))
    finally:
      for rid in rids:
        self.batch.drop(rid)
    return logits[0]
