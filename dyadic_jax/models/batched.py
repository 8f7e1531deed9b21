"""The transformer target's batched handles: a round's rows in one call.

    batch = target.batch(capacity=4)          # a `SlabTarget`
    rows = batch.rows(rids, prefixes, drafts)  # f32[B, D + 1, V]
    tokens, status = batch.decode(rids, prefixes, steps, sample, aux)

`TransformerTarget.logits` serves one request per call, so a round of B
requests costs B passes over the weights and B dispatches. A `SlabTarget`
keeps every request's KV cache in one `transformer.Slab` (one slot per
request, plus a scratch slot for padding rows) and the host tokens each
slot covers, and scores the D + 1 rows of every request with one
`transformer.extend_slots` call: per-row starts (ragged lengths in a
fixed-shape slab; a slot the call does not serve is an idle row),
attention over the filled prefix only (the span bucketed to a power of two), the slab donated
so the C new entries per row are written in place.

Each request follows the `TargetModel.logits` invariant: its slot covers
the longest common prefix of what it was fed and the new prefix, at most
P - 1 tokens (the last committed token is always refed), so the steady
state of a round feeds [prefix[-1], x_1..x_D] per request. A request whose
slot lags further (new, or a prompt change) is first brought to P - 1
alone, in the bucketed chunks of `transformer.feed`.

`decode` is the target-only baseline's fast path: `steps` one-token steps
of every request in one jitted `lax.scan`, the draw fused in (a traceable
`sample` the caller provides; the generator's draws the TARGET_ONLY key of
each position), so a step costs one pass and no dispatch.

Rows of a batched call equal the one-request rows up to float32 rounding
(the batch changes the summation order of nothing but can change the
kernels XLA picks); docs/numerics.md section 12 says which rows are the
target's distribution, and tests/models/test_batched.py bounds the
difference per request in batches of mixed lengths.
"""

import collections
import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax.models import transformer
from dyadic_jax.models import vocab_map
from dyadic_jax.models.protocols import Sampler


@functools.partial(jax.jit,
                   static_argnames=("span", "steps", "sample", "arch"),
                   donate_argnames="slab")
def _decode(weights: transformer.Unstacked, slab: transformer.Slab,
            last: jax.Array, starts: jax.Array, stops: jax.Array,
            aux: typing.Any, *, span: int, steps: int, sample: Sampler,
            arch: transformer.Arch
            ) -> tuple[jax.Array, jax.Array, transformer.Slab]:
  idle = slab.k[0].shape[2]          # max_len: a row there writes nothing
  def body(carry, s):
    slab, token, pos = carry
    # A row past its own steps (stops[b]) idles: nothing fed past its
    # edge, token -1 and status 0 for the steps it does not run.
    runs = s < stops
    logits, slab = transformer.extend_slots_traced(
        weights, slab, token[:, None], jnp.where(runs, pos, idle), span,
        arch)
    new, status = sample(logits[:, 0], s, aux)
    new = jnp.where(runs, new, -1)
    status = jnp.where(runs, status, 0)
    # A refused row draws -1 (the caller raises on its status): feed a
    # valid id meanwhile, never an out-of-range gather.
    fed = jnp.maximum(new, 0).astype(jnp.int32)
    return (slab, fed, pos + 1), (new, status)

  # The scan carries the span alone: XLA CPU copies a loop-carried
  # buffer it scatters into, and the whole slab (4 x 377 MB for SmolLM2
  # at 2,048 positions) per step cost 15x the step. Every position this
  # call writes or reads is below span.
  head = transformer.Slab(k=tuple(x[:, :, :span] for x in slab.k),
                          v=tuple(x[:, :, :span] for x in slab.v))
  (head, _, _), (tokens, status) = jax.lax.scan(
      body, (head, last, starts), jnp.arange(steps, dtype=jnp.int32))
  slab = transformer.Slab(
      k=tuple(x.at[:, :, :span].set(h) for x, h in zip(slab.k, head.k)),
      v=tuple(x.at[:, :, :span].set(h) for x, h in zip(slab.v, head.v)))
  return tokens.T, status.T, slab


