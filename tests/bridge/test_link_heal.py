"""Issue 27: a link that heals itself and hides what it carries.

Each hole, tried as an attacker would, through the real transport:

* a squatter on a dead worker's port (one part over the verifier's
  ZMQ_MAXMSGSIZE; a CURVE server without the worker's key) made libzmq
  give the verifier's socket up for good: every later round fell back.
  Now the socket monitor and the silent-round rule replace the socket and
  reopen the session; the same holds for a rank link;
* an unfinished multipart message grew the worker without bound: CURVE
  (the default) admits only the deployment's keys at the handshake;
* the drafted tokens travelled in the clear (an on-path relay could drop
  replies by their content); now they do not by default;
* a worker's refusal, authentic under the deployment-wide key, could end
  another link's round; a forged frame was decoded while a session opened.

No assertion reads a clock: recovery is counted in rounds, memory in RSS.
"""

import os
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from dyadic_jax import bridge
from dyadic_jax.bridge import keys, rank_links, transport
from dyadic_jax.wire import auth, codec, layouts
from dyadic_jax.wire.refusals import Code, ProtocolError
from tests import bridge_harness as h

SPARSE = h.caps()
GUARD_S = 60          # a guard against a hang, never a measurement
ROUNDS = 10


def _wait(condition):
  deadline = time.monotonic() + GUARD_S
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert condition()


def _bind(bind, address):
  """bind(address), again while libzmq still holds the port of a socket
  just closed (it closes listeners asynchronously)."""
  deadline = time.monotonic() + GUARD_S
  while True:
    try:
      return bind(address)
    except zmq.ZMQError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.01)


def _monitor_until(sock, events):
  """Waits (guarded) for one of `events` on `sock`'s monitor."""
  monitor = sock.get_monitor_socket(events)
  try:
    assert monitor.poll(GUARD_S * 1000), "the event never came"
    from zmq.utils import monitor as zmq_monitor  # pylint: disable=g-import-not-at-top
    return zmq_monitor.recv_monitor_message(monitor)["event"]
  finally:
    sock.disable_monitor()
    monitor.close(linger=0)


def _oversize_squatter(address, size):
  """Binds `address`, sends the first peer one part of `size` bytes and
  leaves once the peer dropped the connection (its protocol error)."""
  sock = zmq.Context.instance().socket(zmq.DEALER)
  sock.setsockopt(zmq.LINGER, 0)
  sock.setsockopt(zmq.SNDTIMEO, GUARD_S * 1000)
  monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
  _bind(sock.bind, address)
  sock.send(bytes(size))
  assert monitor.poll(GUARD_S * 1000), "the peer kept the connection"
  sock.disable_monitor()
  monitor.close(linger=0)
  sock.close(linger=0)


