"""Rank-to-rank q shard links between a tensor-parallel worker and verifier.

A TP-n draft worker (n `jax.distributed` processes, rank s holding
vocabulary block s) and a TP-n verifier (n processes on a vocabulary
mesh). Dense q never crosses ranks:

* **The leader link** (worker rank 0 <-> verifier rank 0) is the ordinary
  session (HELLO, STEP, REPLY, COMPLETION, COMMIT, RESET), its
  capabilities those of block 0 (`Capabilities.link(0)`, `shards = n`):
  REPLY rows carry the drafted tokens and block 0's counts.
* **A shard link** (worker rank s <-> verifier rank s, s >= 1) carries
  block s: its protocol is `shard_link` (sans I/O: HELLO with the block's
  capabilities, then only REPLY frames, worker to verifier, tagged with the
  leader's (generation, round) and MAC'd with the link's session keys);
  `ShardSender` and `ShardReceiver` here drive it over sockets.

This module holds the drivers and the collectives; the `Worker` and the
`Verifier` take its components (a draw hook; a validator, a plan sharer
and a round hook) and are never subclassed.

The worker leader owns the RNG. For every proposal it broadcasts the STEP's
inputs to its other ranks (`ProposalBroadcast`, the leader `Worker`'s draw
hook: one small gloo broadcast); all
ranks run the proposer together over their mesh (`draft_proposer(...,
executor=)`): the draft weights' normalizer and the allocation's tickets are
all-reduces, and each token is one PROPOSAL draw mapped shard-then-token
(the shard by global count mass, then the token inside it), replicated on
every rank before the next Markov row. Each rank writes its own block; the
other ranks send theirs on their links (`follow_proposals`).

The verifier ranks agree before anything is used (`RankRound` on the
leader, and `follow_rounds` on the other ranks). Per round:

1. the leader announces the round as it begins (BEGIN: request ids, tags,
   depth), and again as its finish begins (FINISH);
2. rank 0 runs the leader link's exchange, rank s collects its block's
   frames, both under the same deadline, from BEGIN to FINISH and on;
3. the ranks all-gather their per-request codes (a frame missing, late,
   forged or malformed on ANY rank) with the leader's tokens and PROPOSAL
   draws;
4. one collective check of the whole q, each rank reading only its block
   (`qcheck.check_dense`): entry classes, the exact global mass (an
   integer all-reduce: exactly M per row), the token's count, and the
   sampling audit, the draw mapped shard-then-token;
5. the leader's session turns the agreed codes into the Plan, broadcast
   without q (`ranks.PlanBroadcast(counts=False)`): every rank verifies
   on the checked global counts it already holds, or falls back, for
   exactly the same requests.

A request refused on any rank is discarded on every rank, its code counted
by the leader; no rank waits past its deadline, and a dead worker rank is a
timeout.

Two rounds are in flight (the session's `max_slots`, as over one link):
the leader begins round B while round A's exchange is out, and finishes
them in the order its caller does. Every collective of a round (steps 3-5)
happens inside its finish, and the leader announces each BEGIN and FINISH
(step 1, by the round's number in the leader's session, the `key` its
plan carries too), so a follower rank, which cannot see the
leader's calls, issues the same collectives in the same order; between a
BEGIN and its FINISH a follower's link stages the round's block in a
buffer of its own (`shard_link`: rounds keyed by that number, on disjoint
requests), so a frame missing, late or forged in A is A's code alone and B
commits as it would have. The leader's round hook `finishing` sends the
FINISH before the exchange is awaited: the ranks wait for their links
together. Sparse q keeps the leader's single link (k entries, the global
top-k): the worker's other ranks take part in the draws and send nothing.
"""

import collections
import queue
import threading
import time
import typing

import jax
import numpy as np
import zmq