class _Slots:
  """Slot bookkeeping shared by the two slabs: which request holds which
  slot (lowest free first; when all are taken, the least recently used
  request outside the call gives its slot up and is brought up again from
  nothing when it returns: slower, never wrong), the tokens each slot's
  cache covers, and feeding lagging slots together."""

  def __init__(self, name: str, params: transformer.Params,
               config: transformer.Config, capacity: int) -> None:
    if capacity < 1:
      raise ValueError(f"{name}: capacity must be >= 1, got {capacity}")
    self.name = name
    self.weights: typing.Any = transformer.unstack(params)
    self.model_weights = self.weights
    self.config = config
    self.arch = transformer.arch_of(config)
    self.capacity = capacity
    self.slab = transformer.empty_slab(config, capacity)
    self.covered: dict[int, np.ndarray] = {}   # slot -> tokens it holds
    # rid -> slot, least recently used first.
    self.slot_of: collections.OrderedDict[int, int] = (
        collections.OrderedDict())
    self.free = list(range(capacity))

  def holds(self, rid: int) -> bool:
    """Whether request `rid` has a slot."""
    return rid in self.slot_of

  def drop(self, rid: int) -> None:
    """Forgets request `rid`'s handle (its slot is free again)."""
    slot = self.slot_of.pop(rid, None)
    if slot is not None:
      self.covered.pop(slot, None)
      self.free.append(slot)

  def _slots(self, rids: typing.Sequence[int]) -> list[int]:
    """The slot of each of a call's requests (distinct, at most
    `capacity`), assigned where new."""
    if len(set(rids)) != len(rids):
      raise ValueError(f"{self.name}: a request appears twice in one call")
    if len(rids) > self.capacity:
      raise ValueError(f"{self.name}: {len(rids)} requests in one call, "
                       f"capacity {self.capacity}")
    slots = []
    for rid in rids:
      if rid not in self.slot_of:
        if not self.free:
          # Evict the least recently used request this call does not serve.
          gone = next(r for r in self.slot_of if r not in rids)
          self.drop(gone)
        slot = min(self.free)
        self.free.remove(slot)
        self.slot_of[rid] = slot
        self.covered[slot] = np.zeros(0, np.int32)
      self.slot_of.move_to_end(rid)
      slots.append(self.slot_of[rid])
    return slots

  def _model_ids(self, tokens: np.ndarray) -> np.ndarray:
    """The model's ids of host tokens (the same, but for a draft over a
    restricted vocabulary)."""
    return tokens

  def _kept(self, slot: int, tokens: np.ndarray, most: int) -> int:
    """How many of `tokens` the slot holds already (at most `most`)."""
    have = self.covered[slot]
    n = min(len(have), most)
    diff = np.flatnonzero(have[:n] != tokens[:n])
    return int(diff[0]) if diff.size else n

  def _feed(self, todo: list[tuple[int, np.ndarray, int]]) -> None:
    """Feeds each (slot, tokens, start) of `todo` at positions start..,
    every slot in the same calls (ragged: `transformer.extend_slots`'
    counts), in chunks of at most `transformer.MAX_CHUNK` padded to a
    power of two; the slots not in `todo` idle."""
    max_len = self.config.max_len
    todo = [item for item in todo if item[1].size]
    while todo:
      c = min(transformer.MAX_CHUNK,
              1 << (max(t.size for _, t, _ in todo) - 1).bit_length())
      chunk = np.zeros((self.capacity, c), np.int32)
      starts = np.full(self.capacity, max_len, np.int32)
      counts = np.ones(self.capacity, np.int32)
      for slot, tokens, start in todo:
        real = min(tokens.size, c)
        chunk[slot, :real] = tokens[:real]
        starts[slot], counts[slot] = start, real
      _, self.slab = transformer.extend_slots(self.model_weights, self.slab,
                                              self._model_ids(chunk), starts,
                                              counts, arch=self.arch)
      todo = [(slot, tokens[c:], start + c) for slot, tokens, start in todo
              if tokens.size > c]


