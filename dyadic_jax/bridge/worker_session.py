"""The worker's side of the protocol, sans I/O: messages in, answers out.

`WorkerSession` never touches a socket, a thread, a clock or JAX (the h11 /
hyper-h2 design). The driver (`bridge.worker.Worker`) feeds it every
received message with `receive(message, now)` and gets a `WorkerAnswer`:
messages to send at once (`Send`: HELLO answers, refusals, retried
replies) and proposals to draw (`Propose`, with writable views of the
REPLY frames they go into). It draws them, then `finish(answer)` seals the
frames and returns the message. Every failure path is a counted refusal,
never an exception (tests/fuzz_sessions.py holds it to that).

Sessions. A HELLO must carry a valid tag under the deployment secret's
hello key (AUTH_FAILED, silently dropped, otherwise) and capabilities equal
to this side's, compared field by field on the raw body before anything
else (IDENTITY_MISMATCH: a RESET(REFUSED) answer). It is answered with this
side's HELLO and a fresh nonce; both nonces key the session
(`wire.auth.session_keys`). The new session is *pending* until a frame
authenticates under its keys: a replayed HELLO (which the replayer cannot
follow with any valid frame) never displaces the established session. Nor
the one being opened: the last MAX_PENDING pending sessions are all kept
(a replay storm of one recorded HELLO holds one of them), and the first to
authenticate a frame becomes the established one. The same HELLO again
(same session and nonce) gets the same answer.

One STEP message holds one STEP frame per request of a batch (on a
session that agreed on PACKED_STEP frames, one PACKED_STEP frame whose
records are those STEPs, each judged as its STEP frame would be: docs/wire.md
has which defects refuse the whole message and which one record); the answer
is one message with, per request, its REPLY (all D rows) then its
COMPLETION, written into one of `max_slots` preallocated slot buffers; on
a session that agreed on PACKED replies, one PACKED frame instead (a
record per request, then every request's rows, one tag; its depth is the
first drawn STEP's, and a STEP of another depth in the same message is
refused with BAD_SEQUENCE in its record). Per
request the session keeps its committed view (anchor, last token, prefix
digest, from COMMITs) and the reply of the latest round it served:

* a STEP of a newer round is drawn (PROPOSAL keys of that seed,
  generation, round and position); a newer generation first drops every
  speculative state of the request;
* a STEP of the round just served, byte for byte the same, is a retry: the
  cached frames are sent again (no key is ever drawn twice); the same tag
  with another body is BAD_SEQUENCE;
* an older round or generation is refused (DUPLICATE_ROUND,
  STALE_GENERATION), counted, and not answered;
* a STEP with a field out of local bounds (depth, policy, last token,
  anchor + depth above MAX_POSITION) is answered by a COMPLETION whose
  status is the refusal's code (nothing is drawn);
* a STEP whose anchor or digest disagrees with the committed view (a
  COMMIT was lost) resyncs the view from the STEP, counted as an event.

Short answers. On a session that agreed on ADAPTIVE_DEPTH (the verifier
offers it, this side accepts it with `wants_adaptive`), a proposal
(`Propose.adaptive`) may be drawn with d in [1, depth] rows under the
driver's stopping rule: `finish(answer, failed, lengths)` lays its REPLY
out again for d rows (its COMPLETION says d), or writes d in its PACKED
record and zeros in the record's other rows. A length the session did not
agree on fails that proposal (PROPOSER_FAILED).

Contexts. On a session that agreed on CONTEXT frames (`Feature.CONTEXT`:
the verifier offers it, this side accepts it with `wants_context`), a
STEP message may hold a CONTEXT frame right before a request's STEP (the
same request and tags; anything else refuses the message, BAD_SEQUENCE):
the request's committed prefix. A fresh STEP takes it as its view's
context; each COMMIT appends the committed tokens. A proposal is handed
the context only when it is the STEP's prefix (its length the anchor, its
last token the last token); otherwise it is unknown for that draw
(`contexts_lost`: a lost COMMIT, an evicted view) and dropped until the
next CONTEXT (the verifier sends one with every new generation). The
contexts of all views hold at most `context_budget` tokens (the least
recently used are dropped first, `contexts_evicted`).

Memory is bounded: at most `max_views` request views (least recently used
first out; RESET(REMOVE) drops one) and as many tag floors of dropped
views (`bridge.ledger.Views`, which applies COMMITs and RESETs), and
`max_slots` reply buffers (`bridge.replies.ReplySlots`: a slot the
transport still holds is replaced, never waited for).
"""

