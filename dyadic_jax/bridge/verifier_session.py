"""The verifier's side of the protocol, sans I/O: rounds as a state machine.

`VerifierSession` never touches a socket, a thread, a clock or JAX; the
driver (`bridge.verifier.Verifier`) passes the time in and performs the
records it gets back (`bridge.effects`). It owns the session (HELLO,
keys), frame authentication, the exchanges in flight (`bridge.exchange`;
an authenticated answer's frames are routed to them by `bridge.answers`)
and the staging slots, and counts every refusal; the requests' committed state is its `ledger` (`bridge.ledger`). Every failure path is a counted refusal,
never an exception (tests/fuzz_sessions.py holds it to that).

One round of a batch (generation g, round n of each request):

    hello(now) -> Send(HELLO)          until `is_open` (receive the answer)
    begin(rids, depth, now[, timeout_s]) -> (Send(STEP message), Exchange)
    receive(message, now) -> [] | [Stage] | [Verify]   (until done)
    poll(now) -> [] | [Verify]         the deadline: the batch falls back
    staged(verdict) -> Verify(plan)    after validating the Stage's rows
    commit(plan, outcomes) -> (results, Send(COMMIT) or None)

Receiving. A message is split under local bounds (frames, bytes); every
frame must carry this session's id and a valid tag before anything of it
is read (UNKNOWN_SESSION, AUTH_FAILED: the message is dropped, counted,
and changes nothing: a peer without the key cannot steer which requests
fall back). A worker's refusal (RESET REFUSED) is keyed by the secret and
the tag of the frame it refuses (`auth.refusal_keys`): it counts only for
the HELLO or the STEP in flight that this side sent. While a session
opens, nothing but a HELLO or a RESET is decoded, and a RESET only after
its tag checks. Frames of older rounds or generations (late, duplicated) are counted
as STALE_GENERATION / DUPLICATE_ROUND and dropped before anything is
copied. An answer of the exchange in flight is judged by that exchange
(`bridge.exchange`: one cascade whichever frame carried it; on a PACKED
session the expected records in bulk, the q rows staged in place). Once
every request is answered, `Stage` asks the driver to validate the rows
(the q format's kernel) and audit the tokens against the PROPOSAL draws;
only `staged` turns the verdicts into a `Plan`.

Sending. `begin` makes one STEP frame per request, or on a session that
agreed on PACKED_STEP frames (`Feature.PACKED_STEP`) one frame of a
record per request under one tag (after the round's CONTEXT frames).

Short answers (ADAPTIVE_DEPTH: 1..depth rows, `bridge.exchange`): the
verdicts of a slot's rows past an answer's length are not read
(`short_answers` counts such requests), and the Plan carries each
request's length (`Plan.lengths`).

Contexts. On a session that agreed on CONTEXT frames (`Feature.CONTEXT`),
`begin` puts a CONTEXT frame (the request's committed tokens, prompt
first) right before a request's STEP whenever the worker may not hold
them: the first round of the request in each (session, generation), so
after a new request, a fallback, a reset or a reconnection
(`Request.context_sent`). A prefix longer than `caps.max_context` is not
sent (`contexts_too_long`): the worker draws without it.

A request whose q is missing, corrupt, late or refused is never verified:
its whole proposal is discarded, one token comes from the target alone
(TARGET_ONLY key of that round) and the request moves to generation g + 1,
round 0, so no key of the failed exchange can be drawn again.

Memory is bounded by the live requests: `remove_request` forgets one (a
removed id that comes back continues after its last generation), and the
exchanges in flight (`bridge.exchange`: each one's state table, and the
one check of an answer, whichever frame carried it) are the only
per-round state. A driver reads an exchange and never writes it: its
deadline is `begin`'s `timeout_s`, and `expire(key)` ends one whose STEP
never left.
"""

import os
import typing

import numpy as np

