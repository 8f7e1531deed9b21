"""Rank-to-rank q shard links between a tensor-parallel worker and verifier.

A TP-n draft worker (n `jax.distributed` processes, rank s holding
vocabulary block s) and a TP-n verifier (n processes on a vocabulary
mesh). Dense q never crosses ranks:

* **The leader link** (worker rank 0 <-> verifier rank 0) is the ordinary
  session (HELLO, STEP, REPLY, COMPLETION, COMMIT, RESET), its
  capabilities those of block 0 (`Capabilities.link(0)`, `shards = n`):
  REPLY rows carry the drafted tokens and block 0's counts.
* **A shard link** (worker rank s <-> verifier rank s, s >= 1) carries
  block s. The verifier rank connects and sends a HELLO with the block's
  capabilities (`shard`, `shard_lo`, `shard_hi`); the worker rank answers
  as a worker does (`WorkerSession`: same key schedule, a mismatched block
  is IDENTITY_MISMATCH). Then only REPLY frames flow, worker to verifier,
  one per request and round, tagged with the leader's (generation, round)
  and MAC'd with the link's session keys (`ShardSender`, `ShardReceiver`).

The worker leader owns the RNG. For every proposal it broadcasts the STEP's
inputs to its other ranks (`RankWorker`: one small gloo broadcast); all
ranks run the proposer together over their mesh (`draft_proposer(...,
executor=)`): the draft weights' normalizer and the allocation's tickets are
all-reduces, and each token is one PROPOSAL draw mapped shard-then-token
(the shard by global count mass, then the token inside it), replicated on
every rank before the next Markov row. Each rank writes its own block; the
other ranks send theirs on their links (`follow_proposals`).

The verifier ranks agree before anything is used (`RankVerifier`, and
`follow_rounds` on the other ranks). Per round:

1. the leader broadcasts what it expects (request ids, tags, depth);
2. rank 0 runs the leader link's exchange, rank s collects its block's
   frames, both under the same deadline;
3. the ranks all-gather their per-request codes (a frame missing, late,
   forged or malformed on ANY rank) with the leader's tokens and PROPOSAL
   draws;
4. one collective check of the whole q, each rank reading only its block
   (`qcheck.check_dense`): entry classes, the exact global mass (an
   integer all-reduce: exactly M per row), the token's count, and the
   sampling audit, the draw mapped shard-then-token;
5. the leader's session turns the agreed codes into the Plan, broadcast
   without q (`ranks.plan_broadcast(counts=False)`): every rank verifies
   on the checked global counts it already holds, or falls back, for
   exactly the same requests.

A request refused on any rank is discarded on every rank, its code counted
by the leader; no rank waits past its deadline, and a dead worker rank is a
timeout. Sparse q keeps the leader's single link (k entries, the global
top-k): the worker's other ranks take part in the draws and send nothing.
"""

import collections
import queue
import threading
import time

import jax
import numpy as np

from dyadic_jax import qcheck
from dyadic_jax.bridge import ranks, transport
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Stage
from dyadic_jax.bridge.verifier import Verifier
from dyadic_jax.bridge.verifier_session import VerifierSession
from dyadic_jax.bridge.worker import Worker
from dyadic_jax.bridge.worker_session import WorkerSession
from dyadic_jax.wire import auth, codec, layouts, qformats
from dyadic_jax.wire import status as status_lib
from dyadic_jax.wire.errors import Code, ProtocolError

_U64 = (1 << 64) - 1
# The proposal broadcast: what the draw needs, the request, and a mode.
_WARM, _SEND, _STOP = 0, 1, 2


# -- the worker --------------------------------------------------------------


def _params(seed, generation, round_id, anchor, last_token, depth, request,
            mode):
  return np.array([np.uint64(seed).view(np.int64), generation, round_id,
                   anchor, last_token, depth, request, mode], np.int64)


class RankWorker(Worker):
  """The worker leader of a TP-n worker: before each proposal, the other
  ranks get its inputs (they draw with it and send their blocks)."""

  def draw(self, p):
    ranks.broadcast(_params(p.seed, p.generation, p.round, p.anchor,
                            p.last_token, p.depth, p.request, _SEND), True)
    super().draw(p)

  def warmup(self):
    ranks.broadcast(_params(_U64, 0, 0, 0, 0, self.caps.max_depth, 0,
                            _WARM), True)
    super().warmup()

  def stop_ranks(self):
    """Tells the other ranks there are no more proposals."""
    ranks.broadcast(_params(0, 0, 0, 0, 0, 0, 0, _STOP), True)


