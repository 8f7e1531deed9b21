"""Nothing a peer sends can crash, stall or exhaust either side (issue 10).

Every test drives the REAL transport (ZeroMQ sockets) against the real
drivers; the peer is a test client built from the same sans-I/O sessions,
so its messages are well formed and authenticated unless a test says
otherwise, and each defect is exactly the one named:

* every numeric field of every message kind at 0, 2^31, 2^32-1, 2^63 and
  2^64-1 (clipped to the field's width), both directions: a valid message
  or a counted refusal, and the process keeps serving;
* HELLO bounds against local limits before any work (vocab 2^31 costs no
  allocation), unknown reason / status codes counted (RESET reason 0);
* a peer that never reads costs its slots, never a hang; a peer that
  never answers costs one deadline;
* oversize messages refused before they are read (RSS of a real worker
  process under a 500 MB message), frames-per-message caps;
* memory bounded by the live requests (removal, bounded views);
* authentication: a peer without the key gets nothing accepted (a HELLO
  storm, replayed HELLOs and STEPs, oversize messages, a fake worker on
  the port), with one round in flight and with two;
* CONTEXT frames (a worker with `wants_context`): every refusal class
  counted under its code with no state change, every field at every
  extreme, the socket bound the frames need.
"""

import os
import threading
import time
import tracemalloc

import numpy as np
import pytest
import zmq

from dyadic_jax import bridge
from dyadic_jax.bridge import transport, worker_session
from dyadic_jax.bridge import verifier as verifier_lib
from dyadic_jax.wire import auth, codec, layouts
from dyadic_jax.wire.layouts import (FIXED_BYTES, Feature, Kind, Reason,
                                     Representation)
from dyadic_jax.wire.refusals import Code, ProtocolError
from tests import bridge_harness as h

SPARSE = h.caps()
CONTEXT = h.caps(features=Feature.CONTEXT, max_context=8)
EXTREMES = (0, 2 ** 31, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1)


def _clip(value, dtype):
  info = np.iinfo(dtype)
  return int(min(max(value, info.min), info.max)) if value > info.max else (
      int(value))


def _edits(kind):
  """(field, value) pairs: every integer field at every extreme."""
  dtype = layouts.BODIES[kind]
  out = []
  for name in dtype.names:
    sub = dtype.fields[name][0]
    if sub.kind not in "ui":
      continue
    for value in sorted({_clip(v, sub) for v in EXTREMES}):
      if sub.kind == "i" and value > np.iinfo(sub).max:
        continue
      out.append((name, value))
    if sub.kind == "i":
      out.append((name, -1))
  return out


class Client:
  """A verifier-side test peer: a VerifierSession on a real DEALER."""

  def __init__(self, address, c=SPARSE, secret=h.SECRET):
    self.session = bridge.VerifierSession(c, secret=secret,
                                          timeout_s=h.GENEROUS_S)
    self.endpoint = bridge.Endpoint.connect(address, max_message=1 << 24)
    self.caps = c

  def send(self, message):
    sent, _ = self.endpoint.send(message)
    assert sent

  def recv(self, timeout_s=h.GENEROUS_S):
    got = self.endpoint.recv(timeout_s)
    return None if got is None else bytes(got[1])

  def open(self):
    self.send(self.session.hello().message)
    answer = self.recv()
    assert answer is not None, "no HELLO answer"
    self.session.receive(answer)
    assert self.session.is_open

  def close(self):
    self.endpoint.close()


@pytest.fixture
def served():
  """A real worker (thread) behind a ROUTER; yields it, checks it lives."""
  loop = h.serve(h.Tampering(SPARSE, h.proposer_for(SPARSE)))
  yield loop.worker
  assert loop.thread.is_alive(), "the worker loop died"
  loop.close()


def _reseal_field(message, kind, field, value, tagger):
  frames = h.frames(message)
  frames[0] = h.set_field(frames[0], kind, field, value, tagger)
  return h.join(frames)


def _clean_round(client):
  s = client.session
  send, _ = s.begin(sorted(s.requests), h.DEPTH, time.monotonic())
  client.send(send.message)
  return _finish_round(client)


def _finish_round(client):
  """Reads the exchange in flight to its outcome and commits it."""
  s = client.session
  while s.exchange is not None:
    got = client.recv()
    effects = (s.receive(got, time.monotonic()) if got is not None
               else s.poll(time.monotonic() + 10 * h.GENEROUS_S))
    for e in effects:
      if isinstance(e, bridge.Stage):
        e = s.staged(client.caps.format.validate(e.rows,
                                                 vocab=client.caps.vocab))
      results, commit = s.commit(e.plan, [(0, 1)] * len(e.plan.rids))
      if commit is not None:
        client.send(commit.message)
      return results
  raise AssertionError("no outcome")


@pytest.mark.parametrize("kind", [Kind.STEP, Kind.COMMIT, Kind.RESET,
                                  Kind.HELLO], ids=lambda k: k.name)