def _curve_squatter(address):
  """Binds `address` as a CURVE server with keys of its own, and leaves
  once a peer's handshake failed."""
  sock = zmq.Context.instance().socket(zmq.ROUTER)
  sock.setsockopt(zmq.LINGER, 0)
  public, secret = zmq.curve_keypair()
  sock.curve_server = True
  sock.curve_secretkey, sock.curve_publickey = secret, public
  _bind(sock.bind, address)
  _monitor_until(sock, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                 | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                 | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
  sock.close(linger=0)


@pytest.fixture(name="key_set", scope="module")
def _key_set(tmp_path_factory):
  directory = keys.make(tmp_path_factory.mktemp("keys") / "k")
  return (keys.load(directory, "worker"), keys.load(directory, "verifier"),
          directory)


def _restarted_link(squat, curve_pair=None, in_flight=1):
  """Rounds of a verifier whose worker died, whose port `squat(address,
  verifier)` took for a while, and which restarted on the same port, one
  round in flight (request 0) or two (requests 0 and 1, pipelined):
  {rid: [(fallback, tag)]} of ROUNDS rounds after the restart,
  {rid: [tag]} of the rounds before, and the counters."""
  wcurve, vcurve = curve_pair or (None, None)
  c = SPARSE
  served = h.serve(h.Tampering(c, h.proposer_for(c)), curve=wcurve)
  address = served.address
  verifier = h.WarpVerifier(c, address, target_fn=h.target_fn_for(h.toy()),
                            secret=h.SECRET, timeout_s=h.GENEROUS_S,
                            clock=h.WarpClock(), curve=vcurve)
  groups = [[rid] for rid in range(in_flight)]
  before = {g[0]: [] for g in groups}
  after = {g[0]: [] for g in groups}
  try:
    verifier.open()
    for rid in before:
      verifier.add_request(rid, [1], seed=3 + rid)
    for results in h.drive(verifier, groups, 3, in_flight):
      before[results[0].rid].append((results[0].generation,
                                     results[0].round))
    served.close()                               # the worker dies
    squat(address, verifier)
    served = _bind(lambda a: h.serve(h.Tampering(c, h.proposer_for(c)), a,
                                     curve=wcurve), address)   # back again
    for _ in range(ROUNDS):
      # A round that waits is a lost one: the guard warps its deadline.
      timer = threading.Timer(15.0, verifier.clock.warp)
      timer.start()
      for (r,) in h.drive(verifier, groups, 1, in_flight):
        after[r.rid].append((r.fallback, (r.generation, r.round)))
      timer.cancel()
    return after, before, verifier.counters.snapshot()
  finally:
    verifier.close()
    served.close()


def _assert_healed(after, before, snapshot, within):
  """Each request (its own round in flight) falls back in its first
  `within` rounds only, and commits nothing stale."""
  for rid, rounds in after.items():
    fallbacks = [i for i, (fallback, _) in enumerate(rounds) if fallback]
    assert all(i < within for i in fallbacks), (rid, after, snapshot)
    # Nothing stale is committed: every round's (generation, round) tag
    # is newer than any before it (no key is drawn twice).
    tags = before[rid] + [tag for _, tag in rounds]
    assert all(a < b for a, b in zip(tags, tags[1:])), (rid, tags)
  # Two requests: two rounds in flight once a session is open.
  assert (snapshot["events"].get("overlapped", 0) > 0) == (len(after) == 2)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_an_oversize_squatter_cannot_cut_the_verifier_off(in_flight):
  """40 of 40 rounds fell back on main: libzmq never reconnects after the
  protocol error. Now the worker is heard again within 2 rounds, with one
  round in flight or two."""
  def squat(address, verifier):
    # One byte over the bound of the verifier's socket (its HELLO bound:
    # 4,096 bytes at these small capabilities).
    _oversize_squatter(address, verifier.endpoint.socket.getsockopt(
        zmq.MAXMSGSIZE) + 1)
  after, before, snapshot = _restarted_link(squat, in_flight=in_flight)
  _assert_healed(after, before, snapshot, within=2)
  assert snapshot["events"]["reconnects"] >= 1


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_keyless_curve_squatter_cannot_cut_the_verifier_off(key_set,
                                                             in_flight):
  """With CURVE, a process that only binds the port (a failed handshake)
  did the same on main. Now: heard again within 2 rounds, with one round
  in flight or two."""
  worker_keys, verifier_keys, _ = key_set
  after, before, snapshot = _restarted_link(
      lambda address, verifier: _curve_squatter(address),
      (worker_keys.curve, verifier_keys.curve), in_flight=in_flight)
  _assert_healed(after, before, snapshot, within=2)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_plain_worker_restart_costs_at_most_one_round(in_flight):
  """The control: no squatter (main: 1 fallback, then it recovered)."""
  after, before, snapshot = _restarted_link(lambda address, verifier: None,
                                            in_flight=in_flight)
  _assert_healed(after, before, snapshot, within=1)


def test_a_rank_link_heals_after_an_oversize_squatter():
  """The rank link's receiver said HELLO again on its dead socket on main:
  no frame ever came. Now it makes a new socket: healed within 2 rounds."""
  caps = bridge.Capabilities(vocab=1000, max_depth=3, max_requests=2,
                             representation=layouts.Representation.DENSE,
                             shards=2).link(1)
  sender = rank_links.ShardSender(caps, "tcp://127.0.0.1:0", secret=h.SECRET)
  address = sender.address
  receiver = rank_links.ShardReceiver(caps, address, secret=h.SECRET,
                                      timeout_s=h.GENEROUS_S)
  try:
    receiver.open(attempts=3)
    sender.close()                                # the worker rank dies
    _oversize_squatter(address, caps.bounds.max_reply_message + 1)
    sender = _bind(lambda a: rank_links.ShardSender(caps, a, secret=h.SECRET),
                   address)
    receiver.timeout_s = 1.0      # a round's deadline, not a measurement
    codes = []
    for n in range(1, 4):
      out = []
      thread = threading.Thread(target=lambda n=n: out.append(
          receiver.collect([10], [(0, n)], 3)))
      thread.start()
      deadline = time.monotonic() + GUARD_S
      while (thread.is_alive() and sender.link_session is None
             and time.monotonic() < deadline):
        time.sleep(0.01)
      if sender.link_session is not None:
        reply = sender.frame(10, (0, n), 3)
        reply.rows.values[:] = 0
        reply.rows.n[:] = caps.width
        sender.send(reply)
      thread.join()
      codes.append(int(out[0][1][0]))
      if codes[-1] == 0:
        break
    assert codes[-1] == 0 and len(codes) <= 2, (
        codes, receiver.counters.snapshot())
  finally:
    receiver.close()
    sender.close()


def _zmtp_flood(address, parts, part_bytes=284):
  """A keyless raw-ZMTP peer (ZMTP 3.0, NULL mechanism, written by hand:
  libzmq's own sockets hold an unfinished message back): `parts` parts of
  one message that never ends. Returns the open TCP socket."""
  host, _, port = address[len("tcp://"):].rpartition(":")
  sock = socket.create_connection((host, int(port)))
  greeting = (b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0])
              + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31))
  prop = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
  ready = b"\x05READY" + prop
  frame = b"\x03" + part_bytes.to_bytes(8, "big") + bytes(part_bytes)
  chunk = frame * 1000
  try:
    sock.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
    for _ in range(parts // 1000):
      sock.sendall(chunk)
  except OSError:
    pass             # the peer hung up: it admits no such peer
  return sock


def _curve_flood(address, parts, server_public, part_bytes=284):
  """A CURVE client with keys of its own (the worker's public key is
  public): the same flood, through libzmq (it flushes nothing before the
  handshake, so this tries the admission only)."""
  sock = zmq.Context.instance().socket(zmq.DEALER)
  sock.setsockopt(zmq.LINGER, 0)
  public, secret = zmq.curve_keypair()
  sock.curve_secretkey, sock.curve_publickey = secret, public
  sock.curve_serverkey = server_public
  sock.connect(address)
  for _ in range(parts):
    sock.send(bytes(part_bytes), zmq.SNDMORE)
  sock.send(b"")
  return sock


def _flooded_worker_rss(directory, parts, *, slow=False):
  """(RSS growth in KB of a worker process under the floods, whether a
  keyed verifier is served after): the worker as `bridge.keys.load` sets
  it up by default."""
  proc, address = h.start_worker_process(str(directory))
  try:
    before = peak = h.rss_kb(proc.pid)
    floods = [lambda: _zmtp_flood(address, parts)]
    if slow:     # a keyless CURVE client, too (the worker's public key)
      server = keys.load(directory, "verifier").curve.server_public
      floods.append(lambda: _curve_flood(address, parts, server))
    for flood in floods:
      sock = flood()
      for _ in range(40):
        time.sleep(0.05)
        peak = max(peak, h.rss_kb(proc.pid))
      sock.close()
    loaded = keys.load(directory, "verifier")
    verifier = bridge.Verifier(SPARSE, address, target_fn=h.target_fn_for(
        h.toy()), secret=loaded.secret, curve=loaded.curve,
                               timeout_s=h.GENEROUS_S)
    try:
      verifier.open()
      verifier.add_request(0, [1], seed=3)
      served = not verifier.round([0])[0].fallback
    finally:
      verifier.close()
    return peak - before, served
  finally:
    proc.kill()
    proc.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="needs /proc (Linux) to read a process's RSS")