from dyadic_jax import qcheck, rowops, verification
from dyadic_jax.bridge import hello, proposer, ranks, transport, verifier
from dyadic_jax.bridge import worker
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.deadline import AdaptiveDeadline
from dyadic_jax.bridge.effects import Plan, Propose, Send, Stage, Verify
from dyadic_jax.bridge.shard_link import (Collected, ShardLinkSession,
                                          ShardReply, ShardSourceSession)
from dyadic_jax.bridge.exchange import Exchange
from dyadic_jax.wire import qformats
from dyadic_jax.wire import status as status_lib
from dyadic_jax.wire.refusals import Code, ProtocolError

_U64 = (1 << 64) - 1
# The proposal broadcast: what the draw needs, the request, and a mode.
_WARM, _SEND, _STOP = 0, 1, 2
# The verifier leader's announcements: a round begins (its exchange's
# requests, tags and depth; none: it falls back whole), a round's finish
# begins, no more rounds.
BEGIN, FINISH, STOP = 0, 1, 2
# This rank's block [R, D, w] -> the global array [R, D, n w] split over
# "vocab" (`sharding.from_blocks`).
Assemble = typing.Callable[[np.ndarray], jax.Array]


# -- the worker --------------------------------------------------------------


def _params(seed: int, generation: int, round_id: int, anchor: int,
            last_token: int, depth: int, request: int,
            mode: int) -> np.ndarray:
  return np.array([np.uint64(seed).view(np.int64), generation, round_id,
                   anchor, last_token, depth, request, mode], np.int64)


class ProposalBroadcast(worker.DrawHook):
  """The draw hook of a TP-n worker's leader: before each proposal, the
  other ranks get its inputs (they draw with it and send their blocks)."""

  batched = False     # every rank draws each proposal with the leader

  def warmup(self, depth: int) -> None:
    ranks.broadcast(_params(_U64, 0, 0, 0, 0, depth, 0, _WARM), True)

  def draw(self, p: Propose) -> None:
    ranks.broadcast(_params(p.seed, p.generation, p.round, p.anchor,
                            p.last_token, p.depth, p.request, _SEND), True)

  def stop(self) -> None:
    """Tells the other ranks there are no more proposals."""
    ranks.broadcast(_params(0, 0, 0, 0, 0, 0, 0, _STOP), True)


class ShardSender:
  """Worker rank s's end of its shard link: a `ShardSourceSession` behind
  a bound socket. One thread owns the socket (it answers HELLOs while the
  rank is inside a collective); frames to send reach it through a queue."""

  def __init__(self, caps: hello.Capabilities, address: str, *,
               secret: bytes | None, curve: transport.Curve | None = None,
               counters: Counters | None = None) -> None:
    self.session = ShardSourceSession(caps, secret=secret, counters=counters)
    self.caps, self.counters = caps, self.session.counters
    self.endpoint = transport.Endpoint.bind(
        address, max_message=self.session.max_message, curve=curve,
        counters=self.counters)
    self.address = self.endpoint.address
    self._outbox: queue.Queue[memoryview] = queue.Queue()
    # The confirmed session's: owned by the thread.
    self._peer: bytes | None = None
    self._halt = threading.Event()
    self._thread = threading.Thread(target=self._serve, daemon=True,
                                    name=f"shard-link-{caps.shard}")
    self._thread.start()

  def _serve(self) -> None:
    # Zero-copy sends not yet let go.
    inflight: collections.deque[tuple[zmq.MessageTracker, memoryview]] = (
        collections.deque())
    while not self._halt.is_set():
      while inflight and inflight[0][0].done:
        inflight.popleft()
      got = self.endpoint.recv(0.02)
      if got is not None:
        peer, message = got
        link = self.session.link
        for send in self.session.receive(message):
          self.endpoint.send(send.message, peer)
        if self.session.link is not link:
          self._peer = peer
      while True:
        try:
          frame = self._outbox.get_nowait()
        except queue.Empty:
          break
        sent, tracker = self.endpoint.send(frame, self._peer)
        if sent:
          self.counters.event("bytes_out", len(frame))
          if tracker is not None:
            inflight.append((tracker, frame))

  @property
  def link_session(self) -> int | None:
    """The session id frames go out under (None before the verifier rank
    confirmed one)."""
    return self.session.link_session

  def frame(self, request: int, tag: tuple[int, int],
            depth: int) -> ShardReply | None:
    """A REPLY to fill (its `rows`), or None before a session."""
    return self.session.reply(request, tag, depth)

  def send(self, reply: ShardReply) -> None:
    """Seals a filled REPLY and queues it for the verifier rank."""
    self._outbox.put(self.session.seal(reply))

  def close(self) -> None:
    self._halt.set()
    self._thread.join(5)
    self.endpoint.close()