class ShardSender:
  """Worker rank s's end of its shard link: binds, answers the verifier
  rank's HELLO, sends REPLY frames of block s in the session the verifier
  rank confirmed. One thread owns the socket
  (it answers HELLOs while the rank is inside a collective)."""

  def __init__(self, caps, address, *, secret, curve=None, counters=None):
    self.caps = caps
    self.counters = counters or Counters(f"worker rank {caps.shard}")
    self.session = WorkerSession(caps, secret=secret, counters=self.counters)
    self.endpoint = transport.Endpoint.bind(
        address, max_message=self.session.max_message, curve=curve,
        counters=self.counters)
    self.address = self.endpoint.address
    self._outbox = queue.Queue()
    self._peer = None
    self._link = None                    # (session id, keys) of the peer
    self._lock = threading.Lock()
    self._halt = threading.Event()
    self._thread = threading.Thread(target=self._serve, daemon=True,
                                    name=f"shard-link-{caps.shard}")
    self._thread.start()

  def _serve(self):
    inflight = collections.deque()        # zero-copy sends not yet let go
    while not self._halt.is_set():
      while inflight and inflight[0][0].done:
        inflight.popleft()
      got = self.endpoint.recv(0.02)
      if got is not None:
        peer, message = got
        answer = self.session.receive(message)
        if answer.propose:
          # Only HELLOs come this way: a STEP here draws nothing.
          self.counters.reject(Code.BAD_SEQUENCE, "STEP on a shard link")
          continue
        for send in answer.send:
          self.endpoint.send(send.message, peer)
        # Frames go out in the session the verifier rank confirmed (its
        # first authenticated frame after the HELLO): a replayed HELLO
        # opens only a pending session, which can never take the link.
        est = self.session.established
        if est is not None and (self._link is None or
                                self._link[0] != est.id):
          with self._lock:
            self._peer, self._link = peer, (est.id, est.keys)
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
  def link_session(self):
    """The session id frames go out under (None before the verifier rank
    confirmed one)."""
    with self._lock:
      return None if self._link is None else self._link[0]

  def frame(self, request, tag, depth):
    """(frame, rows) of a REPLY to fill, or None before a session."""
    with self._lock:
      link = self._link
    if link is None:
      return None
    buf = bytearray(self.caps.bounds.reply_bytes(depth))
    frame, rows = codec.begin_reply(
        buf, bounds=self.caps.bounds, session=link[0], generation=tag[0],
        round_id=tag[1], request=request, depth=depth)
    return (frame, link[1]), rows

  def send(self, frame):
    """Seals a filled frame and queues it for the verifier rank."""
    frame, keys = frame
    auth.seal(frame, keys.send)
    self._outbox.put(frame)

  def close(self):
    self._halt.set()
    self._thread.join(5)
    self.endpoint.close()


def follow_proposals(propose, sender=None):
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
    frame = rows = None
    if mode == _SEND and sender is not None:
      made = sender.frame(request, (generation, round_id), depth)
      if made is not None:
        frame, rows = made
    try:
      propose(seed, generation, round_id, anchor, last, depth, out=rows)
    except Exception:  # pylint: disable=broad-except
      continue           # the leader's own draw fails alike: it answers
    if frame is not None:
      sender.send(frame)
      sent += 1


# -- the verifier ------------------------------------------------------------