from dyadic_jax.bridge import hello, staging
from dyadic_jax.bridge.answers import Answers
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Counts, Plan, Send, Stage, Verify
from dyadic_jax.bridge.exchange import Event, Exchange, empty_plan
from dyadic_jax.bridge.ledger import Ledger, Request, RoundResult
from dyadic_jax.wire import auth, codec, layouts, qformats
from dyadic_jax.wire.layouts import Feature, Kind, Policy, Reason
from dyadic_jax.wire.refusals import Code, ProtocolError

__all__ = ["Exchange", "Request", "RoundResult", "VerifierSession",
           "empty_plan"]

_RECORD = layouts.RECORD_STRUCT
CLOSED, OPENING, OPEN = "closed", "opening", "open"


class VerifierSession:
  """The verifier's protocol state machine (see the module docstring)."""

  def __init__(self, caps: hello.Capabilities, *, secret: bytes | None,
               timeout_s: float = 2.0, audit: bool = True,
               entropy: typing.Callable[[int], bytes] = os.urandom,
               counters: Counters | None = None) -> None:
    """caps: this side's Capabilities; secret: the deployment secret (32
    bytes) or None (`--insecure`); timeout_s: an exchange's deadline;
    audit: ask for the sampling audit in every Stage; entropy(n): n fresh
    random bytes (session ids and HELLO nonces)."""
    self.caps = caps
    self.bounds = caps.bounds
    self.timeout_s = float(timeout_s)
    self.audit = bool(audit) and not caps.greedy
    self._counters = counters or Counters("verifier")
    self._secret = secret
    self._entropy = entropy
    self._hello_keys = auth.hello_keys(secret, auth.VERIFIER)
    self.keys: auth.Keys | None = None    # of the open session
    self.features = Feature(0)            # the open session's agreed ones
    self.adaptive = False                 # it agreed on ADAPTIVE_DEPTH
    self.state = CLOSED
    self.session: int | None = None       # its id, once a HELLO left
    self._nonce: bytes | None = None
    self._hello_tag = b""                 # the tag of the HELLO sent
    self.refused: Code | None = None      # the Code of a refused HELLO
    self.ledger = Ledger(caps.vocab)      # the requests' committed state
    self.requests = self.ledger.requests
    # The rounds in flight (at most `caps.max_slots`), oldest first, by
    # key (the ledger knows which one owns each request).
    self.exchanges: dict[int, Exchange] = {}
    self.answers = Answers(self.ledger, self.exchanges, self.counters)
    # The key of the last round begun: every round is numbered, fallback
    # ones too, and the number travels with its plan to every rank.
    self._rounds = 0
    # Allocated once a HELLO agrees.
    self.slots: list[staging.Slot] | None = None
    self.max_message = self.bounds.max_reply_message
    self.max_frames = 2 * caps.max_requests

  @property
  def counters(self) -> Counters:
    return self._counters

  @counters.setter
  def counters(self, counters: Counters) -> None:
    """A new count (tests) reaches the router of answers too."""
    self._counters = self.answers.counters = counters

  @property
  def is_open(self) -> bool:
    return self.state == OPEN

  @property
  def exchange(self) -> Exchange | None:
    """The oldest exchange in flight (None: none is)."""
    return next(iter(self.exchanges.values()), None)

  def abandon(self) -> None:
    """Forgets every exchange in flight, with no fallback and nothing
    counted (a driver that gives up on its rounds; their requests keep
    the tags they were sent with, so a late answer is stale)."""
    self.exchanges.clear()
    self.ledger.owner.clear()

  def open_keys(self) -> tuple[int, auth.Keys]:
    """(session id, keys) of the open session (RuntimeError: none is)."""
    if self.session is None or self.keys is None:
      raise RuntimeError(f"no open session ({self.state})")
    return self.session, self.keys

  # -- requests --------------------------------------------------------------

  def add_request(self, rid: int, prompt: typing.Sequence[int],
                  seed: int) -> None:
    """A new request: its prompt (committed tokens) and RNG seed."""
    self.ledger.add(rid, prompt, seed)

  def remove_request(self, rid: int) -> Send | None:
    """Forgets request `rid` here and (RESET REMOVE) on the worker."""
    self.ledger.remove(rid)
    self.counters.event("removes")
    return self._reset_message([rid], Reason.REMOVE)

  def reset(self, rid: int | None = None) -> Send | None:
    """Cancels request `rid` (all when None): a new generation, RESET."""
    targets = list(self.requests) if rid is None else [rid]
    self.ledger.bump_all(targets)
    self.counters.event("resets")
    return self._reset_message(targets, Reason.CANCEL)

  def _reset_message(self, rids: list[int], reason: Reason) -> Send | None:
    if not self.is_open or not rids:
      return None
    session, keys = self.open_keys()
    frames = []
    for r in rids:
      frames.append(codec.encode(
          Kind.RESET, session=session, generation=self.ledger.generation(r),
          round_id=0, send=keys.send,
          body={"request": r, "reason": reason}))
    return Send(b"".join(frames))

  # -- the session -----------------------------------------------------------

  def hello(self, now: float = 0.0) -> Send:
    """The HELLO to send (again): a new session when none is opening."""
    del now
    if self.state != OPENING or self.session is None or self._nonce is None:
      self.session = int.from_bytes(self._entropy(8), "little")
      self._nonce = bytes(self._entropy(layouts.NONCE_BYTES))
      self.state, self.keys, self.refused = OPENING, None, None
    frame = hello.hello_frame(self.caps, self.session, self._nonce,
                              self._hello_keys.send)
    self._hello_tag = auth.tag_of(frame)
    return Send(frame)

  def reconnect(self) -> None:
    """A new session: every request moves to a new generation (in-flight
    keys are void); send `hello()` next."""
    self.close()
    self.ledger.bump_all()
    self.counters.event("reconnects")

  def close(self) -> None:
    """The transport is gone: the next round opens a new session. No
    answer to an exchange in flight can come any more: each falls back
    at the next `poll` (TIMEOUT)."""
    self.state, self.keys = CLOSED, None
    for ex in self.exchanges.values():
      ex.expire()

  def expire(self, key: int) -> None:
    """Exchange `key` can get no answer (its STEP never left): it falls
    back at the next `poll`."""
    self.exchanges[key].expire()

  def _opening(self, frames: list[memoryview]) -> None:
    if len(frames) != 1:
      self.counters.reject(Code.BAD_SEQUENCE, "answer to HELLO")
      return
    frame = frames[0]
    try:
      h = codec.header(frame)
      if h.session != self.session:
        raise ProtocolError(Code.UNKNOWN_SESSION, f"session {h.session}")
      # Nothing but a HELLO (its nonce keys the check) or a RESET is
      # decoded before its tag checks.
      if h.kind not in (Kind.HELLO, Kind.RESET):
        raise ProtocolError(Code.BAD_SEQUENCE, f"kind {h.kind} to HELLO")
      refusal = auth.refusal_keys(self._secret, self._hello_tag,
                                  auth.VERIFIER).recv
      if h.kind == Kind.RESET and not auth.check(frame, refusal):
        raise ProtocolError(Code.AUTH_FAILED, "RESET to HELLO")
      f = codec.decode(frame, codec.HELLO_BOUNDS)
    except ProtocolError as e:
      self.counters.reject(e.code, "answer to HELLO")
      return
    if f.kind == Kind.RESET:
      if f.body.reason != Reason.REFUSED or f.tag != (0, 0):
        self.counters.reject(Code.BAD_SEQUENCE, "RESET to HELLO")
      else:
        code = Code.parse(f.body.code) or Code.BAD_STATUS
        self.counters.reject(code, "the worker refused the HELLO")
        self.state, self.refused = CLOSED, code
      return
    if f.kind != Kind.HELLO:
      self.counters.reject(Code.BAD_SEQUENCE, f"{f.kind.name} to HELLO")
      return
    assert self.session is not None and self._nonce is not None  # OPENING
    features = Feature(int(f.body.features))
    # With or without GMAC the answer itself (a HELLO) carries BLAKE3's
    # tag; the keys are made once, with the session's sealer state.
    keys = auth.session_keys(self._secret, self.session, self._nonce,
                             f.body.nonce, auth.VERIFIER,
                             gmac=bool(features & Feature.GMAC))
    if not auth.check(frame, keys.recv):
      self.counters.reject(Code.AUTH_FAILED, "HELLO answer")
      return
    differ = hello.mismatches(self.caps, f.body)
    if differ:
      self.counters.reject(Code.IDENTITY_MISMATCH, "; ".join(differ))
      self.state, self.refused = CLOSED, Code.IDENTITY_MISMATCH
      return
    if int(f.body.features) & ~int(self.caps.features):
      self.counters.reject(Code.IDENTITY_MISMATCH, f"features "
                           f"{f.body.features} beyond the offer "
                           f"{int(self.caps.features)}")
      self.state, self.refused = CLOSED, Code.IDENTITY_MISMATCH
      return
    self.keys, self.state, self.features = keys, OPEN, features
    self.adaptive = bool(features & Feature.ADAPTIVE_DEPTH)
    self.bounds = self.caps.bounds._replace(
        packed=bool(features & Feature.PACKED_REPLY),
        max_context=(self.caps.max_context if features & Feature.CONTEXT
                     else 0),
        packed_step=bool(features & Feature.PACKED_STEP))
    if self.slots is None:        # nothing is allocated before agreement
      self.slots = staging.slots_for(self.caps)
    self.counters.event("hellos")

  # -- one round -------------------------------------------------------------

  def begin(self, rids: typing.Sequence[int], depth: int, now: float,
            timeout_s: float | None = None) -> tuple[Send, Exchange]:
    """Starts the round of requests `rids`; returns (its STEP message, its
    exchange). timeout_s: its deadline from `now` (None: the session's)."""
    if not self.is_open:
      raise RuntimeError("begin: the session is not open (send hello())")
    if len(self.exchanges) >= self.caps.max_slots:
      raise RuntimeError(f"begin: {len(self.exchanges)} rounds in flight, "
                         f"the session's max_slots")
    rids = [int(r) for r in rids]
    if not 1 <= len(rids) <= self.caps.max_requests or len(set(rids)) != len(
        rids) or not 1 <= depth <= self.caps.max_depth:
      raise ValueError(f"begin: {len(rids)} distinct requests in [1, "
                       f"{self.caps.max_requests}] and depth {depth} in "
                       f"[1, {self.caps.max_depth}] needed")
    busy = [r for r in rids if r in self.ledger.owner]
    if busy:
      raise ValueError(f"begin: requests {busy} are in a round in flight")
    reqs = self.ledger.advance(rids)
    tags = {req.rid: (req.generation, req.round) for req in reqs}
    assert self.slots is not None   # allocated when the session opened
    session, keys = self.open_keys()
    # A slot no exchange in flight holds (one is free: len(slots) is
    # max_slots); a Verify's rows are copied out of its slot, so a driver
    # runs each Verify before it begins another round.
    held = [ex.slot for ex in self.exchanges.values()]
    slot = next(s for s in self.slots if all(s is not h for h in held))
    if self.exchanges:
      self.counters.event("overlapped")   # the worker drafts it meanwhile
    frames = _step_frames(
        reqs, depth, Policy.GREEDY if self.caps.greedy else Policy.SAMPLED,
        session, keys.send, self.bounds.packed_step,
        lambda req: self._context(req, session, keys))
    self._rounds += 1
    expected = b"".join(   # the PACKED records of the usual answer
        _RECORD.pack(req.rid, depth, 0, 0, req.generation, req.round,
                     req.anchor, req.context_version) for req in reqs)
    ex = Exchange(rids, tags, depth,
                  now + (self.timeout_s if timeout_s is None else timeout_s),
                  slot, self._rounds, expected, auth.tag_of(frames[0]),
                  adaptive=self.adaptive)
    self.exchanges[ex.key] = ex
    self.ledger.own(ex)
    message = b"".join(frames)
    self.counters.event("bytes_out", len(message))
    return Send(message), ex

  def _context(self, req: Request, session: int,
               keys: auth.Keys) -> list[bytes]:
    """The CONTEXT frame to put before `req`'s STEP: one in the first round
    of each (session, generation) on a session that agreed on them."""
    marker = (session, req.generation)
    if not self.bounds.max_context or req.context_sent == marker:
      return []
    req.context_sent = marker
    if req.anchor > self.bounds.max_context:
      self.counters.event("contexts_too_long")
      return []
    self.counters.event("contexts")
    return [codec.encode_context(
        session=session, generation=req.generation, round_id=req.round,
        request=req.rid, tokens=req.tokens, send=keys.send)]

  def draw_inputs(self, key: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seeds, generations, rounds, anchors) of exchange `key`'s requests
    (None: the oldest in flight): what the PROPOSAL draws of the sampling
    audit are computed from."""
    ex = self._find(key)
    if ex is None:
      raise RuntimeError(f"draw_inputs: no exchange {key} in flight")
    reqs = [self.requests[r] for r in ex.rids]
    return (np.array([q.seed for q in reqs], np.uint64),
            np.array([ex.tags[q.rid][0] for q in reqs], np.int64),
            np.array([ex.tags[q.rid][1] for q in reqs], np.int64),
            np.array([q.anchor for q in reqs], np.int64))

  def _find(self, key: int | None) -> Exchange | None:
    return self.exchange if key is None else self.exchanges.get(key)

  def fallback(self, rids: typing.Sequence[int], code: int) -> Verify:
    """A round with no exchange (no session): every request falls back.
    It is numbered as every round is (its Verify's key)."""
    reqs = self.ledger.advance([int(r) for r in rids])
    tags = [(req.generation, req.round) for req in reqs]
    self._rounds += 1
    plan = empty_plan(self.caps, [q.rid for q in reqs], tags,
                      [int(code)] * len(reqs), self.caps.max_depth,
                      key=self._rounds)
    return Verify(plan, self._rounds)

  def receive(self, message: layouts.Buffer,
              now: float = 0.0) -> list[Stage | Verify]:
    """Handles one received message; returns [], [Stage] or [Verify].

    The q rows of an expected PACKED answer are staged in place: the
    Stage's `rows.values` is a view of `message`, so its buffer must not
    change until the exchange's Verify (a driver hands over each received
    message and keeps no other use of it: a ZeroMQ frame, bytes).
    """
    self.counters.event("bytes_in", len(message))
    try:
      frames = codec.split(message, max_frames=self.max_frames,
                           max_bytes=self.max_message)
    except ProtocolError as e:
      self.counters.reject(e.code, "worker message")
      return []
    if self.state == OPENING:
      self._opening(frames)
      return []
    if self.state != OPEN:
      self.counters.reject(Code.UNKNOWN_SESSION, "message without a session")
      return []
    try:
      headers = [codec.header(f) for f in frames]
    except ProtocolError as e:
      self.counters.reject(e.code, "worker message")
      return []
    if any(h.session != self.session for h in headers):
      self.counters.reject(Code.UNKNOWN_SESSION, "frame of another session")
      return []
    _, keys = self.open_keys()
    if not all(auth.check(f, keys.recv) for f in frames):
      if len(frames) == 1 and headers[0].kind == Kind.RESET:
        for ex in self.exchanges.values():
          if auth.check(frames[0], auth.refusal_keys(
              self._secret, ex.step_tag, auth.VERIFIER).recv):
            return self._refusal(ex, frames[0], headers[0], now)
      self.counters.reject(Code.AUTH_FAILED, "worker message")
      return []
    if headers[0].kind == Kind.HELLO and len(frames) == 1:
      self.counters.event("late_hellos")   # a retried HELLO's answer
      return []
    self.answers.route(frames, headers, self.bounds)
    return self._progress(now)

  def _refusal(self, ex: Exchange, frame: memoryview,
               header: layouts.Header, now: float) -> list[Stage | Verify]:
    try:
      body = codec.decode(frame, codec.HELLO_BOUNDS).body
    except ProtocolError as e:
      self.counters.reject(e.code, "worker RESET")
      return []
    code = Code.parse(body.code) if body.reason == Reason.REFUSED else None
    if code is None:
      self.counters.reject(Code.BAD_STATUS, f"RESET reason {body.reason} "
                           f"code {body.code}")
      return []
    tag = (header.generation, header.round)
    if tag != ex.tags[ex.rids[0]]:
      late = self.ledger.late(tag)
      self.counters.reject(late or Code.BAD_SEQUENCE,
                           f"late RESET ({code.name})")
      return []
    self.counters.reject(code, "worker RESET")
    if code in (Code.UNKNOWN_SESSION, Code.SESSION_EXHAUSTED):
      self.close()    # the worker restarted, or ended the session: HELLO again
    ex.refuse_open(code)
    return self._progress(now)

  def _progress(self, now: float) -> list[Stage | Verify]:
    """The effects of every exchange that ended: answered in full (a
    Stage, or a Verify when every request already failed) or past its
    deadline (`poll`), oldest first."""
    effects: list[Stage | Verify] = []
    for ex in list(self.exchanges.values()):
      if not ex.open:
        continue
      if not ex.complete:
        effects += self.poll(now, ex.key)
      elif not (ex.codes == 0).any():
        effects.append(self._verify(ex))
      else:
        ex.fire(Event.STAGE)
        effects.append(Stage(ex.rows, ex.codes == 0, ex.codes.copy(),
                             key=ex.key))
    return effects

  def poll(self, now: float, key: int | None = None
           ) -> list[Stage | Verify]:
    """The watchdog: an exchange past its deadline falls back whole.

    key: that exchange only (None: every one in flight). TIMEOUT is
    counted for every request whose proposal this discards (answered in
    time or not), except those refused with a code of their own.
    """
    effects: list[Stage | Verify] = []
    for ex in list(self.exchanges.values()):
      if not ex.open or now < ex.deadline or key not in (None, ex.key):
        continue
      for i, rid in enumerate(ex.rids):
        if ex.codes[i] == 0:
          self.counters.reject(Code.TIMEOUT, f"request {rid}")
          ex.codes[i] = Code.TIMEOUT
      ex.answered[:] = True
      effects.append(self._verify(ex))
    return effects

  def staged(self, verdict: qformats.Verdict,
             key: int | None = None) -> Verify:
    """The Plan of an exchange, from the verdicts of its staged rows.

    verdict: a `qformats.Verdict` of the Stage's rows (counts [R, D, w],
    codes [R, D]); key: the Stage's (None: the oldest exchange in
    flight). A request is verified only if every one of its rows is
    valid; else its first refused row's code is counted and it falls
    back.
    """
    ex = self._find(key)
    if ex is None or not ex.staging:
      raise RuntimeError(f"staged: no exchange {key} awaits its verdict")
    codes = np.asarray(verdict.codes)
    if (ex.lengths < ex.depth).any():
      # A short answer's rows past its length are no part of its chain
      # (the slot's older bytes): their verdicts are not read.
      self.counters.event("short_answers", int((ex.lengths < ex.depth).sum()))
      codes = np.where(np.arange(codes.shape[-1]) < ex.lengths[:, None],
                       codes, 0)
    # One pass finds the refused requests (rare); each is then counted.
    for i in np.flatnonzero(codes.any(-1) & (ex.codes == 0)):
      bad = np.flatnonzero(codes[i])
      ex.codes[i] = code = int(codes[i, bad[0]])
      self.counters.reject(code, f"request {ex.rids[i]} row {bad[0]}")
    return self._verify(ex, verdict.counts)

  def _verify(self, ex: Exchange, counts: Counts = None) -> Verify:
    del self.exchanges[ex.key]
    self.ledger.release(ex)
    return Verify(ex.plan(self.caps, counts), ex.key)

  def commit(self, plan: Plan, outcomes: typing.Sequence[typing.Sequence[int]]
             ) -> tuple[list[RoundResult], Send | None]:
    """Applies a round's outcomes; returns (results, Send(COMMIT) or None).

    outcomes: per request of the plan, (accepted, next_token[, code]): the
    drafted tokens accepted and the correction/bonus token (verified), or
    (0, target-only token) where plan.codes is not 0 or where `code` (the
    verification's own refusal) is. A follower rank (no session) applies
    the same and sends nothing.
    """
    results: list[RoundResult] = []
    frames: list[bytes] = []
    # The plan as Python ints, one call an array (not one a field).
    rids, tags, codes = (plan.rids.tolist(), plan.tags.tolist(),
                         plan.codes.tolist())
    drafted = plan.rows.tokens.tolist()
    for i, outcome in enumerate(outcomes):
      refused = int(outcome[2]) if len(outcome) > 2 else 0
      code = codes[i]
      if refused and not code:       # verification itself refused the row
        self.counters.reject(refused, f"verification of request {rids[i]}")
        code = refused
      result = self.ledger.commit(rids[i], (tags[i][0], tags[i][1]), code,
                                  outcome[0], drafted[i], outcome[1])
      self.counters.event("rounds")
      self.counters.event("tokens", len(result.committed))
      if code:
        self.counters.event("fallbacks")
      tag, anchor, committed = ((result.generation, result.round),
                                result.anchor, result.committed)
      accepted = result.accepted
      results.append(result)
      if self.is_open:
        session, keys = self.open_keys()
        frames.append(codec.encode(
            Kind.COMMIT, session=session, generation=tag[0],
            round_id=tag[1], send=keys.send, body={
                "request": result.rid, "accepted": accepted, "status": code,
                "fallback": int(bool(code)), "next_token": committed[-1],
                "new_position": anchor + len(committed)}))
    if not frames:
      return results, None
    message = b"".join(frames)
    self.counters.event("bytes_out", len(message))
    return results, Send(message)


def _step_frames(reqs: list[Request], depth: int, policy: Policy,
                 session: int, send: auth.Tagger, packed: bool,
                 context: typing.Callable[[Request], list[bytes]]
                 ) -> list[bytes]:
  """A round's STEP message: each request's CONTEXT frames (`context`)
  and STEP frame; on a PACKED_STEP session the CONTEXT frames first (in
  request order), then every STEP in one frame under one tag."""
  frames: list[bytes] = []
  if packed:
    for req in reqs:
      frames.extend(context(req))
    frames.append(codec.encode_packed_step(
        session=session, depth=depth, policy=policy, send=send,
        records=[(req.rid, 0, req.tokens[-1], req.generation, req.round,
                  req.seed, req.anchor, req.context_version, req.digest)
                 for req in reqs]))
    return frames
  for req in reqs:
    frames.extend(context(req))
    frames.append(codec.encode(
        Kind.STEP, session=session, generation=req.generation,
        round_id=req.round, send=send, body={
            "request": req.rid, "depth": depth, "policy": policy,
            "last_token": req.tokens[-1], "seed": req.seed,
            "anchor": req.anchor, "context_version": req.context_version,
            "prefix_digest": req.digest}))
  return frames