def follow_proposals(propose: proposer.Proposer,
                     sender: ShardSender | None = None) -> int:
  """Worker rank s >= 1: draws with the leader until it stops.

  propose: the rank's proposer (the same as the leader's, over the mesh);
  sender: its `ShardSender` (None: sparse q, nothing to send). A proposal
  the proposer refuses is not sent (the verifier ranks time it out and
  agree on the leader's refusal). Returns the number of proposals sent.
  """
  sent = 0
  while True:
    p = ranks.broadcast(np.zeros(8, np.int64), False)
    seed, generation, round_id, anchor, last, depth, request, mode = (
        int(x) for x in p)
    if mode == _STOP:
      return sent
    seed = int(np.int64(seed).view(np.uint64))
    reply = None
    if mode == _SEND and sender is not None:
      reply = sender.frame(request, (generation, round_id), depth)
    try:
      propose(seed, generation, round_id, anchor, last, depth,
              out=None if reply is None else reply.rows)
    except Exception:  # pylint: disable=broad-except
      continue           # the leader's own draw fails alike: it answers
    if reply is not None and sender is not None:
      sender.send(reply)
      sent += 1


# -- the verifier ------------------------------------------------------------


class ShardReceiver:
  """Verifier rank s's end of its shard link: a `ShardLinkSession` over a
  connected socket and a clock."""

  def __init__(self, caps: hello.Capabilities, address: str, *,
               secret: bytes | None, timeout_s: float = 2.0,
               curve: transport.Curve | None = None,
               counters: Counters | None = None,
               clock: typing.Callable[[], float] = time.monotonic,
               deadline: AdaptiveDeadline | None = None) -> None:
    """timeout_s: the deadline of a HELLO and, without `deadline` (an
    `AdaptiveDeadline`: from the measured round time), of every round."""
    self.session = ShardLinkSession(caps, secret=secret, timeout_s=timeout_s,
                                    counters=counters, deadline=deadline)
    self.caps, self.counters = caps, self.session.counters
    self.deadline = deadline
    self.clock = clock
    self.address = address
    self.curve = curve
    self.endpoint: transport.Endpoint | None = None
    # Rounds over, by key, not yet `finish`ed; rounds finished, whose
    # buffers the next `begin` releases.
    self._ended: dict[int, Collected] = {}
    self._read: list[int] = []

  @property
  def timeout_s(self) -> float:
    return self.session.timeout_s

  @timeout_s.setter
  def timeout_s(self, seconds: float) -> None:
    self.session.timeout_s = seconds

  def _perform(self, effects: typing.Sequence[Send | Collected]) -> None:
    """Sends the effects' messages; keeps the Collected among them."""
    for effect in effects:
      if isinstance(effect, Collected):
        self._ended[effect.key] = effect
      else:
        assert self.endpoint is not None   # `open` connected it
        self.endpoint.send(effect.message)

  def _connect(self) -> transport.Endpoint:
    """A new socket (the old one closed): a lost link is replaced, never
    waited on (libzmq may not reconnect it)."""
    self.close()
    self.endpoint = transport.Endpoint.connect(
        self.address, max_message=self.caps.bounds.max_reply_message,
        curve=self.curve, counters=self.counters)
    return self.endpoint

  def open(self, attempts: int = 50) -> "ShardReceiver":
    """Negotiates the link (HELLO both ways); ProtocolError if it cannot."""
    endpoint = self._connect()
    session = self.session
    for _ in range(attempts):
      if endpoint.broken():
        endpoint = self._connect()
      self._perform([session.hello(self.clock())])
      deadline = self.clock() + session.timeout_s
      while (left := deadline - self.clock()) > 0 and not session.is_open:
        got = endpoint.recv(left)
        if got is not None:
          self._perform(session.receive(got[1], self.clock()))
        if session.refused is not None:
          raise ProtocolError(session.refused, "shard link refused")
      if session.is_open:
        return self
    raise ProtocolError(Code.TIMEOUT, f"no worker rank at {self.address}")

  def collect(self, rids: typing.Sequence[int],
              tags: typing.Sequence[typing.Sequence[int]],
              depth: int) -> tuple[qformats.Rows, np.ndarray]:
    """Block s's rows of one round: (Rows [R, D, w], codes int32[R]);
    `begin` then `finish`, under key 0."""
    self.begin(rids, tags, depth)
    return self.finish()

  def begin(self, rids: typing.Sequence[int],
            tags: typing.Sequence[typing.Sequence[int]], depth: int,
            key: int = 0) -> None:
    """Starts round `key` (its deadline runs from now); at most
    `caps.max_slots` are in flight, on disjoint requests. The rows of
    rounds already finished are released: they are read."""
    session = self.session
    for read in self._read:
      session.release(read)
    self._read.clear()
    if self.endpoint is not None and self.endpoint.broken():
      session.lost()
    if self.endpoint is None or session.silent:
      self._connect()         # the round's HELLO goes out on a new socket
    self._perform(session.begin(rids, tags, depth, self.clock(), key))

  def finish(self, key: int = 0) -> tuple[qformats.Rows, np.ndarray]:
    """Block s's rows of round `key`: (Rows [R, D, w], valid until the
    next `begin`; codes int32[R]).

    Waits until every request's frame is in or its deadline passes (frames
    of other rounds in flight that come meanwhile are staged for theirs);
    a request without a good frame gets its code (TIMEOUT when none came).
    """
    session = self.session
    while key not in self._ended:
      deadline = session.round_deadline(key)
      if deadline is None:
        raise RuntimeError(f"finish: round {key} is not in flight")
      assert self.endpoint is not None     # connected by `begin`
      # A lost connection ends the round now, as its deadline would.
      now = deadline if self.endpoint.broken() else self.clock()
      self._perform(session.poll(now))
      if key not in self._ended:
        got = self.endpoint.recv(max(deadline - self.clock(), 0.0))
        if got is not None:
          self._perform(session.receive(got[1], self.clock()))
    done = self._ended.pop(key)
    self._read.append(key)
    return done.rows, done.codes

  def figures(self) -> dict[str, typing.Any]:
    """What the link carried: bytes and seconds per round."""
    return self.session.figures()

  def close(self) -> None:
    if self.endpoint is not None:
      self.endpoint.close()
      self.endpoint = None


