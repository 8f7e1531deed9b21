"""A rank link's protocol, sans I/O: block s of q, worker rank s -> verifier rank s.

Between the two leaders runs the ordinary session (`VerifierSession`,
`WorkerSession`). Between worker rank s and verifier rank s (s >= 1) runs a
shard link: the verifier rank says HELLO with its block's capabilities
(`Capabilities.link(s)`), the worker rank answers as a worker does (same
key schedule; another block is IDENTITY_MISMATCH), the verifier rank
confirms the session with its first authenticated frame (a RESET of no
request), and then only REPLY frames of block s flow, worker to verifier,
one per request and round, tagged with the leader's (generation, round).

Like the two sessions, these never touch a socket, a thread, a clock or
JAX: messages and the time go in, messages and typed records come out; the
drivers are `rank_links.ShardReceiver` and `rank_links.ShardSender`.

    ShardLinkSession (verifier rank s)
      hello(now) -> Send                     until `is_open` or `refused`
      receive(message, now) -> [Send] | [Collected] | []
      begin(rids, tags, depth, now) -> [Send]  a HELLO after a silent round
      poll(now) -> [] | [Collected]          the round's deadline
    ShardSourceSession (worker rank s)
      receive(message) -> [Send]             HELLO answers
      reply(request, tag, depth) -> ShardReply | None, then seal(reply)

A frame is staged only when it is of this link's session, authentic, a
REPLY, of a request of the round with its tag and depth; anything else is
counted and dropped. A round ends when every request's frame is in or at
its deadline; a request without its frame is a TIMEOUT. A round without a
single frame makes the next one start with a fresh HELLO (the worker rank
may be a restarted process that knows no session).
"""

import os
import typing

import numpy as np

from dyadic_jax.bridge import hello
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.deadline import AdaptiveDeadline
from dyadic_jax.bridge.effects import Message, Send
from dyadic_jax.bridge.verifier_session import VerifierSession
from dyadic_jax.bridge.worker_session import WorkerSession
from dyadic_jax.wire import auth, codec, layouts, qformats
from dyadic_jax.wire.refusals import Code, ProtocolError


class Collected(typing.NamedTuple):
  """A round of the link is over: block s's rows [R, D, w] (the session's
  staging buffer, valid until the next round) and codes int32[R] (0: the
  request's frame is in; else why not: TIMEOUT when none came)."""
  rows: qformats.Rows
  codes: np.ndarray


class _Round(typing.NamedTuple):
  rids: list[int]
  position: dict[int, int]
  tags: list[tuple[int, int]]
  depth: int
  start: float
  deadline: float
  codes: np.ndarray