import collections
import os
import typing

import numpy as np

from dyadic_jax.bridge import hello
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Propose, Send
from dyadic_jax.bridge.ledger import View, Views
from dyadic_jax.bridge.replies import Entry, ReplySlots, WorkerAnswer
from dyadic_jax.wire import auth, codec, layouts, qformats
from dyadic_jax.wire.layouts import (ALL_REQUESTS, FIXED_BYTES, Feature, Kind,
                                     Policy, Reason)
from dyadic_jax.wire.refusals import Code, ProtocolError

_COMPLETION = FIXED_BYTES[Kind.COMPLETION]
# Pending sessions kept at once: a replayed (authentic, recorded) HELLO
# cannot evict the session a verifier is opening unless the replayer holds
# this many distinct recorded HELLOs.
MAX_PENDING = 4
_POLICIES = frozenset(int(p) for p in Policy)
# The kinds a STEP message may start with (it waits for an answer).
_STEPS = frozenset((Kind.STEP, Kind.PACKED_STEP))
_STEP_MESSAGE = _STEPS | {Kind.CONTEXT}


class _Session(typing.NamedTuple):
  id: int
  nonce_v: bytes
  keys: auth.Keys
  answer: bytes          # the HELLO answer (sent again to a retried HELLO)
  bounds: codec.Bounds   # what its frames are decoded under
  packed: bool = False   # agreed on PACKED replies
  context: bool = False  # agreed on CONTEXT frames
  adaptive: bool = False  # agreed on ADAPTIVE_DEPTH (short answers)


_NOTHING = WorkerAnswer([], [])