def test_worker_survives_every_field_extreme(served, kind):
  client = Client(served.address)
  try:
    client.open()
    client.session.add_request(0, [1], seed=3)
    s = client.session
    outcomes = {"answered": 0, "refused": 0, "accepted": 0}
    for field, value in _edits(kind):
      before = served.counters.total_errors()
      if kind == Kind.STEP:
        message = s.begin([0], h.DEPTH, time.monotonic())[0].message
        s.abandon()       # the client does not wait for this round
        tagger = s.keys.send
      elif kind == Kind.COMMIT:
        # Each edit on a request of its own (ids 100 and up), so that the
        # values reach past the sequencing checks.
        other_rid = 100 + outcomes["answered"] + outcomes["refused"] + (
            outcomes["accepted"])
        message = codec.encode(Kind.COMMIT, session=s.session, generation=0,
                               round_id=1, send=s.keys.send,
                               body={"request": other_rid, "next_token": 1})
        tagger = s.keys.send
      elif kind == Kind.RESET:
        message = codec.encode(Kind.RESET, session=s.session, generation=0,
                               round_id=0, send=s.keys.send,
                               body={"request": 0, "reason": Reason.CANCEL})
        tagger = s.keys.send
      else:
        other = bridge.VerifierSession(SPARSE, secret=h.SECRET)
        message = other.hello().message
        tagger = auth.hello_keys(h.SECRET, auth.VERIFIER).send
      client.send(_reseal_field(message, kind, field, value, tagger))
      answer = client.recv(0.3 if kind in (Kind.STEP, Kind.HELLO) else 0.05)
      refused = served.counters.total_errors() > before
      if answer is not None:
        outcomes["answered"] += 1
      outcomes["refused" if refused else "accepted"] += 1
      # Valid or counted: an accepted STEP is answered.
      if kind == Kind.STEP and not refused:
        assert answer is not None, (field, value)
    assert outcomes["refused"] > 0 and outcomes["accepted"] > 0, outcomes
    # Still serving: a new session gets verified rounds.
    client.close()
    client = Client(served.address)
    client.open()
    client.session.add_request(0, [1], seed=3)
    results = _clean_round(client)
    assert results and not results[0].fallback, results
  finally:
    client.close()


def test_anchor_2_63_is_refused_not_fatal(served):
  # The crash: np.int64(anchor) raised OverflowError in the
  # proposer and the worker exited. Now: a COMPLETION with the refusal.
  client = Client(served.address)
  try:
    client.open()
    client.session.add_request(0, [1], seed=3)
    for anchor in (2 ** 63, 2 ** 64 - 1, bridge.hello.MAX_POSITION):
      s = client.session
      message = s.begin([0], h.DEPTH, time.monotonic())[0].message
      s.abandon()
      client.send(_reseal_field(message, Kind.STEP, "anchor", anchor,
                                s.keys.send))
      frames = h.frames(client.recv())
      done = codec.decode(frames[-1], SPARSE.bounds)
      assert done.kind == Kind.COMPLETION
      assert done.body.status == Code.ABSURD_LENGTH
    assert served.counters.errors(Code.ABSURD_LENGTH) == 3
    assert not _clean_round(client)[0].fallback
  finally:
    client.close()


class FakeWorker:
  """A worker-side test peer: a WorkerSession on a real ROUTER (thread).

  edit(messages, tagger) -> messages rewrites each answer before it is
  sent (None: send nothing); HELLO answers included when edit_hello.
  """

  def __init__(self, c=SPARSE, secret=h.SECRET, edit=None, edit_hello=False,
               forge=False):
    """forge: an impostor that answers whatever it gets: it reseals every
    incoming frame with its own keys before its session reads it."""
    self.caps = c
    self.forge = forge
    self.secret = secret
    self.worker = h.Tampering(c, h.proposer_for(c), secret=secret)
    self.worker.warmup()     # no compile inside a verifier's deadline
    self.edit = edit
    self.edit_hello = edit_hello
    self.endpoint = bridge.Endpoint.bind("tcp://127.0.0.1:0",
                                         max_message=1 << 20)
    self.address = self.endpoint.address
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._serve, daemon=True)
    self.thread.start()

  def _serve(self):
    while not self.stop.is_set():
      got = self.endpoint.recv(0.02)
      if got is None:
        continue
      peer, message = got
      is_hello = codec.peek(message)[0] == Kind.HELLO
      if self.forge:
        session = self.worker.session
        if is_hello:
          tagger = auth.hello_keys(self.secret, auth.VERIFIER).send
        else:
          keys = session.established or session.pending
          tagger = None if keys is None else auth.session_keys(
              self.secret, keys.id, keys.nonce_v, b"", auth.VERIFIER).send
        if tagger is not None and is_hello:
          message = h.reseal(bytes(message), tagger)
      out = [bytes(s.message) for s in self.worker.handle(message)]
      for s in range(len(self.worker.session.slots or ())):
        self.worker.session.released(s)
      session = self.worker.session
      keys = (session.pending or session.established)
      if self.edit is not None and (self.edit_hello or not is_hello) and out:
        out = self.edit(out, keys.keys.send if keys else None) or []
      for m in out:
        self.endpoint.send(m, peer)

  def close(self):
    self.stop.set()
    self.thread.join()
    self.endpoint.close()