class Announced(typing.NamedTuple):
  """What the leader announced (`_Agreement.announce`): its `kind` (BEGIN,
  FINISH, STOP), which round (`key`: its number in the leader's session),
  and for a BEGIN the round's requests, their tags and depth (no requests:
  a round without an exchange)."""
  kind: int
  key: int
  rids: list[int]
  tags: list[list[int]]
  depth: int


class _Agreement:
  """Steps 1, 3 and 4 of a round (the module docstring), the same calls on
  every verifier rank in the same order."""

  def __init__(self, caps: hello.Capabilities, executor: rowops.Executor,
               assemble: Assemble) -> None:
    self.caps = caps
    self.executor = executor
    self.assemble = assemble   # local block [R, D, w] -> global [R, D, n w]
    self.leader = jax.process_index() == 0

  def announce(self, kind: int = STOP, key: int = 0,
               rids: typing.Sequence[int] = (),
               tags: typing.Sequence[typing.Sequence[int]] = (),
               depth: int = 0) -> Announced:
    """Step 1, and what orders every other collective: the leader's
    announcement (its arguments) on every rank; a follower's are unused.

    With two rounds in flight the leader interleaves its rounds' begins
    and finishes as its caller does; a follower learns each from this
    broadcast, so every rank issues the same collectives in the same
    order (BEGIN at `Verifier.start`, FINISH at the top of
    `Verifier.finish`, before its exchange is awaited, so the ranks wait
    for their links together).
    """
    r = self.caps.max_requests
    out = np.full((r, 3), -1, np.int64)
    if self.leader:
      out[:len(rids), 0] = rids
      out[:len(rids), 1:] = np.asarray(tags, np.int64).reshape(-1, 2)
    head = np.array([kind, key, len(rids), depth], np.int64)
    head, out = ranks.broadcast((head, out), self.leader)
    n = int(head[2])
    return Announced(int(head[0]), int(head[1]), out[:n, 0].tolist(),
                     out[:n, 1:].tolist(), int(head[3]))

  def agree(self, rows: qformats.Rows, codes: np.ndarray,
            draws: np.ndarray | None,
            depth: int) -> tuple[np.ndarray, jax.Array]:
    """Steps 3-4: (codes int32[R, D] agreed by every rank, counts global
    int32[R, D, n w]). rows: this rank's Rows [R, D, w]; codes int32[R]:
    its own per-request verdict (0: its frame is in); draws uint32[R, D]
    (read on the leader only)."""
    r, w = self.caps.max_requests, self.caps.width
    assert rows.values is not None   # dense q only
    mine = np.zeros(r, np.int32)
    mine[:len(codes)] = codes
    n_ok = (rows.n[:, :depth] == w).all(axis=1)
    mine = np.where((mine == 0) & ~n_ok[:r], np.int32(Code.LENGTH_MISMATCH),
                    mine)
    tokens = np.zeros((r, depth), np.int32)
    u = np.zeros((r, depth), np.int64)
    audit = np.zeros(1, np.int32)
    if self.leader:
      tokens[:] = rows.tokens[:, :depth]
      if draws is not None:
        u[:len(draws)] = draws
        audit[0] = 1
    all_codes, all_tokens, all_u, all_audit = ranks.allgather(
        (mine, tokens, u, audit))
    tokens, u = all_tokens[0], all_u[0].astype(np.uint32)
    # Each rank's tokens must be the leader's (its frame's tokens are the
    # ones its block was drawn with).
    mine_tokens_ok = (rows.tokens[:, :depth] == tokens).all(axis=1)
    token_codes = ranks.allgather(np.where(mine_tokens_ok, 0, int(
        Code.SAMPLING_MISMATCH)).astype(np.int32))
    values = self.assemble(np.ascontiguousarray(rows.values[:, :depth]))
    counts, checked, audited = qcheck.check_dense(
        values, tokens, u, vocab=self.caps.vocab, executor=self.executor)
    status, drawn = np.asarray(checked), np.asarray(audited)
    row_codes = np.asarray(status_lib.codes(status.ravel())).reshape(
        status.shape)
    if all_audit[0, 0]:
      row_codes = np.where((row_codes == 0) & ~drawn,
                           np.int32(Code.SAMPLING_MISMATCH), row_codes)
    # A request refused on any rank: its first rank's code, in row 0.
    first = _first_nonzero(np.concatenate([all_codes, token_codes]))
    row_codes = row_codes.astype(np.int32)
    row_codes[:, 0] = np.where(first != 0, first, row_codes[:, 0])
    return row_codes, counts


