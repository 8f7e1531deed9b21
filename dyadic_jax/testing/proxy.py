"""A loopback fault-injection proxy between a verifier and a worker.

    verifier DEALER --> front ROUTER [proxy] back DEALER --> worker ROUTER

The proxy binds a ROUTER at `front_address` (the verifier connects there
instead of to the worker), connects a DEALER to the worker's `back_address`
and forwards whole messages both ways from one background thread. A bridge
message is one ZeroMQ part holding wire frames back to back; the proxy
cuts it into its frames by their length fields (faults act on frames) and
joins them again to send. It is a test tool (`dyadic_jax.testing`: the
library never imports it): it never decodes a frame for its own use, it
only peeks at headers (`codec.peek`) and at the `request` field of a body,
to know which exchange a message belongs to. It holds no key: every frame
it damages fails authentication at the receiver.

With probability `rate` each STEP message (verifier -> worker) and each
reply message (REPLY/COMPLETION frames, worker -> verifier) gets one fault,
drawn from `kinds` by a numpy Generator seeded with `seed`, the direction
and the message's tags (so an exchange gets the same fault whatever the
order its messages and another exchange's cross the proxy in):

    delay      held until the verifier gave the exchange up (its COMMIT of
               the exchange passed the proxy; that happens only after its
               deadline), then delivered: a late reply, or a late STEP that
               reaches the worker right after that COMMIT
    drop       never delivered
    duplicate  delivered twice, back to back
    reorder    two distinct frames swapped
    truncate   1 to all bytes cut off the end of one frame
    corrupt    one bit flipped anywhere in one frame (header included)
    reset      dropped, and the proxy's `front`, `back` or `both` sockets
               closed and re-created (the connection reset a peer sees);
               the verifier's DEALER reconnects to the re-bound front by
               itself. Messages already queued in a closed socket are
               flushed for `reset_linger_s`, so that the only message lost
               is the dropped one and the test can account for it exactly.
    jitter     benign: held for a uniform time below `jitter_s` (well under
               the deadline), then delivered

After a fault in LOST has acted, `on_lost(tags)` is called (from the
proxy's thread) when given, with the lost exchange's tags: a test ends
that exchange there (tests/bridge_harness.py `ExpiringVerifier`), so that
the deadline can be generous (a loaded machine never times out a healthy
exchange) while a lost exchange costs no wall time.

Rounds in flight. The proxy follows each exchange from its STEP message to
its COMMIT (the verifier's end of it); with two rounds in flight (HELLO's
`max_slots`) another exchange may be in the link when a fault acts. A
`reset` loses what the link carried for every exchange in flight (an
answer the worker sends to a closed connection is gone, and so is a
message still queued in a socket the proxy closes), so after its own
exchange's `on_lost(tags)` it calls `on_lost(None)`: every exchange in
flight on the verifier may be lost (a test allows those a TIMEOUT; no
other fault kind reaches past its own exchange). `detail["in_flight"]`
records the others the proxy had seen a STEP of and no COMMIT yet.

An exchange is the set of (request, generation, round) tags its frames
carry (a STEP and its reply carry the same set). Each exchange gets AT MOST
ONE fault in both directions together, and copies the proxy itself sends
(late or duplicated messages) are never faulted again, so that every fault
maps to exactly one exchange and a test can account for each. HELLO, COMMIT
and RESET messages always pass untouched. `pause()` stops new faults (the
thread still releases held messages); `spare(tags)` exempts one exchange,
named before its STEP leaves (a clean drain round, whichever messages of
another exchange cross the proxy meanwhile).

Every fault is recorded as a `Fault` in `.faults`, in injection order;
`counts()` summarizes them by (direction, kind). The proxy serves one
verifier at a time (replies go to the routing id that spoke last).

    proxy = Proxy("tcp://127.0.0.1:0", worker_address, rate=0.04, seed=1,
                  deadline_s=0.25).start()
    verifier = bridge.Verifier(caps, proxy.address, target_fn=...,
                               secret=secret, timeout_s=0.25).open()
    ...
    proxy.stop()
    print(proxy.summary())

tests/system/test_soak.py accounts for every fault it injects.
"""

import collections
import threading
import time
import typing

from absl import logging
import numpy as np
import zmq

from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.layouts import Kind
from dyadic_jax.wire.refusals import ProtocolError

TO_WORKER = "to_worker"        # STEP messages (verifier -> worker)
TO_VERIFIER = "to_verifier"    # reply messages (worker -> verifier)

KINDS = ("delay", "drop", "duplicate", "reorder", "truncate", "corrupt",
         "reset")
