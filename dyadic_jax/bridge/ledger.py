"""The verifier's requests' committed state: the source of truth of a run.

A `Ledger` holds each request's committed tokens, seed, digest and tags
(generation, round), which exchange in flight owns it, and the next
generation of each removed id; it hands out each round's tags, classifies
an answer's tag against them and applies a round's outcome. The session
(`verifier_session.VerifierSession`) keeps HELLO, frame authentication
and routing, and counts; the ledger never counts and never encodes a
frame. A (request, generation, round) tag only ever grows: a removed id
that comes back continues after its last generation, and a fallback or a
reset moves a request to a new generation (round 0), so no key of a
failed exchange can be drawn again.

The worker keeps the mirror (`Views`): what it knows of each request
(its committed view, the tags it served, its context), bounded in count
and in context tokens.

No socket, clock or JAX here (tests/test_layers.py).
"""

import collections
import dataclasses
import typing

import numpy as np

from dyadic_jax.bridge import digest as digest_lib
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.exchange import Exchange
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.layouts import ALL_REQUESTS, Reason
from dyadic_jax.wire.refusals import Code

__all__ = ["Context", "Ledger", "Request", "RoundResult", "View", "Views"]

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


@dataclasses.dataclass
class Request:
  """One request's committed state on the verifier (the source of truth)."""
  rid: int
  seed: int
  tokens: list[int]            # committed tokens, prompt first
  generation: int = 0
  round: int = 0
  context_version: int = 0
  digest: bytes = b""
  # (session, generation) whose first round carried a CONTEXT (or found
  # the prefix too long for one): the worker may hold the prefix.
  context_sent: tuple[int, int] | None = None

  @property
  def anchor(self) -> int:
    return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What one round committed for one request."""
  rid: int
  generation: int
  round: int
  anchor: int
  committed: tuple[int, ...]   # tokens appended to the request, in order
  accepted: int                # drafted tokens among them
  fallback: bool               # True: proposal discarded, target-only token
  code: Code | None            # why it was discarded


class Ledger:
  """Every live request's committed state, and which exchange owns it."""

  def __init__(self, vocab: int) -> None:
    self.vocab = vocab
    self.requests: dict[int, Request] = {}
    self.retired: dict[int, int] = {}     # removed rid -> next generation
    self.owner: dict[int, Exchange] = {}  # rid -> its exchange in flight

  def add(self, rid: int, prompt: typing.Sequence[int], seed: int) -> None:
    if rid in self.requests or not 0 <= rid < ALL_REQUESTS:
      raise ValueError(f"add_request: bad or duplicate request id {rid}")
    prompt = [int(t) for t in prompt]
    if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab:
      raise ValueError("add_request: prompt needs tokens in [0, V)")
    if not 0 <= int(seed) <= _U64:
      raise ValueError(f"add_request: seed {seed} is not a uint64")
    generation = self.retired.pop(rid, 0)
    self.requests[rid] = Request(rid, int(seed), prompt,
                                 generation=generation,
                                 digest=digest_lib.of(prompt))

  def remove(self, rid: int) -> None:
    req = self.requests.pop(rid)
    self.retired[rid] = req.generation + 1

  def generation(self, rid: int) -> int:
    """`rid`'s generation, live or retired (what a RESET is tagged with)."""
    req = self.requests.get(rid)
    return req.generation if req is not None else self.retired.get(rid, 0)

  def bump(self, req: Request) -> None:
    """A new generation, no round of it yet."""
    if req.generation >= _U32:
      raise RuntimeError(f"request {req.rid}: generations exhausted")
    req.generation, req.round = req.generation + 1, 0

  def bump_all(self, rids: typing.Iterable[int] | None = None) -> None:
    for rid in list(self.requests) if rids is None else rids:
      self.bump(self.requests[rid])

  def advance(self, rids: typing.Sequence[int]) -> list[Request]:
    """The requests of a new round, each moved to its next round (a new
    generation where the rounds are exhausted)."""
    reqs = [self.requests[r] for r in rids]
    for req in reqs:
      if req.round >= _U32:
        self.bump(req)
      req.round += 1
    return reqs

  def own(self, ex: Exchange) -> None:
    self.owner.update((r, ex) for r in ex.rids)

  def release(self, ex: Exchange) -> None:
    for rid in ex.rids:
      del self.owner[rid]

  # -- tags ------------------------------------------------------------------

  def classify(self, rid: int, tag: tuple[int, int]) -> Code | None:
    """None if `tag` is the tag of `rid` in its exchange in flight, else
    the refusal."""
    ex = self.owner.get(rid)
    want = None if ex is None else ex.tags.get(rid)
    if want is None:      # a request of no exchange in flight: late if older
      req = self.requests.get(rid)
      if req is None:
        return (Code.STALE_GENERATION if rid in self.retired
                else Code.BAD_SEQUENCE)
      want = (req.generation, req.round + 1)
      if tag >= want:
        return Code.BAD_SEQUENCE
    elif tag > want:
      return Code.BAD_SEQUENCE
    if tag[0] < want[0]:
      return Code.STALE_GENERATION
    return None if tag == want else Code.DUPLICATE_ROUND

  def late(self, tag: tuple[int, int]) -> Code | None:
    """STALE_GENERATION / DUPLICATE_ROUND if `tag` is no request's current
    tag but an older one of some request in flight; else None."""
    if not self.owner:
      return None
    codes = [self.classify(rid, tag) for rid in self.owner]
    if None in codes:
      return None
    older = [c for c in codes if c != Code.BAD_SEQUENCE]
    return older[0] if older else None

  # -- commits ---------------------------------------------------------------

  def commit(self, rid: int, tag: tuple[int, int], code: int,
             accepted: int, drafted: typing.Sequence[int],
             token: int) -> RoundResult:
    """Applies one plan row: `accepted` of `drafted` and `token` (0 of
    them where `code` discards the proposal: a new generation)."""
    req = self.requests[rid]
    req.generation, req.round = tag          # a follower mirrors them
    accepted = 0 if code else int(accepted)
    committed = tuple(drafted[:accepted]) + (int(token),)
    anchor = req.anchor
    req.tokens.extend(committed)
    req.digest = digest_lib.extend(req.digest, committed)
    if code:
      self.bump(req)
    return RoundResult(rid, tag[0], tag[1], anchor, committed, accepted,
                       bool(code), Code(code) if code else None)