class SlabTarget(_Slots):
  """`TargetBatch` over a `TransformerTarget`'s weights (module doc).

  Args:
    params, config: the target.
    capacity: the most requests held at once (the session's max_requests).
  """

  def __init__(self, params: transformer.Params, config: transformer.Config,
               capacity: int) -> None:
    super().__init__("SlabTarget", params, config, capacity)

  @property
  def vocab(self) -> int:
    return self.config.vocab

  def _catch_up(self, rids: typing.Sequence[int],
                prefixes: typing.Sequence[np.ndarray],
                extra: int | np.ndarray) -> list[int]:
    """Brings each request's slot to cover its prefix[:-1] (the lagging
    ones together); returns their slots.

    extra: tokens the caller feeds after prefix[-1] (the context check),
      an int for every request or int[B] per request.
    """
    checked = []
    extras = np.broadcast_to(np.asarray(extra, np.int64), (len(rids),))
    for rid, prefix, more in zip(rids, prefixes, extras):
      prefix = np.asarray(prefix, np.int32)
      if prefix.ndim != 1 or prefix.size == 0:
        raise ValueError(f"request {rid}: the prefix must be a non-empty "
                         "1-D array of token ids")
      if prefix.size + more > self.config.max_len:
        raise ValueError(f"request {rid}: prefix ({prefix.size}) + "
                         f"{more} tokens exceed the target's max_len "
                         f"{self.config.max_len}")
      if prefix.min() < 0 or prefix.max() >= self.vocab:
        raise ValueError(f"request {rid}: the prefix holds ids outside "
                         f"[0, {self.vocab})")
      checked.append(prefix)
    slots = self._slots(rids)
    todo = []
    for slot, prefix in zip(slots, checked):
      keep = self._kept(slot, prefix, prefix.size - 1)
      todo.append((slot, prefix[keep:-1], keep))
      self.covered[slot] = prefix[:-1].copy()
    self._feed(todo)
    return slots

  def rows(self, rids: typing.Sequence[int],
           prefixes: typing.Sequence[np.ndarray],
           drafts: np.ndarray) -> jax.Array:
    """f32[B, D + 1, V] (see `TargetBatch.rows`).

    Raises:
      ValueError: more than `capacity` requests, a rid twice, an empty or
        bad prefix, or prefix + D longer than max_len.
    """
    drafts = np.asarray(drafts, np.int32).reshape(len(rids), -1)
    d = drafts.shape[1]
    slots = self._catch_up(rids, prefixes, d)
    # A row per slot whatever the batch: a batch that shrinks (requests
    # ending at different rounds) compiles nothing new.
    nb = self.capacity
    tokens = np.zeros((nb, d + 1), np.int32)
    starts = np.full(nb, self.config.max_len, np.int32)   # idle rows
    for slot, p, x in zip(slots, prefixes, drafts):
      tokens[slot, 0], tokens[slot, 1:] = p[-1], x
      starts[slot] = len(p) - 1
    logits, self.slab = transformer.extend_slots(self.weights, self.slab,
                                                 tokens, starts,
                                                 arch=self.arch)
    for slot, p, x in zip(slots, prefixes, drafts):
      self.covered[slot] = np.concatenate([np.asarray(p, np.int32), x])
    return logits[np.asarray(slots)]

  def decode(self, rids: typing.Sequence[int],
             prefixes: typing.Sequence[np.ndarray],
             steps: int | typing.Sequence[int], sample: Sampler,
             aux: typing.Any) -> tuple[jax.Array, jax.Array]:
    """(token int32[B, S], status int32[B, S]) (see `TargetBatch.decode`;
    S = steps, or max(steps) where steps gives each request its own
    count: a request stops there, its later columns token -1 and status
    0, so one near the context edge shares a call with longer ones).
    `sample` is a static argument (hashable: one compile per sampler,
    batch bucket, S and span); aux's leaves have the batch axis first (B
    rows; the idle rows of the call get row 0's). Where a status is
    nonzero the handles past it are garbage: the caller must not continue
    from that row's tokens."""
    own = np.broadcast_to(np.asarray(steps, np.int64), (len(rids),))
    if not own.size or own.min() < 1:
      raise ValueError(f"SlabTarget.decode: steps must be >= 1, got {steps}")
    steps = int(own.max())
    slots = self._catch_up(rids, prefixes, own - 1)
    nb = self.capacity                # a row per slot, as in `rows`
    last = np.zeros(nb, np.int32)
    starts = np.full(nb, self.config.max_len, np.int32)
    stops = np.zeros(nb, np.int32)              # idle rows run no step
    source = np.zeros(nb, np.int64)             # aux row of each call row
    for b, (slot, p) in enumerate(zip(slots, prefixes)):
      last[slot], starts[slot], source[slot] = p[-1], len(p) - 1, b
      stops[slot] = own[b]
    aux = jax.tree.map(lambda x: np.asarray(x)[source], aux)
    active = starts < self.config.max_len
    tokens, status, self.slab = _decode(
        self.weights, self.slab, last, starts, stops, aux,
        span=transformer.span_bucket(int((starts + stops)[active].max()),
                                     self.config.max_len),
        steps=steps, sample=sample, arch=self.arch)
    index = np.asarray(slots)
    tokens, status = tokens[index], status[index]
    host = np.asarray(tokens)
    for slot, p, t, n in zip(slots, prefixes, host, own):
      self.covered[slot] = np.concatenate([np.asarray(p, np.int32),
                                           t[:n - 1]])
    return tokens, status


