"""The worker's draw: a D-chain of dyadic q rows and the tokens drawn from them.

`draft_proposer(draft, caps)` builds the default proposer from the core
ops: for i = 0..D-1, the draft's logits of the position after x_{i-1}
(`DraftModel.step`; x_{-1} is the committed token before the anchor), then
the session's q format's row
(`QFormat.propose`: `propose_sparse` (top-k) or `propose_dense`, i.e.
`draft_weights`, the allocation, and x_i drawn from the counts with the
PROPOSAL key of (seed, generation, round, anchor + i) (`rng.
proposal_draw` of `rng.round_key`, what the verifier's sampling audit
recomputes, `audit.proposal_draws`); greedy: the argmax). A proposal is a
`qformats.Rows` of host numpy arrays: the record a REPLY's payload, a
staging slot and a verifier's plan hold too. The worker
leader is the only owner of these keys; a retry resends the cached bytes
instead of drawing again. Any callable with the same signature can replace
it (a model-specific draft, e.g. a parallel backbone with a Markov head).

The proposer keeps each request's draft handle (`DraftModel.init_state`,
e.g. a KV cache) between rounds, at most `max_states` of them (least
recently used first out); before a draw the draft catches it up to the
committed prefix the worker knows (`Propose.context`), and the D steps
run in the same jitted call as the q rows and the draws.

With `out` (the `Rows` views of a REPLY frame, from `Propose.rows`) the
proposer writes tokens, n and q straight into the frame: one copy from
the draft's output to the wire.

With `admission` (an `admission.AdaptiveDepth`; off by default) the chain
is drawn under that sequential stopping rule (`admission.draft_chain`):
one jitted draft step a position, the rule asked on the host (on the
statistics of the rows before position i, or with `lookahead` of row i
too), and only then x_i drawn; the proposal holds the d <=
depth admitted rows (d >= 1). Where drafts go into a REPLY frame (`out`)
the chain keeps the STEP's depth: a session that did not agree on
`Feature.ADAPTIVE_DEPTH` has the wire's fixed-depth contract. On one that
did (the worker asks for it when its proposer has a rule:
`DraftProposer.admission`), the worker calls without `out` and sends the
d rows (a short REPLY, `bridge.worker`); so does the one-process link
(`generate.Local`). The acceptance
of a request's previous proposal is read off its next call (the anchor
moves by accepted + 1) and recorded in the proposer's
`admission.AcceptanceHistory`, which the rule sees for later rounds only.
"""

import collections
import dataclasses
import typing

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np

from dyadic_jax import admission as admission_lib
from dyadic_jax import models, rng, rowops
from dyadic_jax.models import pool
from dyadic_jax.bridge import hello
from dyadic_jax.bridge.drafting import DraftProposer, Proposer
from dyadic_jax.bridge.effects import Call
from dyadic_jax.bridge.hello import MAX_POSITION
from dyadic_jax.errors import raise_for_status
from dyadic_jax.wire import qformats

_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1


def check_step(caps: hello.Capabilities, seed: int, generation: int,
               round_id: int, anchor: int, last_token: int,
               depth: int) -> None:
  """Raises ValueError unless the draw's inputs are within local bounds."""
  if not (0 <= seed <= _U64 and 0 <= generation <= _U32
          and 0 <= round_id <= _U32 and 1 <= depth <= caps.max_depth
          and 0 <= anchor and anchor + depth <= MAX_POSITION
          and 0 <= last_token < caps.vocab):
    raise ValueError(f"proposer: seed {seed}, generation {generation}, round "
                     f"{round_id}, anchor {anchor}, last token {last_token}, "
                     f"depth {depth} out of bounds")


def write(out: qformats.Rows, proposal: qformats.Rows) -> None:
  """Copies a proposal of d rows into the first d of the Rows views of
  a REPLY frame (all of them but for a short chain)."""
  depth = len(proposal.tokens)
  out.tokens[:depth] = proposal.tokens
  out.n[:depth] = proposal.n
  if out.values is not None:
    assert proposal.values is not None   # the frame's format carries q
    _copy(out.values[:depth], proposal.values)
  if out.ids is not None:
    assert proposal.ids is not None
    _copy(out.ids[:depth], proposal.ids)


def _copy(dst: np.ndarray, src: typing.Any) -> None:
  """np.copyto (same-kind casting: float ids are refused), as a plain
  assignment when the dtypes are equal (a third of the cost a request)."""
  if getattr(src, "dtype", None) == dst.dtype:
    dst[...] = src
  else:
    np.copyto(dst, src)