class ShardLinkSession:
  """Verifier rank s's end of its shard link (see the module docstring)."""

  def __init__(self, caps: hello.Capabilities, *, secret: bytes | None,
               timeout_s: float = 2.0, counters: Counters | None = None,
               deadline: AdaptiveDeadline | None = None,
               entropy: typing.Callable[[int], bytes] = os.urandom):
    """caps: the block's capabilities (`Capabilities.link(s)`); timeout_s:
    the deadline of a HELLO and, without `deadline` (from the measured
    round time), of every round."""
    self.caps = caps
    self.counters = counters or Counters(f"verifier rank {caps.shard}")
    self.hello_session = VerifierSession(caps, secret=secret,
                                         timeout_s=timeout_s,
                                         counters=self.counters,
                                         entropy=entropy)
    self.timeout_s = timeout_s
    self.deadline = deadline
    self.rows = caps.format.staging(caps.max_requests, caps.max_depth,
                                    caps.width)
    self.seconds: list[float] = []   # per round: start to its last frame
    self.request_rounds = 0
    self._round: _Round | None = None
    self._silent = False     # the last round got nothing: say HELLO again

  @property
  def is_open(self) -> bool:
    return self.hello_session.is_open

  @property
  def refused(self) -> Code | None:
    """The Code of a refused HELLO (IDENTITY_MISMATCH), else None."""
    return self.hello_session.refused

  @property
  def session(self) -> int | None:
    """The link's session id (None before a HELLO)."""
    return self.hello_session.session

  def lost(self) -> None:
    """The driver lost its connection: the next round starts with a new
    HELLO, as after a silent one."""
    self._silent = True

  @property
  def silent(self) -> bool:
    """The last round got no frame: the next one starts with a new HELLO
    (its driver makes a new socket for it, too)."""
    return self._silent

  @property
  def round_deadline(self) -> float | None:
    """When the round in flight ends at the latest (None: none is)."""
    return None if self._round is None else self._round.deadline

  def hello(self, now: float = 0.0) -> Send:
    """The HELLO to send (again)."""
    return self.hello_session.hello(now)

  def reconnect(self) -> None:
    """Forgets the session: send `hello()` next."""
    self.hello_session.reconnect()

  def begin(self, rids: typing.Sequence[int],
            tags: typing.Sequence[typing.Sequence[int]], depth: int,
            now: float) -> list[Send]:
    """Starts a round of requests `rids` with the leader's `tags`
    [(generation, round)] and `depth`; returns what to send first."""
    seconds = self.timeout_s if self.deadline is None else (
        self.deadline.seconds())
    rids = [int(r) for r in rids]
    self._round = _Round(rids, {r: i for i, r in enumerate(rids)},
                         [(int(g), int(n)) for g, n in tags], int(depth),
                         now, now + seconds,
                         np.full(len(rids), int(Code.TIMEOUT), np.int32))
    if not self._silent:
      return []
    # Frames are refused until the fresh HELLO is answered.
    self.reconnect()
    return [self.hello(now)]

  def receive(self, message: Message,
              now: float = 0.0) -> list[Send | Collected]:
    """Handles one message: the HELLO's answer ([Send] of the confirming
    frame once the session opens) or frames of the round in flight
    ([Collected] once every request's frame is in)."""
    if not self.is_open:
      self.hello_session.receive(message, now)
      if not self.is_open:
        return []
      if self.deadline is not None:
        self.deadline.new_session()      # from the next round on
      return [self._confirm()]
    if self._round is None:
      self.counters.reject(Code.BAD_SEQUENCE, f"shard {self.caps.shard} "
                           "frames between rounds")
      return []
    self.counters.event("bytes_in", len(message))
    for frame in self._frames(message):
      self._frame(frame)
    if (self._round.codes == Code.TIMEOUT).any():
      return []
    return [self._end(now)]

  def poll(self, now: float) -> list[Collected]:
    """The round's end at its deadline ([] before it, or with none)."""
    if self._round is None or now < self._round.deadline:
      return []
    return [self._end(now)]

  def _confirm(self) -> Send:
    """The session's first authenticated frame to the worker rank (a
    RESET of no request): it makes the session the link's."""
    session, keys = self.hello_session.open_keys()
    return Send(codec.encode(
        layouts.Kind.RESET, session=session, generation=0, round_id=0,
        send=keys.send,
        body={"request": layouts.ALL_REQUESTS,
              "reason": layouts.Reason.CANCEL}))

  def _frames(self, message: Message) -> list[memoryview]:
    try:
      return codec.split(message, max_frames=self.caps.max_requests,
                         max_bytes=self.caps.bounds.max_reply_message)
    except ProtocolError as e:
      self.counters.reject(e.code, f"shard {self.caps.shard} message")
      return []

  def _frame(self, frame: memoryview) -> None:
    """Stages one frame of the round, or counts why not."""
    shard, rnd = self.caps.shard, self._round
    assert rnd is not None        # `receive` stages frames of a round only
    try:
      h = codec.header(frame)
      if h.session != self.session:
        raise ProtocolError(Code.UNKNOWN_SESSION, f"session {h.session}")
      f = codec.decode(frame, self.caps.bounds,
                       self.hello_session.open_keys()[1].recv)
      if f.kind != layouts.Kind.REPLY:
        raise ProtocolError(Code.BAD_SEQUENCE, f"{f.kind.name} on a shard "
                            "link")
    except ProtocolError as e:
      self.counters.reject(e.code, f"shard {shard} frame")
      return
    i = rnd.position.get(f.body.request)
    if i is None or f.tag != rnd.tags[i] or f.body.depth != rnd.depth:
      late = i is not None and f.tag[0] == rnd.tags[i][0]
      self.counters.reject(
          Code.DUPLICATE_ROUND if late else Code.STALE_GENERATION,
          f"shard {shard} request {f.body.request} {f.tag}")
      return
    for name in ("tokens", "n", "values"):
      np.copyto(getattr(self.rows, name)[i, :rnd.depth],
                getattr(f.rows, name))
    rnd.codes[i] = 0

  def _end(self, now: float) -> Collected:
    rnd, self._round = self._round, None
    assert rnd is not None        # `receive` and `poll` end a round only
    codes = rnd.codes
    self._silent = bool((codes == Code.TIMEOUT).all())
    self.seconds.append(now - rnd.start)
    if self.deadline is not None and not (codes == Code.TIMEOUT).any():
      self.deadline.observe(self.seconds[-1])      # every frame in
    self.request_rounds += len(rnd.rids)
    for i in np.flatnonzero(codes):
      self.counters.reject(int(codes[i]), f"shard {self.caps.shard} "
                           f"request {rnd.rids[i]}")
    return Collected(self.rows, codes)

  def figures(self) -> dict[str, typing.Any]:
    """What the link carried: bytes and seconds per round."""
    return {"bytes_in": self.counters.events("bytes_in"),
            "request_rounds": self.request_rounds,
            "round_seconds": list(self.seconds)}