class DraftFeed(typing.NamedTuple):
  """What a batched draft chain feeds first (host arrays, one row per
  slot; `SlabDraft.prepare`)."""
  tokens: np.ndarray   # int32[N, C]: each row's new context tokens, then
                       # x_0; the tail past counts[b] is padding
  counts: np.ndarray   # int32[N]: real tokens per row (>= 1; 1 if idle)
  starts: np.ndarray   # int32[N]: position of tokens[b, 0] (idle: max_len)


class SlabDraft(_Slots):
  """The draft's handles in one slab: D steps of every request per call.

  The host half brings each request's slot up to its committed context
  (the window `pair.TransformerDraft.window_start` keeps) except the
  newest tokens, which the chain's first step feeds together with x_0
  (`prepare`: at most C = depth + 1 of them per row, so a steady round is
  one call); the traced half (`first`, `step`) runs inside the caller's
  jitted chain, the slab donated through it; `finish` records what the
  chain fed. A request's rows equal `TransformerDraft`'s up to float32
  rounding.

  Args:
    draft: the `pair.TransformerDraft` (its weights, config, window).
    capacity: the most requests held at once.
  """

  def __init__(self, draft: typing.Any, capacity: int) -> None:
    super().__init__("SlabDraft", draft.params, draft.config, capacity)
    self.draft = draft
    self.vocab_map = draft.vocab_map
    self.weights = DraftWeights(self.model_weights, self.vocab_map)

  def _model_ids(self, tokens: np.ndarray) -> np.ndarray:
    if self.vocab_map is None:
      return tokens
    return vocab_map.host_small(self.vocab_map, tokens)

  def prepare(self, rids: typing.Sequence[int],
              contexts: typing.Sequence[np.ndarray], depth: int
              ) -> tuple[DraftFeed, int, list[int]]:
    """(the chain's first feed, its static attention span, each rid's
    slot). contexts[b] is request b's committed prefix (its last token is
    x_0); tokens a feed cannot hold are fed here first, alone."""
    if not 1 <= depth <= self.draft.max_depth:
      raise ValueError(f"SlabDraft: depth {depth} not in [1, "
                       f"{self.draft.max_depth}]")
    max_len, c = self.config.max_len, depth + 1
    feed = DraftFeed(np.zeros((self.capacity, c), np.int32),
                     np.ones(self.capacity, np.int32),
                     np.full(self.capacity, max_len, np.int32))
    checked = []
    for rid, context in zip(rids, contexts):
      context = np.asarray(context, np.int32)
      if context.ndim != 1 or context.size == 0:
        raise ValueError(f"request {rid}: the context must be a non-empty "
                         "1-D array of token ids")
      checked.append(context)
    slots, end = self._slots(rids), 1
    lagging: list[tuple[int, np.ndarray, int]] = []
    for slot, context in zip(slots, checked):
      body = context[self.draft.window_start(context.size - 1):]
      keep = self._kept(slot, body, body.size - 1)
      lag = body.size - keep - c       # tokens the feed cannot hold
      if lag > 0:
        lagging.append((slot, body[keep:keep + lag], keep))
        keep += lag
      new = body[keep:]
      feed.tokens[slot, :new.size] = new
      feed.counts[slot], feed.starts[slot] = new.size, keep
      self.covered[slot] = body.copy()
      end = max(end, keep + new.size + depth - 1)
    self._feed(lagging)
    feed = feed._replace(tokens=self._model_ids(feed.tokens))
    return feed, transformer.span_bucket(end, max_len), slots

  @property
  def kind(self) -> "DraftSteps":
    """The chain's traced halves (static and hashable: one compile per
    architecture, not per slab)."""
    return DraftSteps(self.arch)

  def finish(self, slots: typing.Sequence[int], drafted: np.ndarray) -> None:
    """Records x_1..x_{D-1} of each served slot as fed (drafted int32[B,
    D], the chain's tokens in `slots` order)."""
    for slot, x in zip(slots, np.asarray(drafted, np.int32)):
      self.covered[slot] = np.concatenate([self.covered[slot], x[:-1]])