def _host(x: jax.Array | np.ndarray, block: bool = False) -> np.ndarray:
  """Host copy of a proposer output. With a mesh that spans processes:
  `block` (dense rows) is this rank's vocabulary block; anything else is
  the whole value (tokens, n, sparse rows: replicated, or gathered where
  the compiler left it split)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if block or x.is_fully_replicated:
    return np.asarray(x.addressable_shards[0].data)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def draft_proposer(
    draft: models.DraftModel | typing.Callable[[jax.Array], jax.Array],
    caps: hello.Capabilities, *,
    backbone_fn: typing.Callable[[jax.Array, jax.Array, int], jax.Array]
    | None = None,
    executor: rowops.Executor = rowops.LOCAL,
    max_states: int = 4096,
    admission: admission_lib.AdaptiveDepth | None = None
) -> "DraftProposer":
  """A proposer `(seed, generation, round_id, anchor, last_token, depth,
  out=None, *, request=None, context=None) -> qformats.Rows` (see
  `Proposer`).

  draft: a `dyadic_jax.models.DraftModel` (a per-request handle and a
    traceable step), or a jax-traceable `prev_token int32[] ->
    float32[V]`: the sequential part of the draft logits of the position
    after prev_token (a Markov head on x_{i-1}; `models.Markov`).
  backbone_fn: with a bare head only: optional jax-traceable
    `(last_token int32[], anchor int64[], depth) -> float32[depth, V]`, a
    parallel backbone that produces base logits for all D positions at
    once from the committed context; row i is added to the head's logits
    of x_{i-1} (a DSpark-style draft).
  executor: how the row ops run (`rowops.LOCAL`, or a mesh's executor: a
    tensor-parallel worker whose processes each hold one vocabulary block;
    every rank calls the proposer with the same inputs, the token draws are
    shard-then-token collectives, and each rank's dense rows are its own
    block, `caps.width` entries: `caps` of that rank's link).
  max_states: request handles kept between rounds (least recently used
    first out; a request whose handle went starts from `init_state`).
  admission: None (fixed depth: every call draws `depth` rows), or an
    `admission.AdaptiveDepth` with min_depth >= 1 (one device executor
    only): each call without `out` draws the rows it admits, 1..depth of
    them (see the module docstring).

  The returned proposer's `request` names whose handle to use and keep
  (None: a fresh handle, kept nowhere: the warm-up); `context` is the
  committed prefix the worker knows (`Propose.context`) or None.
  Raises ValueError on inputs out of bounds (`check_step`) and DyadicError
  when a draft row is refused (e.g. NaN draft logits).
  """
  if admission is not None and (admission.min_depth < 1
                                or executor is not rowops.LOCAL):
    raise ValueError("draft_proposer: adaptive admission needs min_depth "
                     ">= 1 (a REPLY carries 1..D rows) and one device")
  drafter = _Drafter(
      models.as_draft(draft, backbone=backbone_fn, depth=caps.max_depth),
      caps, executor, max_states, admission)
  return DraftProposer(drafter.propose, drafter.many, drafter.forget,
                       drafter.slabs is not None and drafter.adaptive is None,
                       admission, bool(getattr(draft, "wants_context", False)))


class _Drafter:
  """`draft_proposer`'s proposer: one row step (`row`: a position's
  PROPOSAL draw and q format row) under its three chain shapes: one
  request's D steps in one jitted call (`_chain`), every request of a
  round on a draft slab in one jitted call (`_chains`), and the adaptive
  rule's host loop (`_Adaptive`)."""

  def __init__(self, model: models.DraftModel, caps: hello.Capabilities,
               executor: rowops.Executor, max_states: int,
               admission: admission_lib.AdaptiveDepth | None) -> None:
    self.model, self.caps, self.executor = model, caps, executor
    self.fmt = caps.format
    self.max_states = max_states
    # Request handles kept between rounds, least recently used first.
    self.states: collections.OrderedDict[int, models.State] = (
        collections.OrderedDict())
    self.adaptive = (None if admission is None else
                     _Adaptive(model, caps, admission, max_states, self.row))
    # One draft slab per group of requests in flight (`models.pool`).
    self.slabs = (pool.SlabPool(lambda: typing.cast(typing.Any, model).batch(
        caps.max_requests), caps.max_slots) if hasattr(model, "batch")
                  else None)
    self._chain = jax.jit(self._chain_impl, static_argnums=(5,))
    self._chains = jax.jit(self._chains_impl,
                           static_argnames=("depth", "span", "kind"),
                           donate_argnames="slab_")

  def row(self, logits: jax.Array, key: jax.Array, position: jax.Array
          ) -> tuple[typing.Any, ...]:
    """One drafted position: its PROPOSAL draw and its q format's row
    (token, status, values, ids, n): the step of every chain shape."""
    draw = rng.proposal_draw(key, position) if self.fmt.sampled else None
    return self.fmt.propose(logits, draw, self.caps.width, self.executor)

  def _chain_impl(self, seed: jax.Array, generation: jax.Array,
                  round_id: jax.Array, anchor: jax.Array,
                  last_token: jax.Array, depth: int, state: models.State
                  ) -> tuple[typing.Any, models.State]:
    key = rng.round_key(seed, generation, round_id)
    prev = last_token
    out = []
    for i in range(depth):
      logits, state = self.model.step(state, prev)
      prev, *rest = self.row(logits, key, anchor + i)
      out.append((prev, *rest))
    # (tokens, status, values, ids, n), each stacked over the depth.
    return tuple(jnp.stack(parts) if parts[0] is not None else None
                 for parts in zip(*out)), state

  def _chains_impl(self, weights: typing.Any, slab_: typing.Any,
                   feed: typing.Any, seeds: jax.Array, generations: jax.Array,
                   rounds: jax.Array, anchors: jax.Array, *, depth: int,
                   span: int, kind: typing.Any
                   ) -> tuple[tuple[typing.Any, ...], typing.Any]:
    # Every slot's chain at once (idle slots too: their rows are dropped);
    # kind: the slab's traced halves (`batched.DraftSteps`).
    keys = rng.round_keys(seeds, generations, rounds)
    out = []
    logits, slab_ = kind.first(weights, slab_, feed, span)
    prev = None
    for i in range(depth):
      if i:
        logits, slab_ = kind.step(weights, slab_, feed, prev, i, span)
      prev, *rest = jax.vmap(self.row)(logits, keys, anchors + i)
      out.append((prev, *rest))
    return tuple(jnp.stack(parts, axis=1) if parts[0] is not None else None
                 for parts in zip(*out)), slab_

  def many(self, calls: typing.Sequence[Call],
           depth: int) -> list[qformats.Rows]:
    """One proposal per call, the draft's D steps of every request in one
    jitted call where the draft offers a slab (`DraftModel.batch`), else
    one call each."""
    caps, slabs = self.caps, self.slabs
    if slabs is None or self.adaptive is not None:
      # The adaptive rule decides row by row on the host: one call each.
      return [self.propose(c.seed, c.generation, c.round, c.anchor,
                           c.last_token, depth, request=c.request,
                           context=c.context) for c in calls]
    for c in calls:
      check_step(caps, int(c.seed), int(c.generation), int(c.round),
                 int(c.anchor), int(c.last_token), int(depth))
    slab = slabs.pick([c.request for c in calls])
    feed, span, slots = slab.prepare([c.request for c in calls],
                                     [c.context for c in calls], depth)
    # Idle slots draw with zero coordinates; their rows are dropped.
    coords = np.zeros((4, caps.max_requests), np.int64)
    for slot, c in zip(slots, calls):
      coords[:, slot] = (np.uint64(c.seed).view(np.int64), c.generation,
                         c.round, c.anchor)
    with jax.enable_x64(True):
      parts, slab.slab = self._chains(
          slab.weights, slab.slab, feed, coords[0],
          coords[1].astype(np.uint32), coords[2].astype(np.uint32),
          coords[3], depth=int(depth), span=span, kind=slab.kind)
    index = np.asarray(slots)
    tokens, status, values, ids, n = [
        None if p is None else np.asarray(p)[index] for p in parts]
    raise_for_status("draft_proposer", status)
    assert tokens is not None and n is not None   # every format has both
    slab.finish(slots, tokens)
    return [qformats.Rows(tokens[b].astype(np.int32),
                          np.asarray(n[b], np.int32),
                          None if ids is None else ids[b],
                          None if values is None else values[b])
            for b in range(len(calls))]

  def forget(self, request: int) -> None:
    """Drops request `request`'s handle (both the per-call and the slab's)."""
    self.states.pop(request, None)
    if self.slabs is not None:
      self.slabs.drop(request)

  def propose(self, seed: int, generation: int, round_id: int, anchor: int,
              last_token: int, depth: int,
              out: qformats.Rows | None = None, *,
              request: int | None = None,
              context: np.ndarray | None = None) -> qformats.Rows:
    check_step(self.caps, int(seed), int(generation), int(round_id),
               int(anchor), int(last_token), int(depth))
    states = self.states
    state = states.pop(request, None) if request is not None else None
    if state is None:
      state = self.model.init_state()
    state = self.model.catch_up(state, context, int(last_token), int(anchor))
    with jax.enable_x64(True):
      # A REPLY frame (`out`) is laid out for the STEP's depth: the wire's
      # fixed-depth contract holds whatever the rule (docs/wire.md).
      if self.adaptive is not None and out is None:
        parts, state = self.adaptive.chain(int(seed), int(generation),
                                           int(round_id), int(anchor),
                                           int(last_token), int(depth),
                                           state, request, context)
      else:
        parts, state = self._chain(np.uint64(seed).view(np.int64),
                                   np.uint32(generation), np.uint32(round_id),
                                   np.int64(anchor), np.int32(last_token),
                                   int(depth), state)
    if request is not None:
      states[request] = state
      while len(states) > self.max_states:
        states.popitem(last=False)
    # Under a mesh a shardable format's values are this rank's block.
    tokens, status, values, ids, n = [
        None if p is None else _host(p, block=self.fmt.shardable and i == 2)
        for i, p in enumerate(parts)]
    raise_for_status("draft_proposer", status)
    assert tokens is not None     # every format draws tokens
    proposal = qformats.Rows(tokens.astype(np.int32),
                             np.asarray(n, np.int32), ids, values)
    if out is not None:
      write(out, proposal)
    return proposal