def _verifier(address, c=SPARSE, secret=h.SECRET, timeout_s=h.GENEROUS_S,
              warp_on=None):
  """A WarpVerifier with a generous deadline. warp_on: codes whose refusal
  times the exchange out at once (`h.WarpOnReject`); "any": every code
  (the peer sends nothing else after a refused message)."""
  clock = h.WarpClock()
  codes = list(Code) if warp_on == "any" else (warp_on or ())
  return h.WarpVerifier(c, address, target_fn=h.target_fn_for(h.toy(
      c.vocab)), secret=secret, timeout_s=timeout_s, clock=clock,
                        counters=h.WarpOnReject("verifier", clock, codes))


@pytest.mark.parametrize("kind", [Kind.REPLY, Kind.COMPLETION],
                         ids=lambda k: k.name)
def test_verifier_survives_every_field_extreme(kind):
  case = {}

  def edit(messages, tagger):
    if "field" not in case:
      return messages
    frames = h.frames(messages[-1])
    i = 0 if kind == Kind.REPLY else h.completion_of(frames, 0)
    frames[i] = h.set_field(frames[i], kind, case["field"], case["value"],
                            tagger)
    return [h.join(frames)]

  fake = FakeWorker(edit=edit)
  verifier = _verifier(fake.address, warp_on="any")
  try:
    verifier.open()
    verifier.add_request(0, [1], seed=3)
    verifier.add_request(1, [2], seed=4)
    seen = {"verified": 0, "refused": 0}
    for field, value in _edits(kind):
      case.update(field=field, value=value)
      before = verifier.counters.total_errors()
      results = verifier.round([0, 1])
      refused = verifier.counters.total_errors() > before
      assert [r.rid for r in results] == [0, 1]
      if refused:
        assert results[0].fallback, (field, value)
      else:
        assert not any(r.fallback for r in results), (field, value, results)
      seen["refused" if refused else "verified"] += 1
    assert seen["refused"] > 0 and seen["verified"] > 0, seen
    case.clear()
    assert not any(r.fallback for r in verifier.round([0, 1]))
  finally:
    verifier.close()
    fake.close()


@pytest.mark.parametrize("field,value", [
    ("vocab", 2 ** 31), ("vocab", 2 ** 26), ("vocab", 2 ** 32 - 1),
    ("max_support", 2 ** 32 - 1), ("max_depth", 0), ("max_slots", 2 ** 16 - 1),
    ("max_requests", 2 ** 16 - 1), ("max_reply_bytes", 2 ** 64 - 1),
    ("mode", 0), ("representation", 2 ** 16 - 1)])
def test_hello_bounds_checked_before_any_work(served, field, value):
  """An authenticated HELLO with a huge bound: refused with no allocation
  proportional to it (2^26 cost 671 MB and 0.8 s before; 2^31 raised
  MemoryError). Checked on the worker (through its socket) and on a
  verifier receiving such an answer."""
  tagger = auth.hello_keys(h.SECRET, auth.VERIFIER).send
  other = bridge.VerifierSession(SPARSE, secret=h.SECRET)
  message = _reseal_field(other.hello().message, Kind.HELLO, field, value,
                          tagger)
  client = Client(served.address)
  tracemalloc.start()
  try:
    client.send(message)
    answer = client.recv()
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
    client.close()
  assert peak < 4 << 20, peak       # no buffer of a peer's size
  reset = codec.decode(answer, codec.HELLO_BOUNDS)
  assert reset.kind == Kind.RESET and reset.body.code == (
      Code.IDENTITY_MISMATCH)
  assert served.counters.errors(Code.IDENTITY_MISMATCH) == 1


def test_verifier_refuses_a_huge_hello_answer_before_any_work():
  def edit(messages, tagger):
    return [h.set_field(messages[0], Kind.HELLO, "vocab", 2 ** 31, tagger)]
  fake = FakeWorker(edit=edit, edit_hello=True)
  verifier = _verifier(fake.address)
  tracemalloc.start()
  try:
    with pytest.raises(ProtocolError) as e:
      verifier.open(attempts=1)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
    verifier.close()
    fake.close()
  assert e.value.code == Code.IDENTITY_MISMATCH
  assert verifier.session.slots is None and peak < 4 << 20


@pytest.mark.parametrize("reason,code", [(0, 0), (Reason.REFUSED, 0),
                                         (Reason.REFUSED, 9999), (9999, 0),
                                         (2 ** 16 - 1, 2 ** 16 - 1)])
def test_unknown_reset_reason_or_code_is_counted(reason, code):
  """One RESET with reason 0 crashed the verifier (Counters.reject raised
  on an unknown Code). Now: counted (BAD_STATUS), the round falls back."""

  steps = []

  def edit(messages, tagger):
    del tagger
    step = codec.peek(messages[-1])
    # An authentic refusal of the STEP (keyed by its tag).
    keys = auth.refusal_keys(h.SECRET, auth.tag_of(steps[-1]), auth.WORKER)
    return [codec.encode(Kind.RESET, session=step[1], generation=step[2],
                         round_id=step[3], send=keys.send,
                         body={"request": layouts.ALL_REQUESTS,
                               "reason": reason, "code": code})]
  fake = FakeWorker(edit=edit)
  handle = fake.worker.handle
  fake.worker.handle = lambda message: (steps.append(bytes(message)),
                                        handle(message))[1]
  verifier = _verifier(fake.address, warp_on=[Code.BAD_STATUS])
  try:
    verifier.open()
    verifier.add_request(0, [1], seed=3)
    results = verifier.round([0])
    assert results[0].fallback
    assert verifier.counters.errors(Code.BAD_STATUS) == 1
    assert verifier.counters.errors(Code.TIMEOUT) == 1   # then the deadline
  finally:
    verifier.close()
    fake.close()


