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
      receive(message, now) -> [Send] | [Collected, ...] | []
      begin(rids, tags, depth, now, key) -> [Send]  a HELLO after silence
      poll(now) -> [Collected, ...] | []     the rounds' deadlines
      release(key)                           a collected round's buffer
    ShardSourceSession (worker rank s)
      receive(message) -> [Send]             HELLO answers
      reply(request, tag, depth) -> ShardReply | None, then seal(reply)

Up to `caps.max_slots` rounds are in flight at once (the leader's two
exchanges), each named by its `key` and staged in a buffer of its own;
the requests of rounds in flight are disjoint (the leader's are), so a
frame's request names its round. A frame is staged only when it is of
this link's session, authentic, a REPLY, of a request of a round in flight
with its tag and depth; anything else is counted and dropped. A round ends
when every request's frame is in or at its deadline; a request without its
frame is a TIMEOUT. Each round ends on its own: a frame missing, late or
forged in one changes no other. A round that ends without the link having
carried a single frame since it began (to it or to another round) makes the
next one start with a fresh HELLO (the worker rank may be a restarted
process that knows no session); one in flight beside a silent round, whose
frames do come, keeps the session.
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
  """Round `key` of the link is over: block s's rows [R, D, w] (a staging
  buffer of the session's, held until `release(key)`) and codes int32[R]
  (0: the request's frame is in; else why not: TIMEOUT when none came)."""
  rows: qformats.Rows
  codes: np.ndarray
  key: int = 0


class _Round(typing.NamedTuple):
  key: int
  rids: list[int]
  position: dict[int, int]
  tags: list[tuple[int, int]]
  depth: int
  start: float
  deadline: float
  codes: np.ndarray
  buffer: int          # which staging buffer
  heard: int           # frames the link had staged when it began


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
    # One staging buffer per round in flight; a buffer's holder: the key
    # of the round staged in it, until `release`.
    self.buffers = [caps.format.staging(caps.max_requests, caps.max_depth,
                                        caps.width)
                    for _ in range(caps.max_slots)]
    self._holders: list[int | None] = [None] * caps.max_slots
    self.seconds: list[float] = []   # per round: start to its last frame
    self.request_rounds = 0
    self._rounds: dict[int, _Round] = {}     # in flight, by key
    self._heard = 0          # frames staged, ever
    self._silent = False     # a round ended unheard: say HELLO again

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

  def round_deadline(self, key: int = 0) -> float | None:
    """When round `key` ends at the latest (None: it is not in flight)."""
    rnd = self._rounds.get(key)
    return None if rnd is None else rnd.deadline

  def in_flight(self, key: int) -> bool:
    """Whether round `key` is begun and not yet over."""
    return key in self._rounds

  def hello(self, now: float = 0.0) -> Send:
    """The HELLO to send (again)."""
    return self.hello_session.hello(now)

  def reconnect(self) -> None:
    """Forgets the session: send `hello()` next."""
    self.hello_session.reconnect()

  def begin(self, rids: typing.Sequence[int],
            tags: typing.Sequence[typing.Sequence[int]], depth: int,
            now: float, key: int = 0) -> list[Send]:
    """Starts round `key` of requests `rids` with the leader's `tags`
    [(generation, round)] and `depth`; returns what to send first.

    A round over under the same `key` is released first (its rows are
    read: the key is reused).

    Raises RuntimeError (the driver's misuse, nothing changed): round
    `key` is in flight, a request is in another round in flight, or every
    staging buffer is held (`release` one first).
    """
    key = int(key)
    rids = [int(r) for r in rids]
    if key in self._rounds:
      raise RuntimeError(f"begin: round {key} is in flight")
    busy = {r for rnd in self._rounds.values() for r in rnd.rids}
    if busy & set(rids):
      raise RuntimeError(f"begin: requests {sorted(busy & set(rids))} are "
                         "in another round in flight")
    if None not in self._holders and key not in self._holders:
      raise RuntimeError(f"begin: {len(self._holders)} staging buffers held "
                         "(release a collected round first)")
    self.release(key)
    buffer = self._holders.index(None)
    self._holders[buffer] = key
    seconds = self.timeout_s if self.deadline is None else (
        self.deadline.seconds())
    self._rounds[key] = _Round(
        key, rids, {r: i for i, r in enumerate(rids)},
        [(int(g), int(n)) for g, n in tags], int(depth), now, now + seconds,
        np.full(len(rids), int(Code.TIMEOUT), np.int32), buffer, self._heard)
    if not self._silent:
      return []
    # Frames are refused until the fresh HELLO is answered.
    self._silent = False
    self.reconnect()
    return [self.hello(now)]

  def release(self, key: int) -> None:
    """Round `key`'s buffer may stage another round (its `Collected.rows`
    are read). A key that holds none is a no-op."""
    self._holders = [None if h == key and key not in self._rounds else h
                     for h in self._holders]

  def receive(self, message: Message,
              now: float = 0.0) -> list[Send | Collected]:
    """Handles one message: the HELLO's answer ([Send] of the confirming
    frame once the session opens) or frames of the rounds in flight (a
    Collected for each round whose every frame is now in)."""
    if not self.is_open:
      self.hello_session.receive(message, now)
      if not self.is_open:
        return []
      if self.deadline is not None:
        self.deadline.new_session()      # from the next round on
      return [self._confirm()]
    if not self._rounds:
      self.counters.reject(Code.BAD_SEQUENCE, f"shard {self.caps.shard} "
                           "frames between rounds")
      return []
    self.counters.event("bytes_in", len(message))
    staged: set[int] = set()
    for frame in self._frames(message):
      key = self._frame(frame)
      if key is not None:
        staged.add(key)
    return [self._end(self._rounds[k], now) for k in sorted(staged)
            if not (self._rounds[k].codes == Code.TIMEOUT).any()]

  def poll(self, now: float) -> list[Collected]:
    """The end of every round past its deadline ([] when none is)."""
    return [self._end(rnd, now) for rnd in list(self._rounds.values())
            if now >= rnd.deadline]

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

  def _frame(self, frame: memoryview) -> int | None:
    """Stages one frame of a round in flight (returns its key), or counts
    why not (None)."""
    shard = self.caps.shard
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
      return None
    # The rounds in flight hold disjoint requests: at most one has it.
    rnd = next((r for r in self._rounds.values()
                if f.body.request in r.position), None)
    i = -1 if rnd is None else rnd.position[f.body.request]
    if rnd is None or f.tag != rnd.tags[i] or f.body.depth != rnd.depth:
      late = rnd is not None and f.tag[0] == rnd.tags[i][0]
      self.counters.reject(
          Code.DUPLICATE_ROUND if late else Code.STALE_GENERATION,
          f"shard {shard} request {f.body.request} {f.tag}")
      return None
    rows = self.buffers[rnd.buffer]
    for name in ("tokens", "n", "values"):
      np.copyto(getattr(rows, name)[i, :rnd.depth], getattr(f.rows, name))
    rnd.codes[i] = 0
    self._heard += 1
    return rnd.key

  def _end(self, rnd: _Round, now: float) -> Collected:
    del self._rounds[rnd.key]
    codes = rnd.codes
    # Silent: the link carried no frame, to any round, while it flew.
    self._silent = self._heard == rnd.heard
    self.seconds.append(now - rnd.start)
    if self.deadline is not None and not (codes == Code.TIMEOUT).any():
      self.deadline.observe(self.seconds[-1])      # every frame in
    self.request_rounds += len(rnd.rids)
    for i in np.flatnonzero(codes):
      self.counters.reject(int(codes[i]), f"shard {self.caps.shard} "
                           f"request {rnd.rids[i]}")
    return Collected(self.buffers[rnd.buffer], codes, rnd.key)

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