class DraftWeights(typing.NamedTuple):
  """What a draft chain's jit takes as its weights argument."""
  model: transformer.Unstacked
  vocab: vocab_map.VocabMap | None   # a restricted output vocabulary


@dataclasses.dataclass(frozen=True)
class DraftSteps:
  """A `SlabDraft` chain's traced halves for one architecture. Rows come
  out over the full vocabulary, tokens go in as full ids (feed.tokens
  are the model's ids already: `SlabDraft.prepare`)."""
  arch: transformer.Arch

  @staticmethod
  def _rows(weights: DraftWeights, logits: jax.Array) -> jax.Array:
    if weights.vocab is None:
      return logits
    return vocab_map.expand(weights.vocab, logits)

  def first(self, weights: DraftWeights, slab: transformer.Slab,
            feed: DraftFeed, span: int
            ) -> tuple[jax.Array, transformer.Slab]:
    """Traced: (f32[N, V] the rows after each x_0, the slab)."""
    logits, slab = transformer.extend_slots_traced(
        weights.model, slab, feed.tokens, feed.starts, span, self.arch)
    rows = jnp.arange(logits.shape[0])
    return self._rows(weights, logits[rows, feed.counts - 1]), slab

  def step(self, weights: DraftWeights, slab: transformer.Slab,
           feed: DraftFeed, tokens: jax.Array, i: int, span: int
           ) -> tuple[jax.Array, transformer.Slab]:
    """Traced: (f32[N, V] the rows after x_i, the slab with x_i), i >= 1;
    tokens int32[N] holds each row's x_i (full ids)."""
    positions = feed.starts + feed.counts + (i - 1)
    tokens = tokens.astype(jnp.int32)
    if weights.vocab is not None:
      tokens = vocab_map.to_small(weights.vocab, tokens)
    logits, slab = transformer.extend_slots_traced(
        weights.model, slab, tokens[:, None], positions, span, self.arch)
    return self._rows(weights, logits[:, 0]), slab