def test_worker_counts_a_reset_with_reason_0(served):
  client = Client(served.address)
  try:
    client.open()
    s = client.session
    client.send(codec.encode(Kind.RESET, session=s.session, generation=1,
                             round_id=0, send=s.keys.send,
                             body={"request": 0, "reason": 0}))
    client.send(codec.encode(Kind.COMMIT, session=s.session, generation=1,
                             round_id=1, send=s.keys.send,
                             body={"request": 0, "status": 9999}))
    deadline = time.monotonic() + h.GENEROUS_S
    while served.counters.errors(Code.BAD_STATUS) < 2:
      assert time.monotonic() < deadline, served.counters.snapshot()
      time.sleep(0.01)
  finally:
    client.close()


def test_a_peer_that_never_reads_cannot_hang_the_worker():
  """A dense worker: a peer sends HELLO and a burst of STEPs, never reads
  (the old worker blocked for good in tracker.wait()). The worker drops
  what the peer's queue cannot take, reclaims its slots, and serves the
  next verifier at once."""
  c = h.caps(Representation.DENSE, vocab=1 << 16, max_requests=2)
  loop = h.serve(h.Tampering(c, h.proposer_for(c)))
  worker = loop.worker
  sink = Client(loop.address, c)
  sink.endpoint.socket.setsockopt(zmq.RCVHWM, 1)
  sink.endpoint.socket.setsockopt(zmq.RCVBUF, 4096)
  try:
    sink.open()
    for rid in range(2):
      sink.session.add_request(rid, [1], seed=rid)
    sink.endpoint.socket.setsockopt(zmq.SNDTIMEO, 10_000)
    for _ in range(40):           # 40 x 1.6 MB answers nobody reads
      send, _ = sink.session.begin([0, 1], h.DEPTH, 0.0)
      sink.endpoint.socket.send(send.message)
      sink.session.abandon()
    deadline = time.monotonic() + h.GENEROUS_S
    while worker.counters.events("proposals") < 80:
      assert time.monotonic() < deadline, worker.counters.snapshot()
      time.sleep(0.05)
    verifier = _verifier(loop.address, c)
    try:
      verifier.open()
      verifier.add_request(0, [1], seed=3)
      results = verifier.round([0])
      assert not results[0].fallback, results
    finally:
      verifier.close()
    events = worker.counters.snapshot()["events"]
    assert events.get("send_dropped", 0) + events.get(
        "slots_reclaimed", 0) > 0, events
    assert loop.thread.is_alive()
  finally:
    sink.close()
    loop.close()          # joins the loop: it must not be stuck


def test_a_worker_that_never_reads_costs_the_verifier_deadlines_only():
  # A ROUTER that accepts the connection and reads nothing: every round
  # ends by its deadline (sends never block), target-only. The deadline is
  # short and real: nothing can answer in time, however fast the machine.
  router = zmq.Context.instance().socket(zmq.ROUTER)
  router.setsockopt(zmq.LINGER, 0)
  port = router.bind_to_random_port("tcp://127.0.0.1")
  verifier = bridge.Verifier(SPARSE, f"tcp://127.0.0.1:{port}",
                             target_fn=h.target_fn_for(h.toy()),
                             secret=h.SECRET, timeout_s=0.1)
  try:
    verifier.add_request(0, [1], seed=3)
    for _ in range(5):
      results = verifier.round([0])
      assert results[0].fallback and results[0].code == Code.TIMEOUT
    # 5 rounds, a HELLO attempt in rounds 1, 2 and 4 (the backoff skips
    # 3 and 5): one deadline each, nothing more.
    assert verifier.counters.errors(Code.TIMEOUT) == 3, (
        verifier.counters.snapshot())
    assert verifier.counters.events("backoff_rounds") == 2
  finally:
    verifier.close()
    router.close(linger=0)


class _Flood:
  """The verifier's receive, flooded: while `message` is set, every
  receive returns it at once (a socket that never comes back empty) and
  the verifier's WarpClock moves `tick_s` per message; `reads` counts
  them. Otherwise the real receive, whose last message is kept in `last`
  (bytes: what an on-path peer records, to replay)."""

  GIVE_UP = 10_000           # a round that reads this many never ends

  def __init__(self, verifier, tick_s):
    self.clock = verifier.clock
    self.clock.step_s = tick_s
    self.tick_s = tick_s
    self.message = None
    self.last = None
    self.reads = 0
    self.install(verifier)

  def install(self, verifier):
    """Floods the verifier's endpoint (again, after a new one)."""
    self.real = verifier.endpoint.recv
    verifier.endpoint.recv = self

  def __call__(self, timeout_s):
    if self.message is None:
      got = self.real(timeout_s)
      if got is not None:
        self.last = bytes(got[1])
      return got
    self.reads += 1
    assert self.reads < self.GIVE_UP, (
        f"a round read {self.reads} flooded messages and goes on")
    if self.tick_s:
      self.clock.warp()
    return None, memoryview(self.message)