def _first_nonzero(codes: np.ndarray) -> np.ndarray:
  """Per column: the first nonzero code over the rows (0 if none)."""
  nonzero = codes != 0
  at = np.argmax(nonzero, axis=0)
  return np.where(nonzero.any(axis=0), codes[at, np.arange(codes.shape[1])],
                  0).astype(np.int32)


class RankValidator(verifier.Validator):
  """The validator of every verifier rank of a TP-n verifier: q is held as
  the global counts [R, D, n w] split over "vocab", each rank its block.
  A follower rank's `Verifier` takes it for its warm-up (`follow_rounds`
  does the rounds' checks); the leader's is `RankRound`.

  executor: the vocabulary mesh's (`sharding.executor(mesh)`); assemble:
  this rank's block [R, D, w] -> the global array [R, D, n w] split over
  "vocab" (`sharding.from_blocks`). Dense q only.
  """

  # Two exchanges in flight: the leader announces each round's begin and
  # finish (`_Agreement.announce`), each agreed on its own.
  overlaps = True

  def __init__(self, caps: hello.Capabilities, *,
               executor: rowops.Executor, assemble: Assemble) -> None:
    super().__init__(caps)
    self.agreement = _Agreement(caps, executor, assemble)

  def example_q(self, depth: int) -> verification.DenseQ:
    """The format's example q as the rounds hold it: this rank's block of
    every request's rows, assembled. Compiles and runs the collective
    check once on the way: a collective, so every rank calls it in the
    same order (`Verifier.warmup`)."""
    caps, agreement = self.caps, self.agreement
    full = caps.format.example_q(depth, caps.vocab, caps.max_support)
    assert isinstance(full, verification.DenseQ)   # dense q only
    lo, hi = caps.link(jax.process_index()).shard_range
    r, w = caps.max_requests, caps.width
    blocks = np.zeros((r, depth, w), np.int32)
    blocks[..., :hi - lo] = np.asarray(full.counts)[:, lo:hi]
    q = verification.DenseQ(agreement.assemble(blocks))
    jax.block_until_ready(qcheck.check_dense(
        agreement.assemble(np.zeros((r, depth, w), np.float32)),
        np.zeros((r, depth), np.int32), np.zeros((r, depth), np.uint32),
        vocab=caps.vocab, executor=agreement.executor))
    return q