# -- the worker's mirror ------------------------------------------------------


class Context:
  """A request's committed prefix: int32 tokens in a buffer that grows by
  doubling (a COMMIT appends without copying the prefix)."""
  __slots__ = ("buf", "n")

  def __init__(self, tokens: np.ndarray) -> None:
    self.buf = np.array(tokens, np.int32)
    self.n = len(self.buf)

  def extend(self, tokens: list[int]) -> None:
    end = self.n + len(tokens)
    if end > len(self.buf):
      grown = np.empty(max(end, 2 * len(self.buf)), np.int32)
      grown[:self.n] = self.buf[:self.n]
      self.buf = grown
    self.buf[self.n:end] = tokens
    self.n = end

  def tokens(self) -> np.ndarray:
    """A read-only view: later appends never change what it shows."""
    view = self.buf[:self.n]
    view.flags.writeable = False
    return view


class View:
  """What the worker knows of one request."""
  __slots__ = ("generation", "round", "step", "cached", "anchor",
               "last_token", "digest", "proposal", "committed", "context")

  def __init__(self) -> None:
    self.generation = 0       # newest generation seen (older are stale)
    self.round = -1           # newest round served in that generation
    # The STEP served, as a STEP body (retries: the same one again).
    self.step: layouts.Body | None = None
    # (slot, epoch, start, end) of its answer.
    self.cached: tuple[int, int, int, int] | None = None
    self.anchor: int | None = None    # committed view: next position
    self.last_token: int | None = None
    self.digest: bytes | None = None
    # Tokens of the served round (for COMMIT).
    self.proposal: np.ndarray | None = None
    self.committed = (-1, -1)  # (generation, round) of the last COMMIT
    # The committed prefix (CONTEXT frames and COMMITs), or None.
    self.context: Context | None = None