@pytest.mark.parametrize("stream", ["junk", "old_session", "stale"])
@pytest.mark.parametrize("tick", ["deadline", "read_bound"])
def test_a_stream_of_messages_cannot_hold_a_round_past_its_deadline(
    stream, tick):
  """Issue 50.2: the verifier checked a round's deadline only when a
  receive came back empty, so a peer that kept messages coming (junk, or
  stale answers replayed: of an earlier session, or of this one) held a
  round 2.6-3 s past a 0.5 s deadline. Now the deadline is checked after
  every message (the clock moves a tenth of the deadline per message:
  the round ends after 10), and a round reads at most MAX_READS messages
  (a clock that does not move: it ends after MAX_READS). Either way it
  falls back (TIMEOUT), each message is counted, and the next round is
  verified. (This session's own stale answers reach the session's
  deadline check already; junk and an old session's answers did not.)"""
  with h.running(SPARSE, requests=1) as (_, verifier):
    flood = _Flood(verifier, h.GENEROUS_S / 10 if tick == "deadline" else 0)
    assert not verifier.round([0])[0].fallback
    recorded = flood.last                 # round 1's answer
    assert recorded is not None
    if stream == "old_session":
      verifier.reconnect()                # a new session, a new socket
      flood.install(verifier)
      assert not verifier.round([0])[0].fallback
    flood.message = (np.random.default_rng(5).bytes(200) if stream == "junk"
                     else recorded)
    errors = verifier.counters.total_errors()
    results = verifier.round([0])
    assert results[0].fallback and results[0].code == Code.TIMEOUT
    bound = 10 if tick == "deadline" else verifier_lib.MAX_READS
    assert flood.reads <= bound, flood.reads
    assert flood.reads >= (bound if tick == "read_bound" else 1)
    assert verifier.counters.events("read_bound") == (tick == "read_bound")
    # Every flooded message refused and counted, and the TIMEOUT.
    assert verifier.counters.total_errors() - errors == flood.reads + 1, (
        verifier.counters.snapshot())
    flood.message = None
    assert not verifier.round([0])[0].fallback


def test_socket_bounds_follow_the_negotiated_caps():
  c = h.caps(Representation.DENSE)
  with h.running(c) as (worker, verifier):
    assert verifier.endpoint.socket.getsockopt(zmq.MAXMSGSIZE) == max(
        transport.HELLO_MESSAGE, c.bounds.max_reply_message)
    probe = bridge.Verifier(c, worker.address, target_fn=None,
                            secret=h.SECRET)
    probe._endpoint(transport.HELLO_MESSAGE)  # pylint: disable=protected-access
    assert probe.endpoint.socket.getsockopt(zmq.MAXMSGSIZE) == (
        transport.HELLO_MESSAGE)
    probe.close()
    # The worker's bound: one HELLO or one fixed frame per request.
    assert worker.max_message == max(
        FIXED_BYTES[Kind.HELLO], c.max_requests * FIXED_BYTES[Kind.STEP])


def test_too_many_frames_are_refused_before_any_is_decoded(monkeypatch):
  session = bridge.WorkerSession(SPARSE, secret=h.SECRET)
  frame = codec.encode(Kind.COMMIT, session=1, generation=0, round_id=0)
  calls = []
  real = codec.header
  monkeypatch.setattr(codec, "header", lambda f: calls.append(1) or real(f))
  session.max_message = 1 << 30          # the transport's bound aside
  answer = session.receive(frame * 200_000)
  assert not answer.send and not calls
  assert session.counters.errors(Code.ABSURD_LENGTH) == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="needs /proc (Linux) to read a process's RSS")
def test_a_500_mb_message_does_not_grow_the_worker_process(tmp_path):
  """The stated bound: a worker process's RSS grows by less than 64 MB
  while a peer sends it one 500 MB message and three 100 MB messages (it
  grew by 480 MB before: no ZMQ_MAXMSGSIZE). libzmq disconnects the peer
  as soon as the size is read; the worker keeps serving."""
  proc, address = h.start_worker_process()
  try:
    time.sleep(0.5)
    before = h.rss_kb(proc.pid)
    peak = before
    big = bytes(500 * 10 ** 6)
    for size in [len(big)] + [100 * 10 ** 6] * 3:
      sock = zmq.Context.instance().socket(zmq.DEALER)
      sock.setsockopt(zmq.LINGER, 0)
      sock.connect(address)
      sock.send(memoryview(big)[:size], copy=False)
      for _ in range(20):
        time.sleep(0.05)
        peak = max(peak, h.rss_kb(proc.pid))
      sock.close(linger=0)
    del big
    assert peak - before < 64 * 1024, (before, peak)
    verifier = bridge.Verifier(SPARSE, address, target_fn=h.target_fn_for(
        h.toy()), secret=h.SECRET, timeout_s=h.GENEROUS_S)
    try:
      verifier.open()
      verifier.add_request(0, [1], seed=3)
      assert not verifier.round([0])[0].fallback
    finally:
      verifier.close()
  finally:
    proc.kill()
    proc.wait()