def test_an_unfinished_multipart_message_cannot_grow_the_worker(key_set):
  """The stated bound: 64 MB above idle RSS. On main the worker took every
  part of 400,000 x 284 bytes (+190 MB, never released); now a peer
  without the deployment's keys never gets past the handshake."""
  _, _, directory = key_set
  grown_kb, served = _flooded_worker_rss(directory, 400_000)
  print(f"worker RSS growth under the flood: {grown_kb / 1024:.1f} MB")
  assert grown_kb < 64 * 1024, grown_kb
  assert served


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="needs /proc (Linux) to read a process's RSS")
def test_the_issues_million_part_flood_is_bounded_too(key_set):
  """The issue's flood (1,000,000 parts), raw and from a keyless CURVE
  client: within the same 64 MB."""
  _, _, directory = key_set
  grown_kb, served = _flooded_worker_rss(directory, 1_000_000, slow=True)
  print(f"worker RSS growth under the floods: {grown_kb / 1024:.1f} MB")
  assert grown_kb < 64 * 1024, grown_kb
  assert served


class _Relay:
  """A TCP relay that records what passes it (an on-path observer)."""

  def __init__(self, target_port):
    self.listener = socket.create_server(("127.0.0.1", 0))
    self.port = self.listener.getsockname()[1]
    self.target = target_port
    self.seen = bytearray()
    self.lock = threading.Lock()
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      try:
        near, _ = self.listener.accept()
      except OSError:
        return
      far = socket.create_connection(("127.0.0.1", self.target))
      for a, b in ((near, far), (far, near)):
        threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

  def _pipe(self, a, b):
    while True:
      try:
        data = a.recv(1 << 16)
      except OSError:
        data = b""
      if not data:
        for s in (a, b):
          try:
            s.shutdown(socket.SHUT_RDWR)
          except OSError:
            pass
        return
      with self.lock:
        self.seen += data
      b.sendall(data)

  def close(self):
    self.listener.close()