class ShardReply(typing.NamedTuple):
  """A REPLY frame of block s to fill (`rows`: views of its payload), then
  to `seal` with the link's keys of the session it was begun in."""
  frame: memoryview
  rows: qformats.Rows
  keys: auth.Keys


class ShardSourceSession:
  """Worker rank s's end of its shard link (see the module docstring)."""

  def __init__(self, caps: hello.Capabilities, *, secret: bytes | None,
               counters: Counters | None = None) -> None:
    self.caps = caps
    self.counters = counters or Counters(f"worker rank {caps.shard}")
    self.worker = WorkerSession(caps, secret=secret, counters=self.counters)
    self.max_message = self.worker.max_message
    # (session id, keys) frames go out under: the session the verifier
    # rank confirmed (its first authenticated frame after the HELLO). A
    # replayed HELLO opens only a pending session, which never takes it.
    # One attribute, replaced whole: a reader needs no lock.
    self.link: tuple[int, auth.Keys] | None = None

  @property
  def link_session(self) -> int | None:
    """The session id frames go out under (None before a confirmation)."""
    link = self.link
    return None if link is None else link[0]

  def receive(self, message: Message) -> list[Send]:
    """Answers one message from the verifier rank (HELLOs; a STEP draws
    nothing here and is counted)."""
    answer = self.worker.receive(message)
    if answer.propose:
      self.counters.reject(Code.BAD_SEQUENCE, "STEP on a shard link")
      return []
    est = self.worker.established
    if est is not None and (self.link is None or self.link[0] != est.id):
      self.link = (est.id, est.keys)
    return list(answer.send)

  def reply(self, request: int, tag: tuple[int, int],
            depth: int) -> ShardReply | None:
    """A REPLY of `request` to fill, or None before a session."""
    link = self.link
    if link is None:
      return None
    buf = bytearray(self.caps.bounds.reply_bytes(depth))
    frame, rows = codec.begin_reply(
        buf, bounds=self.caps.bounds, session=link[0], generation=tag[0],
        round_id=tag[1], request=request, depth=depth)
    return ShardReply(frame, rows, link[1])

  def seal(self, reply: ShardReply) -> memoryview:
    """The filled frame, sealed: the message to send."""
    auth.seal(reply.frame, reply.keys.send)
    return reply.frame