class WorkerSession:
  """The worker's protocol state machine (see the module docstring)."""

  def __init__(self, caps: hello.Capabilities, *, secret: bytes | None,
               entropy: typing.Callable[[int], bytes] = os.urandom,
               max_views: int = 4096, counters: Counters | None = None,
               wants_context: bool = False,
               context_budget: int = 1 << 22,
               wants_adaptive: bool = False):
    """caps: this side's Capabilities; secret: the deployment secret (32
    bytes) or None (`--insecure`: CRC32C tags, nothing authenticated);
    entropy(n): n fresh random bytes (the HELLO nonces); wants_context:
    accept CONTEXT frames (the draft needs the committed prefix);
    context_budget: the most context tokens kept over all views;
    wants_adaptive: accept ADAPTIVE_DEPTH where `caps` and the offer
    have it (the driver draws under a stopping rule: answers of 1..D
    rows, `finish`'s `lengths`)."""
    self.caps = caps
    self.bounds = caps.bounds
    self._greedy = caps.greedy    # read per STEP (a property of caps)
    self._counters = counters or Counters("worker")
    self._secret = secret
    self._entropy = entropy
    self._hello_keys = auth.hello_keys(secret, auth.WORKER)
    self.wants_context = bool(wants_context)
    self.wants_adaptive = bool(wants_adaptive)
    # What this side knows of each request (COMMITs and RESETs land here).
    self.ledger = Views(self.counters, caps.vocab, max_views, context_budget)
    self.established: _Session | None = None
    self.pending: _Session | None = None   # the newest
    # Older pending sessions, oldest first (at most MAX_PENDING - 1).
    self._older: collections.OrderedDict[int, _Session] = (
        collections.OrderedDict())
    self.replies = ReplySlots(self.counters, self.bounds, caps.max_slots)
    # A session that agreed on CONTEXT frames decodes with these.
    self._context_bounds = self.bounds._replace(max_context=caps.max_context)
    # Local bounds of what a verifier may send (one HELLO, or one frame
    # per request of a batch, two with CONTEXT frames): checked before any
    # frame is read.
    limits = self._context_bounds if self.wants_context else self.bounds
    self.max_message = limits.max_request_message
    self.max_frames = limits.max_request_frames

  @property
  def session(self) -> int | None:
    return None if self.established is None else self.established.id

  @property
  def counters(self) -> Counters:
    return self._counters

  @counters.setter
  def counters(self, counters: Counters) -> None:
    """A new count reaches the views and the reply slots too."""
    self._counters = self.ledger.counters = counters
    self.replies.counters = counters

  @property
  def slots(self) -> list[bytearray] | None:
    """The reply slots' buffers (None before a HELLO)."""
    return self.replies.buffers

  @property
  def views(self) -> "collections.OrderedDict[int, View]":
    return self.ledger.views

  @property
  def max_views(self) -> int:
    return self.ledger.max_views

  @property
  def context_budget(self) -> int:
    return self.ledger.context_budget

  @property
  def context_tokens(self) -> int:
    return self.ledger.context_tokens

  # -- messages --------------------------------------------------------------

  def receive(self, message: layouts.Buffer,
              now: float = 0.0) -> WorkerAnswer:
    """Handles one received message; returns a WorkerAnswer (never raises)."""
    del now   # the worker keeps no deadlines of its own
    try:
      frames = codec.split(message, max_frames=self.max_frames,
                           max_bytes=self.max_message)
      first = codec.header(frames[0])
    except ProtocolError as e:
      self.counters.reject(e.code, "verifier message")
      return _NOTHING
    if first.kind == Kind.HELLO:
      if len(frames) != 1:
        self.counters.reject(Code.BAD_SEQUENCE, "HELLO with other frames")
        return _NOTHING
      return self._hello(frames[0], first)
    candidates = [s for s in (self.established, self.pending,
                              *self._older.values())
                  if s is not None and s.id == first.session]
    if not candidates:
      self.counters.reject(Code.UNKNOWN_SESSION, f"session {first.session}")
      if first.kind not in _STEP_MESSAGE:
        return _NOTHING       # only a STEP message waits for an answer
      # Tagged like the STEP, so that a late one is recognized as stale.
      return WorkerAnswer([Send(self._refusal(
          Code.UNKNOWN_SESSION, frames[0], first))], [])
    session = next((s for s in candidates
                    if auth.check(frames[0], s.keys.recv)), None)
    if session is None:
      self.counters.reject(Code.AUTH_FAILED, "verifier frame")
      return _NOTHING
    try:
      # The first frame's tag was checked just above: not twice.
      decoded = [codec.decode(f, session.bounds,
                              session.keys.recv if i else None)
                 for i, f in enumerate(frames)]
    except ProtocolError as e:
      self.counters.reject(e.code, "in a verifier message")
      return _NOTHING
    if session is not self.established:   # first authenticated frame
      self.established, self.pending = session, None
      self._older.clear()
      self.ledger.clear()
      self.counters.event("sessions")
    kinds = {f.header.kind for f in decoded}
    sessions = {f.header.session for f in decoded}
    if Kind.CONTEXT in kinds and len(kinds) == 2 and kinds & _STEPS:
      kinds.discard(Kind.CONTEXT)   # CONTEXT frames come with their STEPs
    if len(kinds) != 1 or sessions != {session.id}:
      self.counters.reject(Code.BAD_SEQUENCE, f"mixed message {kinds}")
      return _NOTHING
    kind = kinds.pop()
    if kind in _STEPS:
      paired = self._pair_contexts(decoded)
      if isinstance(paired, str):
        self.counters.reject(Code.BAD_SEQUENCE, paired)
        return _NOTHING
      return self._steps(*paired, session, decoded[0])
    if kind == Kind.COMMIT:
      for f in decoded:
        self.ledger.commit(f)
    elif kind == Kind.RESET:
      for f in decoded:
        self.ledger.reset(f)
    else:
      self.counters.reject(Code.BAD_SEQUENCE, f"{Kind(kind).name} to worker")
    return _NOTHING

  def released(self, slot: int) -> None:
    """The transport let go of every message sent from `slot`."""
    self.replies.released(slot)

  # -- HELLO -----------------------------------------------------------------

  def _refusal(self, code: int, frame: memoryview,
               header: layouts.Header) -> bytes:
    """RESET(REFUSED, code) of `frame`, with its session and tags, keyed
    by its tag (`auth.refusal_keys`): it refuses that frame and no other."""
    keys = auth.refusal_keys(self._secret, auth.tag_of(frame), auth.WORKER)
    return codec.encode(Kind.RESET, session=header.session,
                        generation=header.generation, round_id=header.round,
                        body={"request": ALL_REQUESTS,
                              "reason": Reason.REFUSED, "code": int(code)},
                        send=keys.send)

  def _hello(self, frame: memoryview,
             header: layouts.Header) -> WorkerAnswer:
    if not auth.check(frame, self._hello_keys.recv):
      self.counters.reject(Code.AUTH_FAILED, "HELLO")
      return _NOTHING
    try:
      body = codec.decode(frame, codec.HELLO_BOUNDS).body
    except ProtocolError as e:
      self.counters.reject(e.code, "HELLO")
      return _NOTHING
    for s in (self.pending, self.established, *self._older.values()):
      if s is not None and (s.id, s.nonce_v) == (header.session, body.nonce):
        self.counters.event("hello_retries")
        return WorkerAnswer([Send(s.answer)], [])
    differ = hello.mismatches(self.caps, body)
    if differ:
      self.counters.reject(Code.IDENTITY_MISMATCH, "; ".join(differ))
      return WorkerAnswer([Send(self._refusal(Code.IDENTITY_MISMATCH,
                                              frame, header))], [])
    nonce_w = bytes(self._entropy(layouts.NONCE_BYTES))
    agreed = hello.agree(self.caps, body.features)
    if not self.wants_context:    # nothing to do with a prefix: never ask
      agreed &= ~Feature.CONTEXT
    if not self.wants_adaptive:   # no stopping rule: fixed depth only
      agreed &= ~Feature.ADAPTIVE_DEPTH
    keys = auth.session_keys(self._secret, header.session, body.nonce,
                             nonce_w, auth.WORKER,
                             gmac=bool(agreed & Feature.GMAC))
    answer = hello.hello_frame(self.caps, header.session, nonce_w, keys.send,
                               features=agreed)
    if self.pending is not None:
      self._older.pop(self.pending.id, None)
      self._older[self.pending.id] = self.pending
      while len(self._older) > MAX_PENDING - 1:
        self._older.popitem(last=False)
    self._older.pop(header.session, None)
    bounds = (self._context_bounds if agreed & Feature.CONTEXT
              else self.bounds)
    self.pending = _Session(header.session, bytes(body.nonce), keys, answer,
                            bounds._replace(packed_step=bool(
                                agreed & Feature.PACKED_STEP)),
                            bool(agreed & Feature.PACKED_REPLY),
                            bool(agreed & Feature.CONTEXT),
                            bool(agreed & Feature.ADAPTIVE_DEPTH))
    self.replies.allocate()
    self.counters.event("hellos")
    return WorkerAnswer([Send(answer)], [])

  # -- STEP ------------------------------------------------------------------

  def _pair_contexts(self, frames: list[codec.Frame]) -> tuple[
      list[codec.Step], dict[int, np.ndarray]] | str:
    """(STEPs, {index of a STEP: its CONTEXT's tokens}), or why the
    message is refused (BAD_SEQUENCE).

    Per-frame STEPs: each CONTEXT right before the STEP of its request and
    tags. A PACKED_STEP message: CONTEXTs, then one PACKED_STEP frame whose
    header carries its first record's tags; the CONTEXTs in record order,
    each matching a record of its request and tags, at most one a record.
    """
    steps: list[codec.Step] = []
    contexts: dict[int, np.ndarray] = {}
    held: list[codec.Frame] = []
    for f in frames:
      if f.header.kind == Kind.CONTEXT:   # no Kind() per frame
        held.append(f)
        continue
      if f.steps is None:
        batch: tuple[codec.Step, ...] = (codec.Step(f.body, f.tag),)
      elif f is not frames[-1] or f.tag != f.steps[0].tag:
        return "PACKED_STEP not last, or not tagged as its first record"
      else:
        batch = f.steps
      at = len(steps)
      steps.extend(batch)
      for ctx in held:        # in order, each to a later step of its own
        while at < len(steps) and (steps[at].body.request, steps[at].tag
                                   ) != (ctx.body.request, ctx.tag):
          at += 1
        if at == len(steps):
          return "CONTEXT without its STEP"
        assert ctx.tokens is not None    # a decoded CONTEXT
        contexts[at] = ctx.tokens
        at += 1
      held = []
    if held:
      return "CONTEXT without its STEP"
    self.counters.event("contexts", len(contexts))
    return steps, contexts

  def _check_step(self, body: layouts.Body) -> int:
    """0, or the Code refusing a STEP whose fields are out of bounds."""
    if body.policy not in _POLICIES:
      return Code.BAD_STATUS
    if (body.policy == Policy.SAMPLED) == self._greedy:
      return (Code.SAMPLED_ON_GREEDY if self._greedy
              else Code.BAD_SEQUENCE)
    if not 1 <= body.depth <= self.caps.max_depth:
      return Code.ABSURD_LENGTH
    if not 0 <= body.last_token < self.caps.vocab:
      return Code.TOKEN_OUT_OF_RANGE
    if body.anchor + body.depth > hello.MAX_POSITION:
      return Code.ABSURD_LENGTH
    return 0

  def _cached(self, view: View) -> tuple[int, int, int] | None:
    """(slot, start, end) of the view's cached answer, or None."""
    cached = self.replies.cached(view.cached)
    if cached is None:
      view.cached = None
    return cached

  def _steps(self, steps: list[codec.Step],
             contexts: dict[int, np.ndarray], session: _Session,
             first: codec.Frame) -> WorkerAnswer:
    """A STEP message's answer: `steps` (STEP frames' or a PACKED_STEP
    frame's records, alike), `first` the message's first frame (what a
    refusal of the whole message is keyed by and tagged like)."""
    retries: list[tuple[int, int, int]] = []
    fresh: list[tuple[codec.Step, View]] = []
    seen: set[int] = set()
    for j, f in enumerate(steps):
      body, tag = f.body, f.tag
      rid = body.request
      if rid == ALL_REQUESTS or rid in seen:
        self.counters.reject(Code.BAD_SEQUENCE, f"STEP of request {rid}")
        continue
      seen.add(rid)
      view = self.ledger.view(rid)
      if tag[0] < view.generation:
        self.counters.reject(Code.STALE_GENERATION, f"request {rid} {tag}")
        continue
      if tag == (view.generation, view.round):
        cached = self._cached(view)
        if cached is not None:
          if view.step != body:
            self.counters.reject(Code.BAD_SEQUENCE, f"request {rid} {tag}: "
                                 "another STEP with a served tag")
            continue
          self.counters.event("retries_served")
          retries.append(cached)
          continue
      if tag[0] == view.generation and tag[1] <= view.round:
        self.counters.reject(Code.DUPLICATE_ROUND, f"request {rid} {tag}")
        continue
      if j in contexts:
        self.ledger.take_context(view, contexts[j])
      fresh.append((f, view))
    sends = self.replies.retries(retries)
    if not fresh:
      return WorkerAnswer(sends, [])
    if session.packed:
      return self._packed_steps(fresh, session, sends, first)
    slot = self.replies.take()
    buf = memoryview(self.replies.buffer(slot))
    proposals: list[Propose] = []
    entries: list[Entry] = []
    offset = 0
    for f, view in fresh:
      body, tag = f.body, f.tag
      status = self._fresh_view(f, view)
      reply = rows = None
      if not status:
        reply, rows = codec.begin_reply(
            buf[offset:], bounds=self.bounds, session=session.id,
            generation=tag[0], round_id=tag[1], request=body.request,
            depth=body.depth)
        proposals.append(Propose(
            len(entries), body.request, body.seed, tag[0], tag[1],
            body.anchor, body.last_token, body.depth, rows,
            self._draw_context(view, body, session), session.adaptive))
      entries.append(Entry(body.request, tag, offset, reply, rows,
                            body.depth, body.anchor, body.context_version,
                            int(status)))
      offset += (0 if reply is None else len(reply)) + _COMPLETION
    self.counters.event("proposals", len(entries))
    return WorkerAnswer(sends, proposals, slot, tuple(entries))

  def _fresh_view(self, f: codec.Step, view: View) -> int:
    """A fresh STEP's view moves to its tag; returns its refusal or 0."""
    body = f.body
    self.ledger.move(view, body, f.tag)
    status = self._check_step(body)
    if status:
      self.counters.reject(status, f"STEP of request {body.request}")
    return status

  def _draw_context(self, view: View, body: layouts.Body,
                    session: _Session) -> np.ndarray | None:
    """The context a proposal is handed (None off a context session)."""
    return self.ledger.draw_context(view, body) if session.context else None

  def _packed_steps(self, fresh: list[tuple[codec.Step, View]],
                    session: _Session, sends: list[Send],
                    first: codec.Frame) -> WorkerAnswer:
    """A PACKED answer of the fresh STEPs: one record each, in order."""
    if session.keys.send.spent:
      return self._end_spent(first, session, sends)
    statuses = [self._fresh_view(f, view) for f, view in fresh]
    depth = next((f.body.depth for (f, _), s in zip(fresh, statuses)
                  if not s), 0)
    for j, (f, _) in enumerate(fresh):
      if not statuses[j] and f.body.depth != depth:
        statuses[j] = Code.BAD_SEQUENCE     # one depth per PACKED frame
        self.counters.reject(Code.BAD_SEQUENCE, f"STEP of request "
                             f"{f.body.request}: depth {f.body.depth} in a "
                             f"batch of depth {depth}")
    slot = self.replies.take()
    tag = fresh[0][0].tag
    packed, each = self.replies.packed_layout(slot, len(fresh), depth)
    codec.write_packed(packed, bounds=self.bounds, session=session.id,
                       generation=tag[0], round_id=tag[1])
    proposals: list[Propose] = []
    entries: list[Entry] = []
    for j, ((f, view), status) in enumerate(zip(fresh, statuses)):
      body, tag = f.body, f.tag
      rows = None
      if not status:
        rows = each[j]
        proposals.append(Propose(
            j, body.request, body.seed, tag[0], tag[1], body.anchor,
            body.last_token, depth, rows,
            self._draw_context(view, body, session), session.adaptive))
      entries.append(Entry(body.request, tag, j, None, rows, depth,
                            body.anchor, body.context_version, int(status)))
    self.counters.event("proposals", len(entries))
    return WorkerAnswer(sends, proposals, slot, tuple(entries), packed)

  def _end_spent(self, first: codec.Frame, session: _Session,
                 sends: list[Send]) -> WorkerAnswer:
    """The session's sealer is at its counter's end (GMAC: one more frame
    would repeat a nonce): the session ends here, counted, and the STEP
    message is refused (SESSION_EXHAUSTED; keyed by its first frame, as the
    verifier keys a refusal), so the verifier closes its side and opens a
    new session (a new HELLO, new keys). Nothing is drawn."""
    self.counters.reject(Code.SESSION_EXHAUSTED,
                         f"session {session.id}: its key sealed 2^32 - 1 "
                         "frames")
    self.established = None
    return WorkerAnswer(sends + [Send(self._refusal(
        Code.SESSION_EXHAUSTED, first.raw, first.header))], [])

  def finish(self, answer: WorkerAnswer,
             failed: dict[int, int] | None = None,
             lengths: dict[int, int] | None = None) -> list[Send]:
    """Seals a fresh answer once its proposals are drawn; returns its Sends.

    failed: {Propose.entry: Code} of proposals the driver could not draw
    (the proposer raised): each is answered by a COMPLETION with that
    status instead of its rows. lengths: {Propose.entry: d} of proposals
    drawn with d < depth rows (`Propose.adaptive`), written to rows[:d]:
    each answer carries those d rows (a REPLY of d rows, or a PACKED
    record of depth d whose other rows are zeros). A length the session
    did not agree on (no ADAPTIVE_DEPTH, or d outside [1, depth]) fails
    that proposal, PROPOSER_FAILED.
    """
    if answer.slot is None:
      return list(answer.send)
    session = self.established
    assert session is not None    # a fresh answer is the established's
    return self.replies.seal(answer, failed or {}, lengths or {}, session.id,
                             session.keys.send, session.adaptive,
                             self.ledger.served)