class _Sent(typing.NamedTuple):
  """A request's last adaptive proposal, until its next call says how
  many of its rows were accepted."""
  generation: int
  anchor: int
  rows: tuple[admission_lib.RowStats, ...]


class _Adaptive:
  """`draft_proposer`'s chain under an `AdaptiveDepth` (host loop)."""

  def __init__(self, model: models.DraftModel, caps: hello.Capabilities,
               rule: admission_lib.AdaptiveDepth, max_states: int,
               row_step: typing.Callable[..., tuple[typing.Any, ...]]
               ) -> None:
    self.rule = rule
    self.history = admission_lib.acceptance_history(caps.max_depth)
    self.sent: collections.OrderedDict[int, _Sent] = (
        collections.OrderedDict())
    self.max_states = max_states

    @jax.jit
    def row(state: models.State, prev: jax.Array) -> typing.Any:
      logits, state = model.step(state, prev)
      # Statistics of the row x_i is drawn from: computed before x_i is.
      probs = jax.nn.softmax(logits.astype(jnp.float32))
      entropy = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(
          jnp.where(probs > 0, probs, 1.0)), 0.0))
      return logits, state, jnp.max(probs), entropy

    self.row, self.draw = row, jax.jit(row_step)   # one device: LOCAL
    self.round_key = jax.jit(rng.round_key)

  def _learn(self, request: int | None, generation: int,
             anchor: int) -> None:
    """Records the request's previous proposal: its next anchor is the
    old one plus accepted + 1 (anything else, e.g. a new generation, is
    not recorded)."""
    sent = self.sent.pop(request, None) if request is not None else None
    if sent is None or sent.generation != generation:
      return
    accepted = anchor - sent.anchor - 1
    if 0 <= accepted <= len(sent.rows):
      self.history = admission_lib.record_round(
          self.history, sent.rows, accepted, self.rule.step_cost,
          self.rule.lookahead)

  def chain(self, seed: int, generation: int, round_id: int, anchor: int,
            last_token: int, depth: int, state: models.State,
            request: int | None, context: np.ndarray | None
            ) -> tuple[typing.Any, models.State]:
    self._learn(request, generation, anchor)
    rule = self.rule
    if rule.max_depth != depth:
      rule = dataclasses.replace(rule, max_depth=depth,
                                 min_depth=min(rule.min_depth, depth))
    key = self.round_key(np.uint64(seed).view(np.int64),
                         np.uint32(generation), np.uint32(round_id))
    prev = [np.int32(last_token)]
    logits: list[jax.Array] = []
    seen: list[admission_lib.RowStats] = []
    out: list[typing.Any] = []
    carry = [state]

    def row_stats(i: int, drafted: tuple[int, ...]
                  ) -> admission_lib.RowStats:
      del drafted          # the handle holds them: prev[-1] is x_{i-1}
      lg, carry[0], top, entropy = self.row(carry[0], prev[-1])
      logits.append(lg)
      seen.append(admission_lib.RowStats(float(top), float(entropy)))
      return seen[-1]

    def draw(i: int, drafted: tuple[int, ...]) -> int:
      del drafted
      parts = self.draw(logits[i], key, np.int64(anchor + i))
      out.append(parts)
      prev.append(parts[0])
      return int(parts[0])

    admission_lib.draft_chain(
        rule, draw, max_depth=depth,
        committed=() if context is None else tuple(int(t) for t in context),
        row=row_stats, history=self.history, lookahead=rule.lookahead)
    if request is not None:
      # The admitted rows only: a stop's row was never verified.
      self.sent[request] = _Sent(generation, anchor, tuple(seen[:len(out)]))
      while len(self.sent) > self.max_states:
        self.sent.popitem(last=False)
    return tuple(jnp.stack(parts) if parts[0] is not None else None
                 for parts in zip(*out)), carry[0]
