"""A worker and a verifier over real ZeroMQ sockets, for the bridge tests.

The worker runs in a thread and can be told to tamper with its next
answer (`Tampering.tamper`): the bytes then travel through the real
transport and the real decoder, as a faulty worker's would.
"""

import contextlib
import functools
import threading

import crc32c
import numpy as np

from dyadic_jax import bridge
from dyadic_jax.testing import toy_models
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.layouts import Kind, Representation
from tests import wire_edits

V = 16
DEPTH = 3
_TOYS = {}


def toy(vocab=V):
  if vocab not in _TOYS:
    _TOYS[vocab] = toy_models.make_toy(toy_models.ToyConfig(
        vocab=vocab, closeness=0.7))
  return _TOYS[vocab]


def caps(representation=Representation.SPARSE, **kw):
  kw.setdefault("vocab", V)
  kw.setdefault("max_depth", DEPTH)
  kw.setdefault("max_requests", 2)
  kw.setdefault("max_support", 4)
  return bridge.Capabilities(representation=representation, **kw)


def target_fn_for(model):
  def target_fn(prefix, draft):
    prev = np.concatenate([prefix[-1:], draft]).astype(np.int32)
    return np.asarray(toy_models.target_logits(model, prev))
  return target_fn


@functools.lru_cache(maxsize=None)
def proposer_for(c):
  """One compiled proposer per Capabilities (they are frozen, hashable)."""
  model = toy(c.vocab)
  return bridge.draft_proposer(
      lambda prev: toy_models.draft_logits(model, prev), c)


class Tampering(bridge.Worker):
  """A worker whose next answer can be rewritten (once) by `tamper`."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.tamper = None
    self.answers = []

  def handle(self, frames):
    out = super().handle(frames)
    if out is not None and self.tamper is not None:
      tamper, self.tamper = self.tamper, None
      out = tamper([bytes(f) for f in out])
    if out is not None:
      self.answers.append([bytes(f) for f in out])
    return out


reseal = wire_edits.reseal


def reframe(frames):
  """Recomputes each request's COMPLETION over its (edited) REPLY rows."""
  out, group = [], []
  for f in frames:
    if codec.peek(f)[0] != Kind.COMPLETION:
      group.append(f)
      continue
    buf = bytearray(f)
    body = np.frombuffer(buf, layouts.BODIES[Kind.COMPLETION], 1,
                         layouts.HEADER.itemsize)
    crc = 0
    for row in group:
      crc = crc32c.crc32c(row, crc)
    body["replies_crc"] = crc
    body["reply_bytes"] = sum(len(r) for r in group)
    out.extend(group + [reseal(bytes(buf))])
    group = []
  return out + group


def reply_rows(frame, bounds):
  """(body dict, values, ids) of a REPLY frame."""
  got = codec.decode(frame, bounds, validate_rows=False)
  body = {n: got.body[n].item() for n in got.body.dtype.names}
  values = None if got.values is None else np.array(got.values)
  ids = None if got.ids is None else np.array(got.ids)
  return body, values, ids, got.header


def rewrite_reply(frame, bounds, *, values=None, ids=None, token=None,
                  sparse=None):
  """A REPLY frame with new q values/ids/token, correctly framed."""
  body, old_values, old_ids, header = reply_rows(frame, bounds)
  values = old_values if values is None else values
  ids = old_ids if ids is None and sparse is not False else ids
  if token is not None:
    body["token"] = token
  body.pop("representation")
  body.pop("count")
  return codec.encode(Kind.REPLY, session=int(header["session"]),
                      generation=int(header["generation"]),
                      round_id=int(header["round"]), body=body,
                      values=values, ids=ids,
                      version=int(header["version"]))


@contextlib.contextmanager
def running(c, *, worker_cls=Tampering, timeout_s=1.0, address=None,
            verify_fn=None):
  """(worker, verifier) over ZeroMQ with 2 requests added; tears down."""
  endpoint = bridge.Endpoint.bind(address or "tcp://127.0.0.1:0")
  worker = worker_cls(c, proposer_for(c))
  worker.warmup()
  stop = threading.Event()
  thread = threading.Thread(target=worker.serve, args=(endpoint, stop),
                            daemon=True)
  thread.start()
  kwargs = {} if verify_fn is None else {"verify_fn": verify_fn}
  verifier = bridge.Verifier(c, endpoint.address,
                             target_fn=target_fn_for(toy(c.vocab)),
                             timeout_s=timeout_s, **kwargs)
  try:
    verifier.open()
    for rid in range(c.max_requests):
      verifier.add_request(rid, [rid + 1], seed=100 + rid)
    yield worker, verifier
  finally:
    stop.set()
    thread.join()
    verifier.close()
    endpoint.close()