class RankRound(RankValidator, verifier.RoundHook):
  """The verifier leader's components of a TP-n verifier (rank 0), the
  agreement with the other ranks (module docstring); pass it to the
  `Verifier` as its validator, its plan sharer and its first round hook.

  executor, assemble: as `RankValidator`'s; broadcast: the plan's, without
  q (`ranks.PlanBroadcast(caps, counts=False)`). Dense q only.

  Every round the leader begins it must finish (`Verifier.finish`): a
  round given up with `Verifier.abandon` is never announced finished, and
  the follower ranks keep collecting it (its requests cannot begin again
  there); a run that gives up its rounds ends the ranks (`stop`).
  """

  def __init__(self, caps: hello.Capabilities, *,
               executor: rowops.Executor, assemble: Assemble,
               broadcast: ranks.PlanBroadcast) -> None:
    super().__init__(caps, executor=executor, assemble=assemble)
    self.broadcast = broadcast

  def begin_round(self, key: int, exchange: Exchange | None) -> None:
    """Step 1: the other ranks learn the round, by its number in the
    session (or that it has no exchange: they skip theirs), and begin
    collecting its blocks."""
    if exchange is None:
      self.agreement.announce(BEGIN, key)
      return
    self.agreement.announce(BEGIN, key, exchange.rids,
                            [exchange.tags[r] for r in exchange.rids],
                            exchange.depth)

  def finish_round(self, key: int, exchange: Exchange | None) -> None:
    """The other ranks learn which round the next agreement (or plan, for
    a round without an exchange) is of."""
    del exchange
    self.agreement.announce(FINISH, key)

  def warmup(self, rows: qformats.Rows, draws: np.ndarray | None) -> None:
    """Nothing to compile alone: the ranks compiled the collective check
    together (`example_q`, in `Verifier.warmup`)."""
    del rows, draws

  def validate(self, effect: Stage | Verify, draws: np.ndarray | None,
               exchange: Exchange) -> qformats.Verdict | None:
    """Steps 3-4, on every exchange (the other ranks take part even when
    this one failed): the Verdict of a Stage, its counts the checked
    global q (never broadcast); None for a Verify."""
    staged = isinstance(effect, Stage)
    codes = (effect.codes if isinstance(effect, Stage)
             else np.maximum(effect.plan.codes, 1).astype(np.int32))
    row_codes, counts = self.agreement.agree(
        _padded(exchange.rows, self.caps.max_requests), codes, draws,
        exchange.depth)
    if not staged:
      return None
    return qformats.Verdict(counts, row_codes[:len(exchange.rids)])

  def share(self, plan: Plan | None) -> Plan:
    return self.broadcast.share(plan)

  def stop(self) -> None:
    """The other ranks' loop (`follow_rounds`) ends."""
    self.agreement.announce(STOP)


