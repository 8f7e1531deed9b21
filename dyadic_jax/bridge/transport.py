"""ZeroMQ transport: one message part per bridge message, bounded, no waits.

The worker binds a ROUTER socket, the verifier connects a DEALER, over TCP
on loopback (`tcp://127.0.0.1:PORT`, port 0 picks a free one) or over ipc
(`ipc:///path`). A bridge message (frames back to back, `wire.codec`)
travels as ONE ZeroMQ message part, so that ZMQ_MAXMSGSIZE bounds a whole
message: libzmq disconnects a peer whose message part is larger, before
allocating it (the bound comes from the local capabilities: the worker
receives at most one STEP/COMMIT/RESET frame per request, the verifier at
most one reply message; before its session opens, the verifier's socket
takes HELLO-sized messages only). A message with the wrong number of parts
is refused (counted as ABSURD_LENGTH) without being read.

Nothing waits without a deadline: `recv` polls with a timeout, `send`
never blocks (ZMQ_DONTWAIT; a full queue or an unroutable peer is a
dropped message, counted as `send_dropped`, and the exchange falls back or
the peer retries). High-water marks bound what ZeroMQ queues for a peer in
each direction. Large parts (64 KiB and more) are sent without a copy and
tracked (`send` returns the tracker): the worker reuses a slot buffer only
once ZeroMQ let go of it, and takes a new one instead of waiting.

Admission and confidentiality (`curve=`, the default of `bridge.keys`):
ZeroMQ CURVE (CurveZMQ): the verifier authenticates the worker's public
key and encrypts; the worker admits only the verifier key it was given (a
ZAP handler of its own), so a peer without the deployment's keys never
gets past the handshake, and libzmq buffers nothing of what it sends.
Its cost per round: docs/security.md.

A connecting endpoint watches its socket (a ZeroMQ socket monitor). After
an ordinary disconnection libzmq schedules a reconnection at once (it
reports CONNECT_RETRIED right after DISCONNECTED); after a protocol error
(a peer that sent a part over ZMQ_MAXMSGSIZE) or a failed handshake it
gives the connection up for good and reports nothing more. Such an
endpoint is `lost` (`broken`), and its driver replaces the socket instead
of waiting on it (`Verifier`, `rank_links`). A failed handshake is lost at
once, with no wait (before, each one waited RETRY_NOTICE_MS for a retry
libzmq never schedules after it: a peer that sent a NULL greeting and hung
up made every round of an outage cost a second). A disconnection still
waits for its retry notice, which libzmq sends in the same call unless it
gave up (a protocol error): once per connection lost, after which the
socket is replaced, and deciding it in this look keeps the heal within a
round however short the rounds.
"""

import threading
import time
import typing

import zmq
from zmq.utils import monitor as zmq_monitor
from zmq.utils import z85

from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Message
from dyadic_jax.wire.refusals import Code

COPY_THRESHOLD = 64 * 1024   # smaller parts are cheaper to copy than to track
# ZMQ_MAXMSGSIZE bounds ZMTP frames, and under CURVE a message travels
# boxed (about 33 bytes more) and the handshake's commands are a few
# hundred bytes: the bound gets this slack.
CURVE_SLACK = 1024
HWM = 8                      # messages queued per peer and direction
HELLO_MESSAGE = 4096         # the verifier's bound before its session opens
# What ends a connection for good, or says the peer is not ours: after
# these libzmq may never reconnect the session (a protocol error ends it).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
LOST_EVENTS = zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
# libzmq reports a scheduled reconnection in the same call that reports
# the disconnection: this long without one, it gave the connection up.
RETRY_NOTICE_MS = 1000


def _context() -> zmq.Context:
  return zmq.Context.instance()