def test_an_on_path_observer_sees_no_frame_by_default(key_set):
  """The drafted tokens travelled in the clear by default on main: a relay
  that dropped replies by their first token moved that set's share of
  committed tokens from 53.0% to 63.7% (the issue). With the default
  keys the relay sees no frame (not even the wire's magic)."""
  worker_keys, verifier_keys, _ = key_set
  c = SPARSE
  served = h.serve(h.Tampering(c, h.proposer_for(c)),
                   curve=worker_keys.curve)
  relay = _Relay(int(served.address.rpartition(":")[2]))
  verifier = bridge.Verifier(c, f"tcp://127.0.0.1:{relay.port}",
                             target_fn=h.target_fn_for(h.toy()),
                             secret=h.SECRET,
                             curve=verifier_keys.curve,
                             timeout_s=h.GENEROUS_S)
  try:
    verifier.open()
    verifier.add_request(0, [1], seed=3)
    results = [verifier.round([0])[0] for _ in range(3)]
    assert not any(r.fallback for r in results)
    with relay.lock:
      seen = bytes(relay.seen)
    assert len(seen) > 1000
    assert layouts.MAGIC not in seen
  finally:
    verifier.close()
    served.close()
    relay.close()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_another_workers_refusal_cannot_end_a_round(in_flight):
  """A keyless STEP with the session and tags of a live exchange, sent to
  another worker of the deployment (one that knows no session), got an
  authentic RESET(UNKNOWN_SESSION) back; delivered on path it ended the
  round (a fallback, and a new HELLO). Now a refusal is keyed by the tag
  of the frame it refuses: the verifier counts it (AUTH_FAILED) and the
  round is answered; with two rounds in flight (requests 0 and 1 in
  groups of their own) neither ends, whichever exchange's keys it is
  tried under."""
  other = bridge.WorkerSession(SPARSE, secret=h.SECRET)   # knows no session

  class Relay(h.Tampering):
    def handle(self, message):
      self.last = bytes(message)
      return super().handle(message)

  groups = [[0, 1]] if in_flight == 1 else [[0], [1]]
  with h.running(SPARSE, worker_cls=Relay) as (worker, verifier):
    h.drive(verifier, groups, 1, in_flight)

    def inject(messages, tagger):
      del tagger
      step = bytearray(worker.last)
      step[layouts.TAG_OFFSET:layouts.TAG_OFFSET + 16] = bytes(16)  # no key
      refusal = other.receive(bytes(step)).send
      assert refusal         # the other worker answers it
      return [bytes(refusal[0].message)] + messages

    worker.tamper = inject
    results = [r for batch in h.drive(verifier, groups, 1, in_flight)
               for r in batch]
    assert not any(r.fallback for r in results), (
        verifier.counters.snapshot())
    assert verifier.counters.events("overlapped") == 2 * (in_flight - 1)
    assert verifier.counters.errors(Code.AUTH_FAILED) == 1
    assert verifier.counters.errors(Code.UNKNOWN_SESSION) == 0