class ShardReceiver:
  """Verifier rank s's end of its shard link: HELLO, then the block's
  REPLY frames of each round, checked (MAC, session, tags, bounds) before
  they are staged."""

  def __init__(self, caps, address, *, secret, timeout_s=2.0, curve=None,
               counters=None, clock=time.monotonic, deadline=None):
    """timeout_s: the deadline of a HELLO and, without `deadline` (an
    `AdaptiveDeadline`: from the measured round time), of every round."""
    self.caps = caps
    self.counters = counters or Counters(f"verifier rank {caps.shard}")
    self.session = VerifierSession(caps, secret=secret, timeout_s=timeout_s,
                                   counters=self.counters)
    self.timeout_s = timeout_s
    self.deadline = deadline
    self.clock = clock
    self.address = address
    self.curve = curve
    self.endpoint = None
    self.rows = caps.format.staging(caps.max_requests, caps.max_depth,
                                    caps.width)
    self.seconds = []        # per round: from its start to its last frame
    self.request_rounds = 0
    self._silent = False     # the last round got nothing: say HELLO again

  def open(self, attempts=50):
    """Negotiates the link (HELLO both ways); ProtocolError if it cannot."""
    self.endpoint = transport.Endpoint.connect(
        self.address, max_message=self.caps.bounds.max_reply_message,
        curve=self.curve, counters=self.counters)
    for _ in range(attempts):
      self.endpoint.send(self.session.hello(self.clock()).message)
      deadline = self.clock() + self.timeout_s
      while (left := deadline - self.clock()) > 0 and not (
          self.session.is_open):
        got = self.endpoint.recv(left)
        if got is not None:
          self.session.receive(got[1], self.clock())
        if self.session.refused is not None:
          raise ProtocolError(self.session.refused, "shard link refused")
      if self.session.is_open:
        self._confirm()
        if self.deadline is not None:
          self.deadline.new_session()
        return self
    raise ProtocolError(Code.TIMEOUT, f"no worker rank at {self.address}")

  def collect(self, rids, tags, depth):
    """Block s's rows of one round: (Rows [R, D, w], codes int32[R]).

    Waits until every request's frame is in or the deadline passes; a
    request without a good frame gets its code (TIMEOUT when none came).
    """
    r = len(rids)
    codes = np.full(r, int(Code.TIMEOUT), np.int32)
    index = {int(rid): i for i, rid in enumerate(rids)}
    start = self.clock()
    deadline = start + (self.timeout_s if self.deadline is None
                        else self.deadline.seconds())
    if self._silent:
      # A round without a single frame: the worker rank may be a new
      # process (restarted) that knows no session. A fresh HELLO costs one
      # small message; until it is answered, frames are refused.
      self.session.reconnect()
      self.endpoint.send(self.session.hello(start).message)
    while (codes == Code.TIMEOUT).any() and (
        left := deadline - self.clock()) > 0:
      got = self.endpoint.recv(left)
      if got is None:
        continue
      if not self.session.is_open:
        self.session.receive(got[1], self.clock())    # the HELLO answer
        if self.session.is_open:
          self._confirm()
          if self.deadline is not None:
            self.deadline.new_session()      # from the next round on
        continue
      keys = self.session.keys
      self.counters.event("bytes_in", len(got[1]))
      for frame in self._frames(got[1]):
        try:
          h = codec.header(frame)
          if h.session != self.session.session:
            raise ProtocolError(Code.UNKNOWN_SESSION, f"session {h.session}")
          f = codec.decode(frame, self.caps.bounds, keys.recv)
          if f.kind != layouts.Kind.REPLY:
            raise ProtocolError(Code.BAD_SEQUENCE, f"{f.kind.name} on a "
                                "shard link")
        except ProtocolError as e:
          self.counters.reject(e.code, f"shard {self.caps.shard} frame")
          continue
        i = index.get(f.body.request)
        if i is None or f.tag != tuple(tags[i]) or f.body.depth != depth:
          self.counters.reject(Code.DUPLICATE_ROUND if i is not None and (
              f.tag[0] == tags[i][0]) else Code.STALE_GENERATION,
                               f"shard {self.caps.shard} request "
                               f"{f.body.request} {f.tag}")
          continue
        for name in ("tokens", "n", "values"):
          np.copyto(getattr(self.rows, name)[i, :depth],
                    getattr(f.rows, name))
        codes[i] = 0
    self._silent = bool((codes == Code.TIMEOUT).all())
    self.seconds.append(self.clock() - start)
    if self.deadline is not None and not (codes == Code.TIMEOUT).any():
      self.deadline.observe(self.seconds[-1])      # every frame in
    self.request_rounds += r
    for i in np.flatnonzero(codes):
      self.counters.reject(int(codes[i]), f"shard {self.caps.shard} request "
                           f"{rids[i]}")
    return self.rows, codes

  def _confirm(self):
    """The session's first authenticated frame to the worker rank (a
    RESET of no request): it makes the session the link's."""
    self.endpoint.send(codec.encode(
        layouts.Kind.RESET, session=self.session.session, generation=0,
        round_id=0, send=self.session.keys.send,
        body={"request": layouts.ALL_REQUESTS,
              "reason": layouts.Reason.CANCEL}))

  def figures(self):
    """What the link carried: bytes and seconds per round."""
    return {"bytes_in": self.counters.events("bytes_in"),
            "request_rounds": self.request_rounds,
            "round_seconds": list(self.seconds)}

  def _frames(self, message):
    try:
      return codec.split(message, max_frames=self.caps.max_requests,
                         max_bytes=self.caps.bounds.max_reply_message)
    except ProtocolError as e:
      self.counters.reject(e.code, f"shard {self.caps.shard} message")
      return []

  def close(self):
    if self.endpoint is not None:
      self.endpoint.close()
      self.endpoint = None