def test_verifier_and_worker_memory_is_bounded_by_live_requests():
  """used_tags grew forever and finished requests could not be removed.
  200 requests, each living for 2 rounds then removed: both sides end
  with state for the live requests only (200 < the worker's max_views, so
  only the removals can have freed the others' state)."""
  c = h.caps(max_requests=2)
  with h.running(c, requests=0) as (worker, verifier):
    for rid in range(200):
      verifier.add_request(rid, [1], seed=rid)
      for _ in range(2):
        verifier.round([rid])
      verifier.remove_request(rid)
    verifier.add_request(5, [1], seed=5)   # a removed id comes back
    res = verifier.round([5])
    assert res[0].generation >= 1          # it continues, no tag reuse
    assert set(verifier.requests) == {5}
    deadline = time.monotonic() + h.GENEROUS_S   # the last RESET in flight
    while len(worker.session.views) > 1 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert len(worker.session.views) <= 1
    assert not hasattr(verifier.session, "used_tags")


def test_views_are_bounded_without_removal():
  session = bridge.WorkerSession(SPARSE, secret=h.SECRET, max_views=8)
  client = bridge.VerifierSession(SPARSE, secret=h.SECRET)
  for send in session.finish(session.receive(client.hello().message)):
    client.receive(bytes(send.message))
  for rid in range(100):
    client.add_request(rid, [1], seed=rid)
    answer = session.receive(client.begin([rid], 1, 0.0)[0].message)
    client.abandon()
    for p in answer.propose:
      p.rows.n[:] = 0
    session.finish(answer, {p.entry: Code.PROPOSER_FAILED
                            for p in answer.propose})
  assert len(session.views) == 8
  assert session.counters.events("views_evicted") == 92


GROUPS = [[0, 1], [2, 3]]
ATTACKED_ROUNDS = 8            # rounds of each group under attack


class Recording(h.Tampering):
  """A worker that keeps every message it received: what an on-path
  observer records off the wire, to replay."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.received = []
    self.lock = threading.Lock()

  def handle(self, message):
    with self.lock:
      self.received.append(bytes(message))
    return super().handle(message)


def _hello_storm(worker, stop):
  """HELLOs from a process without the secret, and replays of a real
  verifier's recorded HELLO, every 2 ms."""
  recorded = bytes(bridge.VerifierSession(SPARSE, secret=h.SECRET).hello()
                   .message)
  client = Client(worker.address, secret=h.random_secret())
  replay = Client(worker.address)
  while not stop.is_set():   # a full queue just drops: keep going
    client.endpoint.send(client.session.hello().message)
    replay.endpoint.send(recorded)
    time.sleep(0.002)
  client.close()
  replay.close()


def _replays(worker, stop):
  """The live session's own messages (STEPs, COMMITs, the HELLO), recorded
  off the wire and replayed by a peer without the key, every 2 ms."""
  rng = np.random.default_rng(7)
  client = Client(worker.address, secret=h.random_secret())
  while not stop.is_set():
    with worker.lock:
      recorded = worker.received[rng.integers(len(worker.received))]
    client.endpoint.send(recorded)
    time.sleep(0.002)
  client.close()


def _oversize(worker, stop):
  """Messages over the worker's socket bound (libzmq drops each sender's
  connection unread), and within it a frame that declares 2^32 - 1 bytes
  (refused by the split, before any frame is read)."""
  frame = bytearray(codec.encode(Kind.COMMIT, session=1, generation=0,
                                 round_id=0))
  frame[8:12] = (2 ** 32 - 1).to_bytes(4, "little")   # the header's length
  client = Client(worker.address, secret=h.random_secret())
  big = bytes(worker.max_message + 1)
  while not stop.is_set():
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker.address)
    sock.send(big, zmq.DONTWAIT)
    client.endpoint.send(bytes(frame))
    time.sleep(0.005)
    sock.close(linger=0)
  client.close()


ATTACKS = {"hello_storm": _hello_storm, "replays": _replays,
           "oversize": _oversize}


@pytest.fixture(scope="module")
def clean_tokens():
  """Each request's committed tokens after ATTACKED_ROUNDS rounds of each
  group, one round in flight, nothing else on the link."""
  with h.running(SPARSE, requests=4) as (_, verifier):
    h.drive(verifier, GROUPS, ATTACKED_ROUNDS)
    return {rid: list(r.tokens) for rid, r in verifier.requests.items()}


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_keyless_traffic_forces_no_fallback(attack, in_flight, clean_tokens):
  """A peer without the key floods the worker while the verifier runs its
  rounds, one or two in flight: HELLOs (and replays of a recorded HELLO:
  they forced 50% fallbacks before), the live session's own recorded
  messages replayed, oversize messages. Nothing of it is accepted: every
  round verified, the session kept, no proposal drawn for the peer (no
  PROPOSAL key spent), no resync; both groups commit the tokens one round
  in flight commits undisturbed; and the worker counts the refusals."""
  with h.running(SPARSE, worker_cls=Recording, requests=4) as (
      worker, verifier):
    proposals = worker.counters.events("proposals")
    stop = threading.Event()
    thread = threading.Thread(target=ATTACKS[attack], args=(worker, stop),
                              daemon=True)
    h.drive(verifier, GROUPS, 1, in_flight)   # the peer replays from here
    thread.start()
    try:
      # The refusals are counted before and while the rounds run.
      deadline = time.monotonic() + h.GENEROUS_S
      while worker.counters.total_errors() < 3:
        assert time.monotonic() < deadline, worker.counters.snapshot()
        time.sleep(0.005)
      results = h.drive(verifier, GROUPS, ATTACKED_ROUNDS - 1, in_flight)
    finally:
      stop.set()
      thread.join()
    fallbacks = [r for batch in results for r in batch if r.fallback]
    assert not fallbacks, (fallbacks, verifier.counters.snapshot(),
                           worker.counters.snapshot())
    assert {rid: r.tokens for rid, r in verifier.requests.items()} == (
        clean_tokens)
    assert worker.session.established.id == verifier.session.session
    assert worker.counters.events("proposals") - proposals == (
        2 * len(GROUPS) * ATTACKED_ROUNDS)
    assert not worker.counters.events("resyncs")
    # Two drives: each one's first start overlaps nothing.
    assert verifier.counters.events("overlapped") == (
        (len(GROUPS) * ATTACKED_ROUNDS - 2) * (in_flight - 1))