def test_a_forged_reply_while_a_session_opens_is_not_decoded():
  """Main decoded a keyless REPLY answering a HELLO before any tag check
  (counted SAMPLED_ON_GREEDY). Now only HELLO or RESET frames are read
  while a session opens: the REPLY is BAD_SEQUENCE, unread."""
  router = zmq.Context.instance().socket(zmq.ROUTER)
  router.setsockopt(zmq.LINGER, 0)
  port = router.bind_to_random_port("tcp://127.0.0.1")
  clock = h.WarpClock()
  verifier = h.WarpVerifier(SPARSE, f"tcp://127.0.0.1:{port}",
                            target_fn=h.target_fn_for(h.toy()),
                            secret=h.SECRET, timeout_s=h.GENEROUS_S,
                            clock=clock)

  def impostor():
    assert router.poll(GUARD_S * 1000)
    peer, hello_message = router.recv_multipart()
    session = codec.peek(hello_message)[1]
    buf = bytearray(SPARSE.bounds.reply_bytes(1))
    frame, _ = codec.begin_reply(buf, bounds=SPARSE.bounds, session=session,
                                 generation=0, round_id=0, request=0,
                                 depth=1)
    auth.seal(frame, auth.Blake3Tag(bytes(range(1, 33))))   # not the key
    router.send_multipart([peer, bytes(frame)])
    _wait(lambda: verifier.counters.total_errors() > 0)
    clock.warp()                  # the HELLO's deadline passes
  thread = threading.Thread(target=impostor, daemon=True)
  thread.start()
  try:
    with pytest.raises(ProtocolError):
      verifier.open(attempts=1)
    errors = verifier.counters.snapshot()["errors"]
    assert errors == {"BAD_SEQUENCE": 1, "TIMEOUT": 1}, errors
  finally:
    thread.join(GUARD_S)
    verifier.close()
    router.close(linger=0)


def test_the_worker_endpoint_needs_no_monitor():
  # A bound ROUTER outlives its peers: only a connecting socket is watched.
  endpoint = transport.Endpoint.bind("tcp://127.0.0.1:0", max_message=64)
  try:
    assert not endpoint.broken()
  finally:
    endpoint.close()
  assert np is not None


def _null_greeter(listener, stop):
  """A raw-ZMTP peer on `listener` that answers each connection with a
  ZMTP 3.0 greeting of the NULL mechanism and hangs up."""
  greeting = (b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0])
              + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31))
  listener.settimeout(0.05)
  while not stop.is_set():
    try:
      conn, _ = listener.accept()
    except OSError:
      continue
    try:
      conn.sendall(greeting)
    except OSError:
      pass
    conn.close()


def test_a_failed_handshake_is_lost_at_once_and_no_look_waits(
    key_set, monkeypatch):
  """A NULL greeting to the verifier's CURVE socket, then a hang-up (a
  squatter during an outage): the endpoint is lost at once, and no look
  at its monitor waits. Before: each look waited RETRY_NOTICE_MS for a
  reconnection libzmq never schedules, about 1 s of every fallback round
  while the worker was down. Counted: the monitor's polls with a wait."""
  vcurve = key_set[1].curve
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen()
  stop = threading.Event()
  greeter = threading.Thread(target=_null_greeter, args=(listener, stop),
                             daemon=True)
  greeter.start()
  waits = []
  poll = zmq.Socket.poll

  def counted(sock, timeout=None, flags=zmq.POLLIN):
    if sock is getattr(endpoint, "_monitor", None) and timeout != 0:
      waits.append(timeout)
    return poll(sock, timeout, flags)
  endpoint = transport.Endpoint.connect(
      f"tcp://127.0.0.1:{listener.getsockname()[1]}",
      max_message=transport.HELLO_MESSAGE, curve=vcurve)
  monkeypatch.setattr(zmq.Socket, "poll", counted)
  try:
    # recv wakes on the monitor's events; bounded by the guard, not timed.
    assert endpoint.recv(GUARD_S) is None
    assert endpoint.lost
    assert waits == []
  finally:
    endpoint.close()
    stop.set()
    greeter.join(GUARD_S)
    listener.close()