BENIGN = ("jitter",)
# Kinds after which the exchange cannot arrive whole in time (`on_lost` is
# called). All of it is lost, except after a truncation that cut a whole
# frame: the other frames are authentic and still count.
LOST = ("delay", "drop", "truncate", "corrupt", "reset")
RESET_SOCKETS = ("front", "back", "both")

_POLL_MS = 5
_REBIND_S = 2.0                # how long a re-bind may wait for the port


class Fault(typing.NamedTuple):
  """One injected fault (a record; nothing here is used by the proxy).

  seq: injection order, from 0.
  direction: TO_WORKER (a STEP message) or TO_VERIFIER (a reply message).
  kind: one of KINDS or BENIGN.
  tags: sorted ((request, generation, round), ...) of the message's frames:
    the exchange. request is -1 where a body was too short to read.
  detail: kind parameters: frame, byte, bit (corrupt); frame, cut, kept
    (truncate); frames (reorder, the two indexes); sockets (reset);
    hold_s (jitter); released_s (delay and jitter: how long it was
    held); reset_s (how long closing and re-creating took); in_flight
    (reset: the tags of each other exchange in flight, lost with it).
  original: the message's frames as received (bytes), if keep_frames.
  damaged: the frames as delivered (corrupt, truncate, reorder), if
    keep_frames; None otherwise.
  """
  seq: int
  direction: str
  kind: str
  tags: tuple
  detail: dict
  original: tuple | None
  damaged: tuple | None


def _request_of(frame, kind):
  # The `request` field of the frame's body, unchecked (for records only).
  body = layouts.BODIES.get(kind)
  if body is None or "request" not in body.names:
    return -1
  offset = layouts.HEADER.itemsize + body.fields["request"][1]
  if len(frame) < offset + 2:
    return -1
  return int.from_bytes(frame[offset:offset + 2], "little")


# The frames of records, each with its count at the body's start.
_RECORDS = {Kind.PACKED: layouts.PACKED_RECORD,
            Kind.PACKED_STEP: layouts.STEP_RECORD}