def test_a_fake_worker_without_the_key_gets_nothing_accepted():
  """A process that binds the worker's port without the secret: its HELLO
  answers fail authentication, every round falls back to the target."""
  fake = FakeWorker(secret=h.random_secret(), forge=True)
  verifier = _verifier(fake.address, warp_on=[Code.AUTH_FAILED])
  try:
    verifier.add_request(0, [1], seed=3)
    for _ in range(4):      # HELLOs in rounds 1, 2 and 4 (the backoff)
      results = verifier.round([0])
      assert results[0].fallback and results[0].code == Code.TIMEOUT
    assert verifier.counters.errors(Code.AUTH_FAILED) >= 3
    assert not verifier.session.is_open
  finally:
    verifier.close()
    fake.close()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_replays_across_sessions_fail_authentication(in_flight):
  """STEPs of an old session (one round in flight, or two: requests 0 and
  1 in rounds of their own) replayed into a new one with as many rounds
  in flight: none is drawn, each refused and counted once."""
  c = SPARSE
  groups = [[rid] for rid in range(in_flight)]
  worker = bridge.WorkerSession(c, secret=h.SECRET)
  old = bridge.VerifierSession(c, secret=h.SECRET)
  for send in worker.finish(worker.receive(old.hello().message)):
    old.receive(bytes(send.message))
  recorded = []
  for rid, group in enumerate(groups):
    old.add_request(rid, [1], seed=1 + rid)
    recorded.append(bytes(old.begin(group, 2, 0.0)[0].message))
    answer = worker.receive(recorded[-1])
    assert answer.propose
    worker.finish(answer)
  assert len(old.exchanges) == in_flight
  new = bridge.VerifierSession(c, secret=h.SECRET)
  for send in worker.finish(worker.receive(new.hello().message)):
    new.receive(bytes(send.message))
  for rid, group in enumerate(groups):
    new.add_request(rid, [1], seed=1 + rid)
    worker.finish(worker.receive(new.begin(group, 2, 0.0)[0].message))
  new.abandon()
  # The old session's STEPs, replayed into the new session: its session
  # id is no longer known (UNKNOWN_SESSION); forged into the new session's
  # id they fail the MAC (AUTH_FAILED); reflected to their sender, too.
  for message in recorded:
    assert not worker.receive(message).propose
    forged = bytearray(message)
    forged[16:24] = new.session.to_bytes(8, "little")
    assert not worker.receive(bytes(forged)).propose
  assert worker.counters.errors(Code.AUTH_FAILED) == in_flight
  assert worker.counters.errors(Code.UNKNOWN_SESSION) == in_flight
  for group in groups:
    assert new.receive(bytes(new.begin(group, 1, 0.0)[0].message)) == []
  assert len(new.exchanges) == in_flight
  assert new.counters.errors(Code.AUTH_FAILED) == in_flight


def test_a_replayed_hello_cannot_evict_the_session_being_opened():
  """Under load the HELLO storm above failed its first round with
  UNKNOWN_SESSION: a replayed (authentic, recorded) HELLO arriving between
  the verifier's HELLO and its first STEP replaced the worker's one pending
  session. Now the worker keeps its last MAX_PENDING pending sessions."""
  c = SPARSE
  worker = bridge.WorkerSession(c, secret=h.SECRET)
  recorded = [bytes(bridge.VerifierSession(c, secret=h.SECRET).hello()
                    .message) for _ in range(worker_session.MAX_PENDING)]
  verifier = bridge.VerifierSession(c, secret=h.SECRET)
  for send in worker.finish(worker.receive(verifier.hello().message)):
    verifier.receive(bytes(send.message))
  assert verifier.is_open
  for message in recorded[:-1] * 50:    # a storm of MAX_PENDING - 1 replays
    worker.finish(worker.receive(message))
  verifier.add_request(0, [1], seed=1)
  answer = worker.receive(verifier.begin([0], 2, 0.0)[0].message)
  assert answer.propose and worker.established.id == verifier.session
  assert worker.counters.errors(Code.UNKNOWN_SESSION) == 0
  # The bound: MAX_PENDING distinct replays do evict a pending session.
  other = bridge.VerifierSession(c, secret=h.SECRET)
  for send in worker.finish(worker.receive(other.hello().message)):
    other.receive(bytes(send.message))
  for message in recorded:
    worker.finish(worker.receive(message))
  other.add_request(0, [1], seed=1)
  assert not worker.receive(other.begin([0], 2, 0.0)[0].message).propose
  assert worker.counters.errors(Code.UNKNOWN_SESSION) == 1