class _Zap(threading.Thread):
  """A ZAP handler (RFC 27) that admits one CURVE client key, no other."""

  def __init__(self, context: zmq.Context, client_public: bytes) -> None:
    super().__init__(daemon=True, name="bridge-zap")
    self._key = z85.decode(client_public)
    self._socket = context.socket(zmq.REP)
    self._socket.setsockopt(zmq.LINGER, 0)
    self._socket.bind("inproc://zeromq.zap.01")
    self._halt = threading.Event()
    self.start()

  def run(self) -> None:
    while not self._halt.is_set():
      if not self._socket.poll(50):
        continue
      parts = self._socket.recv_multipart()
      version, request_id = parts[0], parts[1]
      mechanism = parts[5] if len(parts) > 5 else b""
      key = parts[6] if len(parts) > 6 else b""
      ok = mechanism == b"CURVE" and key == self._key
      self._socket.send_multipart([
          version, request_id, b"200" if ok else b"400",
          b"OK" if ok else b"unknown key", b"", b""])
    self._socket.close(linger=0)

  def stop(self) -> None:
    self._halt.set()
    self.join(1.0)


class Curve:
  """CURVE key material of one side (z85 text keys, from `bridge.keys`).

  server_public: the worker's public key (both sides);
  secret_key/public_key: this side's pair; client_public: the verifier's
  public key (the worker admits it alone).
  """

  def __init__(self, *, public_key: bytes, secret_key: bytes,
               server_public: bytes, client_public: bytes | None = None
               ) -> None:
    self.public_key = public_key
    self.secret_key = secret_key
    self.server_public = server_public
    self.client_public = client_public