class Views:
  """The worker's mirror of the ledger: a bounded view per request (least
  recently used first out), the tag floors of dropped views (a view made
  again starts at its floor, so a replayed STEP of a removed or evicted
  request is stale, never drawn twice), and the contexts' token budget.
  COMMITs and RESETs are applied here; each refusal and event is counted
  on the session's counters."""

  def __init__(self, counters: Counters, vocab: int, max_views: int,
               context_budget: int) -> None:
    self.counters = counters
    self.vocab = vocab
    self.max_views = int(max_views)
    self.context_budget = int(context_budget)
    self.clear()

  def clear(self) -> None:
    """A new session: nothing of the old one's requests is known."""
    self.views: collections.OrderedDict[int, View] = (
        collections.OrderedDict())
    # (generation, round, committed) of dropped views: `_drop`
    self.floors: collections.OrderedDict[
        int, tuple[int, int, tuple[int, int]]] = collections.OrderedDict()
    self.context_tokens = 0     # held by the views' contexts

  def view(self, rid: int) -> View:
    view = self.views.get(rid)
    if view is None:
      view = self.views[rid] = View()
      floor = self.floors.pop(rid, None)
      if floor is not None:
        view.generation, view.round, view.committed = floor
      if len(self.views) > self.max_views:
        old_rid, old = self.views.popitem(last=False)
        self.set_context(old, None)
        self._drop(old_rid, old)
        self.counters.event("views_evicted")
    else:
      self.views.move_to_end(rid)
    return view

  def _drop(self, rid: int, view: View) -> None:
    """Keeps a dropped view's tags (bounded, oldest out): its old STEPs
    stay stale if the id comes back."""
    self.floors[rid] = (view.generation, view.round, view.committed)
    self.floors.move_to_end(rid)
    if len(self.floors) > self.max_views:
      self.floors.popitem(last=False)

  # -- contexts --------------------------------------------------------------

  def set_context(self, view: View, context: Context | None) -> None:
    """Replaces a view's context, keeping the tokens held in budget."""
    old = view.context
    self.context_tokens += (0 if context is None else context.n) - (
        0 if old is None else old.n)
    view.context = context

  def take_context(self, view: View, tokens: np.ndarray) -> None:
    """A CONTEXT frame's tokens become the view's context."""
    self.set_context(view, Context(tokens))
    self._fit_contexts()

  def _fit_contexts(self) -> None:
    """Drops the least recently used views' contexts until the budget
    holds (the newest one too, if it alone is over)."""
    for view in self.views.values():
      if self.context_tokens <= self.context_budget:
        return
      if view.context is not None:
        self.set_context(view, None)
        self.counters.event("contexts_evicted")

  def draw_context(self, view: View,
                   body: layouts.Body) -> np.ndarray | None:
    """The context a proposal is handed: the view's, if it is the STEP's
    committed prefix; else None (counted)."""
    ctx = view.context
    if ctx is not None and ctx.n == body.anchor and (
        int(ctx.buf[ctx.n - 1]) == body.last_token):
      return ctx.tokens()
    self.set_context(view, None)     # stale: wait for the next CONTEXT
    self.counters.event("contexts_lost")
    return None

  # -- STEPs -----------------------------------------------------------------

  def move(self, view: View, body: layouts.Body,
           tag: tuple[int, int]) -> None:
    """A fresh STEP's view moves to its tag and adopts its committed view
    (a disagreement is a counted resync)."""
    if tag[0] > view.generation:
      view.cached = view.proposal = None   # a new generation: drop it all
    view.generation, view.round = tag
    view.step = body
    view.proposal = None
    seen_view = (body.anchor, body.last_token, body.prefix_digest)
    if (view.anchor, view.last_token, view.digest) != seen_view:
      if view.anchor is not None:
        self.counters.event("resyncs")
      view.anchor, view.last_token, view.digest = seen_view

  def served(self, rid: int, tag: tuple[int, int],
             cached: tuple[int, int, int, int],
             proposal: np.ndarray | None) -> None:
    """The answer of `rid`'s round `tag` is sealed: the view caches where
    (a retry sends it again) and what it drafted (for the COMMIT)."""
    view = self.views.get(rid)
    if view is not None and (view.generation, view.round) == tag:
      view.cached = cached
      view.proposal = proposal

  # -- COMMIT and RESET ------------------------------------------------------

  def commit(self, f: codec.Frame) -> None:
    body, tag = f.body, f.tag
    rid = body.request
    if rid == ALL_REQUESTS:
      self.counters.reject(Code.BAD_SEQUENCE, "COMMIT of every request")
      return
    if (body.status and Code.parse(body.status) is None) or (
        body.fallback not in (0, 1)):
      self.counters.reject(Code.BAD_STATUS, f"COMMIT of request {rid}")
      return
    if not 0 <= body.next_token < self.vocab:
      self.counters.reject(Code.TOKEN_OUT_OF_RANGE, f"COMMIT of {rid}")
      return
    view = self.view(rid)
    if tag <= view.committed:
      code = (Code.STALE_GENERATION if tag[0] < view.committed[0]
              else Code.DUPLICATE_ROUND)
      self.counters.reject(code, f"COMMIT of request {rid} {tag}")
      return
    fallback = bool(body.fallback)
    if tag != (view.generation, view.round):
      # A round this worker never served (its STEP was lost): the verifier
      # fell back, so the committed token is the target-only one.
      self.counters.event("commits_unserved")
      view.generation, view.round, view.proposal = tag[0], tag[1], None
    proposal = None if fallback else view.proposal
    if proposal is not None and body.accepted > len(proposal):
      self.counters.reject(Code.BAD_SEQUENCE, f"COMMIT of {rid}: accepted "
                           f"{body.accepted} of {len(proposal)}")
      return
    committed = [] if proposal is None else (
        proposal[:body.accepted].tolist())   # Python ints, one call
    committed.append(int(body.next_token))
    view.digest = (None if view.digest is None or (
        view.proposal is None and not fallback) else
                   digest_lib.extend(view.digest, committed))
    self._commit_context(view, committed, bool(
        fallback or proposal is not None or body.accepted == 0),
                         int(body.new_position))
    view.anchor = int(body.new_position)
    view.last_token = committed[-1]
    view.cached = view.proposal = view.step = None
    view.committed = tag
    self.counters.event("commits")

  def _commit_context(self, view: View, committed: list[int], known: bool,
                      new_position: int) -> None:
    """Appends a COMMIT's tokens to the view's context; drops the context
    when they are unknown (accepted drafts of a proposal this side does not
    hold) or the result is not `new_position` tokens long."""
    ctx = view.context
    if ctx is None:
      return
    if not known or ctx.n + len(committed) != new_position:
      self.set_context(view, None)
      return
    ctx.extend(committed)
    self.context_tokens += len(committed)
    self._fit_contexts()

  def reset(self, f: codec.Frame) -> None:
    body = f.body
    try:
      reason = Reason(body.reason)
    except ValueError:
      self.counters.reject(Code.BAD_STATUS, f"RESET reason {body.reason}")
      return
    if reason == Reason.REFUSED:
      self.counters.reject(Code.BAD_SEQUENCE, "a refusal sent to the worker")
      return
    rid = body.request
    targets = list(self.views) if rid == ALL_REQUESTS else [rid]
    if reason == Reason.REMOVE:
      for key in targets:
        view = self.views.pop(key, None)
        if view is not None:
          self.set_context(view, None)
          self._drop(key, view)
      self.counters.event("removes")
      return
    generation = f.header.generation
    for key in targets:
      view = self.view(key)
      view.cached = view.proposal = view.step = None
      if generation > view.generation:   # a new generation: no round yet
        view.generation, view.round = generation, -1
    self.counters.event("resets")