# -- CONTEXT frames --------------------------------------------------------------


@pytest.fixture
def served_context():
  """A real worker that wants CONTEXT frames (max_context 8)."""
  loop = h.serve(h.Tampering(CONTEXT, h.proposer_for(CONTEXT),
                             wants_context=True))
  yield loop
  assert loop.thread.is_alive(), "the worker loop died"
  loop.close()


def _views(worker):
  """The worker's request views as plain values (what a refusal must not
  change)."""
  return {rid: (v.generation, v.round, v.anchor, v.last_token, v.committed,
                None if v.context is None else v.context.tokens().tolist())
          for rid, v in list(worker.session.views.items())}


def _wait_counted(worker, code, before):
  deadline = time.monotonic() + h.GENEROUS_S
  while worker.counters.errors(code) == before:
    assert time.monotonic() < deadline, f"{code.name} never counted"
    time.sleep(0.005)


def _wait_context(worker, rid, tokens):
  """Until the worker's view of `rid` holds `tokens` (a COMMIT in flight)."""
  deadline = time.monotonic() + h.GENEROUS_S
  while _views(worker).get(rid, (None,))[-1] != tokens:
    assert time.monotonic() < deadline, _views(worker)
    time.sleep(0.005)


def _context_step(client, rid):
  """A STEP message of `rid` with its CONTEXT first (a generation's first
  round, forced), not waited for: (context, step) frames."""
  s = client.session
  s.requests[rid].context_sent = None
  message = s.begin([rid], h.DEPTH, time.monotonic())[0].message
  s.abandon()
  frames = h.frames(message)
  assert [codec.peek(f)[0] for f in frames] == [Kind.CONTEXT, Kind.STEP]
  return frames


_COUNT = layouts.HEADER_BYTES + 4
_TOKENS = FIXED_BYTES[Kind.CONTEXT]


def test_every_context_refusal_is_counted_and_changes_nothing(
    served_context):
  worker = served_context.worker
  # The socket's bound admits a STEP and a whole CONTEXT per request.
  assert worker.max_message == CONTEXT.max_requests * (
      FIXED_BYTES[Kind.STEP] + _TOKENS + 4 * CONTEXT.max_context)
  assert served_context.endpoint.socket.getsockopt(zmq.MAXMSGSIZE) == (
      worker.max_message)
  client = Client(worker.address, CONTEXT)
  try:
    client.open()
    s = client.session
    s.add_request(0, [1, 2, 3], seed=3)
    assert not _clean_round(client)[0].fallback    # a view with a context
    _wait_context(worker, 0, s.requests[0].tokens)
    s.add_request(1, [4, 5], seed=4)
    message = s.begin([1], h.DEPTH, time.monotonic())[0].message
    context, step = h.frames(message)
    t = s.keys.send
    flipped = bytearray(context)
    flipped[layouts.TAG_OFFSET] ^= 1
    edits = [
        ([h.reseal(_set(context, _COUNT, 9), t), step], Code.ABSURD_LENGTH),
        ([h.reseal(_set(context, _COUNT, 1), t), step],
         Code.UNEXPECTED_SIZE),
        ([h.reseal(_set(context, _TOKENS, h.V), t), step],
         Code.TOKEN_OUT_OF_RANGE),
        ([bytes(flipped), step], Code.AUTH_FAILED),
        ([step, context], Code.BAD_SEQUENCE),
        ([context], Code.BAD_SEQUENCE),
    ]
    for frames, code in edits:
      before = _views(worker), worker.session.context_tokens
      total = worker.counters.total_errors()
      counted = worker.counters.errors(code)
      client.send(h.join(frames))
      _wait_counted(worker, code, counted)
      assert worker.counters.total_errors() == total + 1
      assert client.recv(0.05) is None
      assert (_views(worker), worker.session.context_tokens) == before
    client.send(message)                         # the frames as sent
    results = _finish_round(client)
    assert not results[0].fallback, results
    _wait_context(worker, 1, s.requests[1].tokens)
  finally:
    client.close()


def _set(frame, offset, value):
  buf = bytearray(frame)
  buf[offset:offset + 4] = int(value).to_bytes(4, "little")
  return bytes(buf)


def test_worker_survives_every_context_field_extreme(served_context):
  worker = served_context.worker
  client = Client(worker.address, CONTEXT)
  try:
    client.open()
    client.session.add_request(0, [1, 2], seed=3)
    outcomes = {"refused": 0, "accepted": 0}
    for field, value in _edits(Kind.CONTEXT):
      before = worker.counters.total_errors()
      context, step = _context_step(client, 0)
      edited = h.set_field(context, Kind.CONTEXT, field, value,
                           client.session.keys.send)
      client.send(h.join([edited, step]))
      answer = client.recv(0.3)
      refused = worker.counters.total_errors() > before
      if answer is None and not refused:     # a slow draw, not a refusal
        answer = client.recv()
        refused = worker.counters.total_errors() > before
      outcomes["refused" if refused else "accepted"] += 1
      assert refused == (answer is None), (field, value)
    assert outcomes["refused"] > 0 and outcomes["accepted"] > 0, outcomes
    client.session.requests[0].context_sent = None
    assert not _clean_round(client)[0].fallback
  finally:
    client.close()
