"""ZeroMQ transport: one multipart message per exchange, frames zero-copy.

The worker binds a ROUTER socket, the verifier connects a DEALER, over TCP
on loopback (`tcp://127.0.0.1:PORT`, port 0 picks a free one) or over ipc
(`ipc:///path`). One message is a list of wire frames; large frames travel
without a copy in either direction (`copy=False`): a sender's buffer is
handed to ZeroMQ, and `send` returns a tracker that says when ZeroMQ let go
of it, so a slot is not rewritten while its bytes are still queued. A
receiver gets the frames as `zmq.Frame` buffers that decode reads in place.
"""

import zmq

COPY_THRESHOLD = 64 * 1024   # smaller frames are cheaper to copy than to track


def _context():
  return zmq.Context.instance()


class Endpoint:
  """One socket: `bind` (worker, ROUTER) or `connect` (verifier, DEALER)."""

  def __init__(self, socket, address, routed):
    self.socket = socket
    self.address = address
    self._routed = routed

  @classmethod
  def bind(cls, address):
    """A ROUTER bound at `address`; tcp port 0 picks a free port."""
    socket = _context().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://") and address.endswith(":0"):
      port = socket.bind_to_random_port(address[:-2])
      address = f"{address[:-2]}:{port}"
    else:
      socket.bind(address)
    return cls(socket, address, routed=True)

  @classmethod
  def connect(cls, address):
    """A DEALER connected to `address` (reconnects by itself)."""
    socket = _context().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RECONNECT_IVL, 20)
    socket.connect(address)
    return cls(socket, address, routed=False)

  def send(self, frames, peer=None):
    """Sends `frames` (buffers) as one message; returns a MessageTracker.

    peer: the routing id a ROUTER answers (from `recv`).
    """
    parts = ([peer] if self._routed else []) + list(frames)
    copy = [len(memoryview(p)) < COPY_THRESHOLD for p in parts]
    tracker = None
    for i, part in enumerate(parts):
      flags = zmq.SNDMORE if i + 1 < len(parts) else 0
      if copy[i]:
        self.socket.send(part, flags, copy=True)
      else:
        tracker = self.socket.send(part, flags, copy=False, track=True)
    return tracker

  def recv(self, timeout_s):
    """(peer, frames) of the next message, or None after `timeout_s`.

    frames: memoryviews onto ZeroMQ's buffers (valid while referenced).
    """
    if not self.socket.poll(max(0, int(timeout_s * 1000))):
      return None
    parts = self.socket.recv_multipart(copy=False)
    peer = parts.pop(0).bytes if self._routed else None
    return peer, [p.buffer for p in parts]

  def close(self):
    self.socket.close(linger=0)