def _padded(rows: qformats.Rows, r: int) -> qformats.Rows:
  """Rows [R', D, ...] padded with zero rows to [r, D, ...] (R' <= r)."""
  if rows.tokens.shape[0] == r:
    return rows

  def pad(a: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [a, np.zeros((r - a.shape[0],) + a.shape[1:], a.dtype)])

  return qformats.Rows(pad(rows.tokens), pad(rows.n),
                       None if rows.ids is None else pad(rows.ids),
                       None if rows.values is None else pad(rows.values))


def follow_rounds(follower: verifier.Verifier, receiver: ShardReceiver,
                  executor: rowops.Executor, assemble: Assemble) -> int:
  """Verifier rank s >= 1: the rounds the leader runs, until it stops.

  follower: this rank's `Verifier` (no transport; its sharer a
  `ranks.PlanBroadcast(caps, counts=False)`, `request_factory` set), used
  to verify and commit exactly what the leader does; receiver: its open
  `ShardReceiver`. Returns the number of rounds.

  The leader's announcements order everything: a BEGIN starts collecting
  the round's block on this rank's link (under the round's key, while
  another round may be in flight), its FINISH collects it (frames of the
  other round that come meanwhile are staged for it), agrees and commits
  the leader's plan. Raises RuntimeError on a FINISH of a round never
  begun (the ranks would no longer issue the same collectives).
  """
  agreement = _Agreement(follower.caps, executor, assemble)
  assert follower.sharer is not None   # a follower gets the leader's plans
  # Rounds begun, not finished: key -> depth (None: no exchange).
  begun: dict[int, int | None] = {}
  rounds = 0
  while True:
    said = agreement.announce()
    if said.kind == STOP:
      return rounds
    if said.kind == BEGIN:
      begun[said.key] = None
      if said.rids:
        receiver.begin(said.rids, said.tags, said.depth, key=said.key)
        begun[said.key] = said.depth
      continue
    if said.key not in begun:
      raise RuntimeError(f"follow_rounds: round {said.key} finishes, never "
                         "begun (the ranks are out of step)")
    depth = begun.pop(said.key)
    counts = None
    if depth is not None:
      rows, codes = receiver.finish(said.key)
      _, counts = agreement.agree(rows, codes, None, depth)
    plan = follower.sharer.share(None)
    if plan.key != said.key:
      raise RuntimeError(f"follow_rounds: the plan of round {plan.key} "
                         f"where round {said.key} finishes (the ranks are "
                         "out of step)")
    follower.apply(plan._replace(counts=counts))
    rounds += 1