class Endpoint:
  """One socket: `bind` (worker, ROUTER) or `connect` (verifier, DEALER)."""

  def __init__(self, socket: zmq.Socket, address: str, routed: bool,
               counters: Counters | None = None, zap: _Zap | None = None,
               context: zmq.Context | None = None) -> None:
    self.socket = socket
    self.address = address
    self._routed = routed
    self.counters = counters
    self._zap = zap
    self._context = context     # a CURVE endpoint's own (its ZAP handler)
    # A connecting endpoint's socket monitor (LOST_EVENTS only).
    self._monitor: zmq.Socket | None = None
    self.lost = False
    if not routed:
      self._monitor = socket.get_monitor_socket(
          LOST_EVENTS | zmq.EVENT_CONNECT_RETRIED)

  @staticmethod
  def _options(socket: zmq.Socket, max_message: int,
               curve: "Curve | None" = None) -> None:
    if curve is not None:
      max_message += CURVE_SLACK
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, HWM)
    socket.setsockopt(zmq.RCVHWM, HWM)
    socket.setsockopt(zmq.MAXMSGSIZE, int(max_message))

  @classmethod
  def bind(cls, address: str, *, max_message: int, curve: "Curve | None" = None,
           counters: Counters | None = None) -> "Endpoint":
    """A ROUTER bound at `address`; tcp port 0 picks a free port.

    max_message: the largest message part accepted (ZMQ_MAXMSGSIZE).
    """
    # One ZAP handler per context: a CURVE endpoint gets a context of its own.
    context = None if curve is None else zmq.Context()
    socket = (context or _context()).socket(zmq.ROUTER)
    cls._options(socket, max_message, curve)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    zap = None
    if curve is not None:
      assert context is not None and curve.client_public is not None
      zap = _Zap(context, curve.client_public)
      socket.setsockopt(zmq.ZAP_DOMAIN, b"dyadic-bridge")
      socket.curve_secretkey = curve.secret_key
      socket.curve_publickey = curve.public_key
      socket.curve_server = True
    if address.startswith("tcp://"):
      port = address.rpartition(":")[2]
      # libzmq takes a port past 65535 modulo 2^16: it would listen
      # elsewhere than the address says.
      if not (port.isdigit() and int(port) <= 65535):
        socket.close()
        raise ValueError(f"Endpoint.bind: {address}: the port must be an "
                         "integer in [0, 65535]")
    if address.startswith("tcp://") and address.endswith(":0"):
      socket.bind_to_random_port(address[:-2])
    else:
      socket.bind(address)
    # What it listens on, as libzmq resolved it (the port 0 picked).
    address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return cls(socket, address, True, counters, zap, context)

  @classmethod
  def connect(cls, address: str, *, max_message: int,
              curve: "Curve | None" = None,
              counters: Counters | None = None) -> "Endpoint":
    """A DEALER connected to `address` (reconnects by itself)."""
    socket = _context().socket(zmq.DEALER)
    cls._options(socket, max_message, curve)
    socket.setsockopt(zmq.RECONNECT_IVL, 20)
    if curve is not None:
      socket.curve_secretkey = curve.secret_key
      socket.curve_publickey = curve.public_key
      socket.curve_serverkey = curve.server_public
    socket.connect(address)
    return cls(socket, address, False, counters)

  def broken(self) -> bool:
    """True once libzmq gave the connection up (a failed handshake, or a
    disconnection that no reconnection follows): the socket must be
    replaced. Reads the pending monitor events."""
    monitor = self._monitor
    while monitor is not None and not self.lost and monitor.poll(0):
      event = int(zmq_monitor.recv_monitor_message(
          monitor, zmq.DONTWAIT)["event"])
      if event & HANDSHAKE_FAILED or (
          event == zmq.EVENT_DISCONNECTED and self._gave_up(monitor)):
        self.lost = True
        self._event("link_lost")
    return self.lost

  @staticmethod
  def _gave_up(monitor: zmq.Socket) -> bool:
    """After a disconnection: False once libzmq reports its reconnection
    scheduled, True at a failed handshake or if none comes within
    RETRY_NOTICE_MS (libzmq gave up: a protocol error)."""
    while monitor.poll(RETRY_NOTICE_MS):
      event = int(zmq_monitor.recv_monitor_message(
          monitor, zmq.DONTWAIT)["event"])
      if event == zmq.EVENT_CONNECT_RETRIED:
        return False
      if event & HANDSHAKE_FAILED:
        return True
    return True

  def _event(self, name: str) -> None:
    if self.counters is not None:
      self.counters.event(name)

  def send(self, message: Message, peer: bytes | None = None,
           wait_s: float = 0.0) -> tuple[bool, zmq.MessageTracker | None]:
    """Sends one message (one part) without blocking, or, where the queue
    is full, after waiting up to `wait_s` for room (a DEALER only).

    Returns (sent, tracker): sent is False when ZeroMQ could not take it
    (a full queue, a peer that is gone: counted as `send_dropped`);
    tracker says when ZeroMQ let go of a zero-copy buffer (None: copied).
    """
    if (wait_s > 0 and not self._routed
        and not self.socket.poll(int(wait_s * 1000), zmq.POLLOUT)):
      self._event("send_dropped")
      return False, None
    big = len(memoryview(message)) >= COPY_THRESHOLD
    try:
      if self._routed:
        self.socket.send(typing.cast(bytes, peer), zmq.SNDMORE | zmq.DONTWAIT)
      tracker = self.socket.send(message, zmq.DONTWAIT, copy=not big,
                                 track=big)
    except zmq.ZMQError:
      self._event("send_dropped")
      return False, None
    return True, (tracker if big else None)

  def recv(self, timeout_s: float
           ) -> tuple[bytes | None, memoryview] | None:
    """(peer, message) of the next message, or None after `timeout_s`.

    message: a memoryview onto ZeroMQ's buffer (valid while referenced).
    A message with the wrong number of parts is refused unread (None).
    """
    if not self._wait(timeout_s):
      return None
    try:
      parts = self.socket.recv_multipart(copy=False, flags=zmq.DONTWAIT)
    except zmq.Again:
      return None
    want = 2 if self._routed else 1
    if len(parts) != want:
      if self.counters is not None:
        self.counters.reject(Code.ABSURD_LENGTH,
                             f"message of {len(parts)} parts")
      return None
    peer = parts[0].bytes if self._routed else None
    return peer, parts[-1].buffer

  def _wait(self, timeout_s: float) -> bool:
    """Waits for a message up to `timeout_s`; False when none came, or as
    soon as the connection is lost (`broken`)."""
    if self._monitor is None:
      return bool(self.socket.poll(max(0, int(timeout_s * 1000))))
    poller = zmq.Poller()
    poller.register(self.socket, zmq.POLLIN)
    poller.register(self._monitor, zmq.POLLIN)
    end = time.monotonic() + max(0.0, timeout_s)
    while not self.broken():
      ready = dict(poller.poll(max(0, int((end - time.monotonic()) * 1000))))
      if self.socket in ready:
        return True
      if self._monitor not in ready:
        return False            # the time is up
    return False

  def close(self) -> None:
    if self._monitor is not None:
      self.socket.disable_monitor()
      self._monitor.close(linger=0)
      self._monitor = None
    self.socket.close(linger=0)
    if self._zap is not None:
      self._zap.stop()
    if self._context is not None:
      self._context.term()