class _Agreement:
  """Steps 1, 3 and 4 of a round (the module docstring), the same calls on
  every verifier rank in the same order."""

  def __init__(self, caps, executor, assemble):
    self.caps = caps
    self.executor = executor
    self.assemble = assemble   # local block [R, D, w] -> global [R, D, n w]
    self.leader = jax.process_index() == 0

  def expect(self, rids=(), tags=(), depth=0, stop=False):
    """Step 1: (rids, tags, depth) of the round, or None: stop."""
    r = self.caps.max_requests
    out = np.full((r, 3), -1, np.int64)
    if self.leader:
      out[:len(rids), 0] = rids
      out[:len(rids), 1:] = np.asarray(tags, np.int64).reshape(-1, 2)
    head = np.array([len(rids), depth, int(stop)], np.int64)
    head, out = ranks.broadcast((head, out), self.leader)
    if head[2]:
      return None
    n = int(head[0])
    return out[:n, 0].tolist(), out[:n, 1:].tolist(), int(head[1])

  def agree(self, rows, codes, draws, depth):
    """Steps 3-4: (codes int32[R, D] agreed by every rank, counts global
    int32[R, D, n w]). rows: this rank's Rows [R, D, w]; codes int32[R]:
    its own per-request verdict (0: its frame is in); draws uint32[R, D]
    (read on the leader only)."""
    r, w = self.caps.max_requests, self.caps.width
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
    counts, status, drawn = qcheck.check_dense(
        values, tokens, u, vocab=self.caps.vocab, executor=self.executor)
    status, drawn = np.asarray(status), np.asarray(drawn)
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


def _first_nonzero(codes):
  """Per column: the first nonzero code over the rows (0 if none)."""
  nonzero = codes != 0
  at = np.argmax(nonzero, axis=0)
  return np.where(nonzero.any(axis=0), codes[at, np.arange(codes.shape[1])],
                  0).astype(np.int32)


class RankVerifier(Verifier):
  """The verifier leader of a TP-n verifier (rank 0): the leader link's
  session, and the agreement with the other ranks (module docstring).

  executor: the vocabulary mesh's (`sharding.executor(mesh)`); assemble:
  this rank's block [R, D, w] -> the global array [R, D, n w] split over
  "vocab" (`sharding.from_blocks`); share_fn: `ranks.plan_broadcast(caps,
  counts=False)`. Dense q only.
  """

  def __init__(self, caps, address, *, executor, assemble, **kwargs):
    super().__init__(caps, address, **kwargs)
    self.agreement = _Agreement(caps, executor, assemble)
    self._counts = None   # the round's checked q: global, never broadcast
    self._ex = None       # the round's exchange (None: it had none)
    share = self.share_fn
    self.share_fn = lambda plan: share(plan)._replace(counts=self._counts)

  def warmup(self):
    """The validation is the agreement's collective check: nothing to
    compile alone (the ranks compile it together in their first round)."""
    self._warm = True

  def on_begin(self, exchange):
    self._ex = exchange
    self.agreement.expect(exchange.rids, [exchange.tags[r]
                                          for r in exchange.rids],
                          exchange.depth)

  def _exchange(self, rids, depth):
    effect, draws = self._answer(rids, depth)
    ex, session = self._ex, self.session
    codes = (effect.codes if isinstance(effect, Stage) else np.maximum(
        effect.plan.codes, 1).astype(np.int32))
    row_codes, self._counts = self.agreement.agree(
        _padded(ex.rows, self.caps.max_requests), codes, draws, depth)
    if isinstance(effect, Stage):
      # The checked counts stay global, with the agreement: the plan is
      # broadcast without them.
      return session.staged(qformats.Verdict(None, row_codes[:len(ex.rids)]))
    return effect

  def execute(self, plan):
    if self._ex is None:
      # A round without an exchange (no session): step 1 tells the other
      # ranks to skip theirs.
      self.agreement.expect()
      self._counts = None
    self._ex = None
    return super().execute(plan)

  def stop_followers(self):
    self.agreement.expect(stop=True)


def _padded(rows, r):
  """Rows [R', D, ...] padded with zero rows to [r, D, ...] (R' <= r)."""
  if rows.tokens.shape[0] == r:
    return rows
  return type(rows)(*[None if a is None else np.concatenate(
      [a, np.zeros((r - a.shape[0],) + a.shape[1:], a.dtype)])
                      for a in rows])


def follow_rounds(verifier, receiver, executor, assemble):
  """Verifier rank s >= 1: the rounds the leader runs, until it stops.

  verifier: this rank's `Verifier` (no transport; its `share_fn` the plan
  broadcast, `request_factory` set), used to verify and commit exactly
  what the leader does; receiver: its open `ShardReceiver`. Returns the
  number of rounds.
  """
  agreement = _Agreement(verifier.caps, executor, assemble)
  rounds = 0
  while True:
    expected = agreement.expect()
    if expected is None:
      return rounds
    rids, tags, depth = expected
    counts = None
    if rids:
      rows, codes = receiver.collect(rids, tags, depth)
      _, counts = agreement.agree(rows, codes, None, depth)
    plan = verifier.share_fn(None)
    plan = plan._replace(counts=counts)
    verifier.session.commit(plan, verifier._run(plan))  # pylint: disable=protected-access
    rounds += 1