def _packed_tags(frame, kind):
  # (request, generation, round) of each record of a PACKED or PACKED_STEP
  # frame, unchecked (for records only): as many whole records as it holds.
  start, record = layouts.FIXED_BYTES[kind], _RECORDS[kind]
  body = layouts.HEADER_BYTES
  count = int.from_bytes(frame[body:body + 2], "little") if len(
      frame) >= start else 0
  count = min(count, (len(frame) - start) // record.itemsize)
  records = np.frombuffer(frame, record, max(count, 0), start)
  return {(int(r["request"]), int(r["generation"]), int(r["round"]))
          for r in records}


def split(message):
  """The wire frames of one message part (bytes); the whole part as one
  frame when its length fields do not cut it cleanly."""
  try:
    return [bytes(f) for f in codec.split(message, max_frames=1 << 20,
                                          max_bytes=1 << 40)]
  except ProtocolError:
    return [bytes(message)]


def message_tags(frames):
  """Sorted unique (request, generation, round) of a message's frames."""
  tags = set()
  for frame in frames:
    peeked = codec.peek(frame)
    if peeked is None:
      continue
    try:
      kind = Kind(peeked[0])
    except ValueError:
      continue
    if kind in _RECORDS:
      tags.update(_packed_tags(frame, kind))
      continue
    tags.add((_request_of(frame, kind), peeked[2], peeked[3]))
  return tuple(sorted(tags))


def _kind_of(frames):
  peeked = codec.peek(frames[0]) if frames else None
  return None if peeked is None else peeked[0]


class _Held(typing.NamedTuple):
  """A message the proxy holds back (delay or jitter)."""
  direction: str
  frames: list
  tags: frozenset      # the exchange: released by its COMMIT (delay)
  release_at: float    # release time (jitter; a delay's upper bound)
  fault: int           # index into faults
  received: float


class Proxy:
  """The fault-injecting forwarder (see the module docstring).

  Args:
    front_address: where the verifier connects (tcp port 0: a free port;
      the bound address is `.address` after `start`).
    back_address: the worker's ROUTER address.
    rate: probability that an eligible message gets a fault.
    seed: seed of the numpy Generator that draws every fault.
    deadline_s: the verifier's exchange deadline; jitter stays below a
      tenth of it (`jitter_s`).
    hold_max_s: a delayed message whose exchange is never committed is
      released after this long (default: 10 s or 8 deadlines, the longer;
      a verifier busy compiling must not see its delayed reply early).
    kinds: the fault kinds to draw from (KINDS and BENIGN).
    weights: optional relative weights of `kinds` (default uniform).
    directions: which messages may get a fault: TO_WORKER (STEP messages),
      TO_VERIFIER (replies) or both (the default).
    reset_sockets: which sockets a reset re-creates, drawn uniformly.
    keep_frames: keep each faulted message's frames in its record.
    reset_linger_s: how long a closed socket may flush what it queued.
    on_lost: called with the tags of the exchange lost after a fault in
      LOST acted; after a reset, then with None (whatever was in flight).
  """

  def __init__(self, front_address, back_address, *, rate, seed, deadline_s,
               kinds=KINDS, weights=None, directions=(TO_WORKER, TO_VERIFIER),
               reset_sockets=RESET_SOCKETS,
               jitter_s=None, hold_max_s=None, keep_frames=True,
               reset_linger_s=0.5, on_lost=None):
    unknown = set(kinds) - set(KINDS) - set(BENIGN)
    if unknown or not kinds:
      raise ValueError(f"Proxy: unknown fault kinds {sorted(unknown)}")
    if not 0.0 <= rate <= 1.0:
      raise ValueError(f"Proxy: rate must be in [0, 1], got {rate}")
    if set(directions) - {TO_WORKER, TO_VERIFIER}:
      raise ValueError(f"Proxy: unknown directions {directions}")
    if weights is not None and len(weights) != len(kinds):
      raise ValueError("Proxy: one weight per kind")
    self.front_address = front_address
    self.back_address = back_address
    self.rate = float(rate)
    self.deadline_s = float(deadline_s)
    self.kinds = tuple(kinds)
    self.directions = tuple(directions)
    w = np.ones(len(kinds)) if weights is None else np.asarray(weights, float)
    self._p = w / w.sum()
    self.reset_sockets = tuple(reset_sockets)
    self.jitter_s = self.deadline_s / 10 if jitter_s is None else jitter_s
    self.hold_max_s = (max(10.0, 8 * self.deadline_s) if hold_max_s is None
                       else hold_max_s)
    self.keep_frames = keep_frames
    self.reset_linger_ms = int(reset_linger_s * 1000)
    self.on_lost = on_lost
    self.seed = int(seed)
    self.faults = []
    self.forwarded = collections.Counter()   # (direction, kind name) -> n
    self.unroutable = 0       # replies held until the verifier reconnected
    # Tags of the exchanges with a fault, and of those never to fault
    # (`spare`): a message is eligible if it carries none of them (an
    # answer to a STEP one frame short carries part of its exchange).
    self._faulted = set()
    self._spared = set()
    # Exchanges whose STEP message passed and whose COMMIT has not: what
    # the link may carry (frozenset of tags -> tags, in STEP order).
    self._open = {}
    self._held = []
    self._to_front = []       # replies waiting for a (re)connected verifier
    self._peer = None         # the verifier's routing id on the front socket
    self._paused = threading.Event()
    self._stop = threading.Event()
    self._ready = threading.Event()
    self._lock = threading.Lock()
    self._thread = None
    self._error = None
    self.address = None
    self._front = self._back = self._poller = None
    self._retarget = threading.Event()

  # -- control ---------------------------------------------------------------

  def start(self):
    """Binds the front, connects the back, starts forwarding; returns self."""
    self._thread = threading.Thread(target=self._run, name="bridge-proxy",
                                    daemon=True)
    self._thread.start()
    self._ready.wait(10)
    if self._error is not None:
      raise self._error
    if self.address is None:
      raise RuntimeError("Proxy: the forwarding thread did not start")
    return self

  def stop(self):
    """Stops the thread and closes both sockets (held messages are lost)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(10)
    if self._error is not None:
      raise RuntimeError("Proxy: the forwarding thread failed") from (
          self._error)

  def retarget(self, back_address):
    """Forwards to the worker at `back_address` from now on (a restarted
    worker on a new port): the forwarding thread reconnects its back."""
    self.back_address = back_address
    self._retarget.set()

  def pause(self):
    """No new faults until `resume` (held messages are still released)."""
    self._paused.set()

  def resume(self):
    self._paused.clear()

  def spare(self, tags):
    """No fault for the exchange of these (request, generation, round)
    tags (its STEP and its reply); call it before its STEP is sent."""
    with self._lock:
      self._spared.update(tuple(int(x) for x in t) for t in tags)

  def counts(self):
    """{(direction, kind): number of faults injected}."""
    with self._lock:
      return dict(collections.Counter((f.direction, f.kind)
                                      for f in self.faults))

  def summary(self):
    """Faults by kind and direction, and messages forwarded, as text."""
    counts = self.counts()
    lines = [f"{'fault':10s} {TO_WORKER:>10s} {TO_VERIFIER:>12s}"]
    for kind in self.kinds:
      lines.append(f"{kind:10s} {counts.get((TO_WORKER, kind), 0):10d} "
                   f"{counts.get((TO_VERIFIER, kind), 0):12d}")
    lines.append(f"{'total':10s} {len(self.faults):10d} faults; forwarded "
                 f"{dict(sorted(self.forwarded.items()))}")
    return "\n".join(lines)

  # -- sockets ---------------------------------------------------------------

  def _bind_front(self, address):
    context = zmq.Context.instance()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, self.reset_linger_ms)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if address.startswith("tcp://") and address.endswith(":0"):
      port = socket.bind_to_random_port(address[:-2])
      return socket, f"{address[:-2]}:{port}"
    # A re-bind right after a close can find the port still held by the
    # closing socket for a moment: retry until it is free.
    deadline = time.monotonic() + _REBIND_S
    while True:
      try:
        socket.bind(address)
        return socket, address
      except zmq.ZMQError as e:
        if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
          socket.close(0)
          raise
        time.sleep(0.005)

  def _connect_back(self):
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, self.reset_linger_ms)
    socket.setsockopt(zmq.RECONNECT_IVL, 20)
    socket.connect(self.back_address)
    return socket

  def _register(self):
    self._poller = zmq.Poller()
    self._poller.register(self._front, zmq.POLLIN)
    self._poller.register(self._back, zmq.POLLIN)

  def _reset(self, which):
    # Close (flushing what is already queued) and re-create: the peer sees
    # its connection drop and reconnect; the front gets a new routing id.
    if which in ("front", "both"):
      self._front.close()
      self._front, _ = self._bind_front(self.address)
      self._peer = None
    if which in ("back", "both"):
      self._back.close()
      self._back = self._connect_back()
    self._register()

  # -- the loop --------------------------------------------------------------

  def _run(self):
    try:
      self._front, self.address = self._bind_front(self.front_address)
      self._back = self._connect_back()
      self._register()
    except Exception as e:  # pylint: disable=broad-except
      self._error = e
      self._ready.set()
      return
    self._ready.set()
    try:
      while not self._stop.is_set():
        if self._retarget.is_set():
          self._retarget.clear()
          self._reset("back")
        events = dict(self._poller.poll(self._poll_ms()))
        if events.get(self._front):
          while self._front.poll(0):
            parts = self._front.recv_multipart()
            self._from_verifier(parts[0], [f for p in parts[1:]
                                           for f in split(p)])
        if events.get(self._back):
          while self._back.poll(0):
            self._from_worker([f for p in self._back.recv_multipart()
                               for f in split(p)])
        self._release_due()
    except Exception as e:  # pylint: disable=broad-except
      logging.exception("proxy thread failed")
      self._error = e
    finally:
      self._front.close(0)
      self._back.close(0)

  def _poll_ms(self):
    if not self._held:
      return _POLL_MS
    left = min(h.release_at for h in self._held) - time.monotonic()
    return max(0, min(_POLL_MS, int(left * 1000)))

  def _send_front(self, frames):
    if self._peer is None:
      self._to_front.append(frames)
      self.unroutable += 1
      return
    try:
      self._front.send_multipart([self._peer, b"".join(frames)])
    except zmq.ZMQError as e:
      if e.errno != zmq.EHOSTUNREACH:
        raise
      self._to_front.append(frames)   # the verifier is reconnecting
      self.unroutable += 1

  def _send_back(self, frames):
    self._back.send(b"".join(frames))

  def _send(self, direction, frames):
    name = _name(_kind_of(frames))
    self.forwarded[(direction, name)] += 1
    if direction == TO_WORKER:
      self._send_back(frames)
    else:
      self._send_front(frames)

  def _from_verifier(self, peer, frames):
    self._peer = peer
    pending, self._to_front = self._to_front, []
    for message in pending:
      self._send_front(message)
    kind = _kind_of(frames)
    if kind in (Kind.STEP, Kind.CONTEXT, Kind.PACKED_STEP):  # a STEP message
      tags = message_tags(frames)
      self._open[frozenset(tags)] = tags
      self._maybe_fault(TO_WORKER, frames)
      return
    self._send(TO_WORKER, frames)
    if kind == Kind.COMMIT:
      # The verifier gave these exchanges up or finished them: a delayed
      # message of theirs is now late, whatever the clock says.
      done = set(message_tags(frames))
      for key in [k for k in self._open if k & done]:
        del self._open[key]
      for held in [h for h in self._held if h.tags & done]:
        self._release(held)

  def _from_worker(self, frames):
    if _kind_of(frames) in (Kind.REPLY, Kind.COMPLETION, Kind.PACKED):
      self._maybe_fault(TO_VERIFIER, frames)
    else:
      self._send(TO_VERIFIER, frames)

  def _release_due(self):
    now = time.monotonic()
    for held in [h for h in self._held if h.release_at <= now]:
      self._release(held)

  def _release(self, held):
    self._held.remove(held)
    fault = self.faults[held.fault]
    fault.detail["released_s"] = round(time.monotonic() - held.received, 4)
    self._send(held.direction, held.frames)

  # -- faults ----------------------------------------------------------------

  def _maybe_fault(self, direction, frames):
    if direction not in self.directions:
      self._send(direction, frames)
      return
    tags = message_tags(frames)
    exchange = frozenset(tags)
    # A generator per message, from the seed, the direction and the tags:
    # an exchange's fault does not depend on how its messages interleave
    # with another exchange's.
    rng = np.random.default_rng([self.seed, int(direction == TO_VERIFIER)] + [
        x + 1 for t in tags for x in t])
    u = rng.random()
    with self._lock:
      spared = not exchange.isdisjoint(self._spared)
    if (self._paused.is_set() or spared or not exchange.isdisjoint(
        self._faulted)
        or u >= self.rate):
      self._send(direction, frames)
      return
    self._faulted.update(exchange)
    kind = str(rng.choice(self.kinds, p=self._p))
    if kind == "reorder" and len(frames) < 2:
      kind = "corrupt"          # nothing to swap in a one-frame message
    detail, damaged = {}, None
    if kind == "corrupt":
      i = int(rng.integers(len(frames)))
      frame = bytearray(frames[i])
      if frame:
        byte, bit = int(rng.integers(len(frame))), int(
            rng.integers(8))
        frame[byte] ^= 1 << bit
        detail = {"frame": i, "byte": byte, "bit": bit}
      damaged = frames[:i] + [bytes(frame)] + frames[i + 1:]
    elif kind == "truncate":
      i = int(rng.integers(len(frames)))
      cut = int(rng.integers(1, len(frames[i]) + 1)) if frames[i] else 0
      damaged = frames[:i] + [frames[i][:len(frames[i]) - cut]] + (
          frames[i + 1:])
      detail = {"frame": i, "cut": cut, "kept": len(frames[i]) - cut}
    elif kind == "reorder":
      i, j = sorted(int(x) for x in rng.choice(len(frames), 2,
                                                      replace=False))
      damaged = list(frames)
      damaged[i], damaged[j] = damaged[j], damaged[i]
      detail = {"frames": (i, j)}
    elif kind == "reset":
      detail = {"sockets": str(rng.choice(self.reset_sockets)),
                "in_flight": tuple(t for k, t in self._open.items()
                                   if k != exchange)}
    elif kind == "jitter":
      detail = {"hold_s": float(rng.uniform(0, self.jitter_s))}
    keep = self.keep_frames
    with self._lock:
      self.faults.append(Fault(
          len(self.faults), direction, kind, tags, detail,
          tuple(bytes(f) for f in frames) if keep else None,
          tuple(bytes(f) for f in damaged) if keep and damaged else None))
    index = len(self.faults) - 1
    now = time.monotonic()
    if kind in ("corrupt", "truncate", "reorder"):
      self._send(direction, damaged)
    elif kind == "duplicate":
      self._send(direction, frames)
      self._send(direction, frames)
    elif kind == "reset":
      self._reset(detail["sockets"])
      detail["reset_s"] = round(time.monotonic() - now, 4)
    elif kind == "delay":
      self._held.append(_Held(direction, frames, exchange,
                              now + self.hold_max_s, index, now))
    elif kind == "jitter":
      self._held.append(_Held(direction, frames, frozenset(),
                              now + detail["hold_s"], index, now))
    # drop: nothing is sent.
    if kind in LOST:
      self.lost(tags)
    if kind == "reset":
      self.lost(None)

  def lost(self, tags):
    """The exchange of these tags (None: every exchange in flight) cannot
    complete: tells `on_lost`."""
    if self.on_lost is not None:
      self.on_lost(tags)


def _name(kind):
  try:
    return Kind(kind).name
  except (TypeError, ValueError):
    return "unknown"
