"""A worker and a verifier over real ZeroMQ sockets, for the bridge tests.

The worker runs in a thread and can be told to tamper with its next
answer (`Tampering.tamper`): the edited bytes then travel through the real
transport and the real decoder, as a faulty worker's would. Edits that
must look like the worker's own (an honest but buggy worker) are resealed
with the worker's session key (`reseal`, `reframe`).
"""

import contextlib
import functools
import hashlib
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np

from dyadic_jax import bridge
from dyadic_jax.bridge.effects import Send
from dyadic_jax.wire import auth, codec, layouts
from dyadic_jax.wire.layouts import FIXED_BYTES, Kind, Representation
from dyadic_jax.models import toy_pair
from tests import wire_edits

V = 16
DEPTH = 3
SECRET = bytes(range(32))
_TOYS = {}


def toy(vocab=V):
  if vocab not in _TOYS:
    _TOYS[vocab] = toy_pair.make_toy(toy_pair.ToyConfig(
        vocab=vocab, closeness=0.7))
  return _TOYS[vocab]


def caps(representation=Representation.SPARSE, **kw):
  """Test capabilities. Per-frame answers (REPLY + COMPLETION, features 0)
  unless `features` is given: the tests that edit those frames keep
  testing that form; tests/bridge/test_packed.py tests PACKED answers."""
  kw.setdefault("features", 0)
  kw.setdefault("vocab", V)
  kw.setdefault("max_depth", DEPTH)
  kw.setdefault("max_requests", 2)
  kw.setdefault("max_support", 4)
  return bridge.Capabilities(representation=representation, **kw)


def target_fn_for(model):
  def target_fn(prefix, draft):
    prev = np.concatenate([prefix[-1:], draft]).astype(np.int32)
    return np.asarray(toy_pair.target_logits(model, prev))
  return target_fn


@functools.lru_cache(maxsize=None)
def proposer_for(c):
  """One compiled proposer per Capabilities (they are frozen, hashable)."""
  model = toy(c.vocab)
  return bridge.draft_proposer(
      lambda prev: toy_pair.draft_logits(model, prev), c)


class Tampering(bridge.Worker):
  """A worker whose next answer can be rewritten (once) by `tamper`.

  tamper(messages, tagger) -> messages: the answer's messages as bytes, and
  the worker's session tagger (to reseal edits); None drops the answer.
  """

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("secret", SECRET)
    super().__init__(*args, **kwargs)
    self.tamper = None
    self.answers = []

  def handle(self, message):
    out = super().handle(message)
    if out and self.tamper is not None:
      tamper, self.tamper = self.tamper, None
      tagger = self.session.established.keys.send
      edited = tamper([bytes(s.message) for s in out], tagger)
      for s in out:
        if s.slot is not None:
          self.session.released(s.slot)
      out = [Send(m) for m in (edited or [])]
    self.answers.append([bytes(s.message) for s in out])
    return out


def draw_half_rows(props):
  """A session proposer's stand-in (`Propose` effects): valid rows, half
  the mass on ids 0 and 1, token 0."""
  for p in props:
    r = p.rows
    for i in range(p.depth):
      r.values[i] = 0
      r.values[i, :2] = 0.5
      r.n[i] = r.values.shape[1]
      if r.ids is not None:
        r.ids[i] = np.arange(r.values.shape[1])
      r.tokens[i] = 0


def draw_keyed_rows(props):
  """`draw_half_rows` with each drafted token (0 or 1, both with q 1/2)
  a function of every field the worker read from the request's STEP
  (seed, tags, anchor, last token, position): two sessions commit the same
  tokens only if their workers read the same STEPs."""
  draw_half_rows(props)
  for p in props:
    key = hashlib.blake2b(repr((p.seed, p.generation, p.round, p.anchor,
                                p.last_token)).encode(), digest_size=8)
    bits = int.from_bytes(key.digest(), "little")
    p.rows.tokens[:p.depth] = [(bits >> i) & 1 for i in range(p.depth)]


def frames(message):
  """The frames of a message, as bytes."""
  return [bytes(f) for f in codec.split(message, max_frames=1 << 20,
                                        max_bytes=1 << 40)]


def join(frame_list):
  return b"".join(frame_list)


reseal = wire_edits.reseal


def set_field(frame, kind, name, value, tagger=None):
  """A frame with one body field rewritten (resealed when tagger given)."""
  buf = bytearray(frame)
  dtype = layouts.BODIES[kind]
  rec = np.frombuffer(buf, dtype, 1, layouts.HEADER_BYTES)
  rec[name] = value
  return reseal(buf, tagger) if tagger is not None else bytes(buf)


def reply_rows(frame, c):
  """(body, Rows copies) of a REPLY frame."""
  got = codec.decode(frame, c.bounds)
  rows = got.rows
  copy = lambda a: None if a is None else np.array(a)
  return got.body, type(rows)(*(copy(a) for a in rows))


def rewrite_reply(frame, c, tagger, *, tokens=None, n=None, ids=None,
                  values=None):
  """A REPLY frame with new rows (same shape), resealed."""
  buf = bytearray(frame)
  got = codec.decode(buf, c.bounds)
  rows = got.rows
  for name, new in (("tokens", tokens), ("n", n), ("ids", ids),
                    ("values", values)):
    if new is not None:
      getattr(rows, name)[...] = new
  return reseal(buf, tagger)


def reframe(frame_list, tagger):
  """Recomputes each COMPLETION's reply size and tag over its REPLY."""
  out = list(frame_list)
  for i, f in enumerate(out):
    if codec.peek(f)[0] == Kind.COMPLETION and i and codec.peek(
        out[i - 1])[0] == Kind.REPLY:
      buf = bytearray(f)
      body = np.frombuffer(buf, layouts.BODIES[Kind.COMPLETION], 1,
                           layouts.HEADER_BYTES)
      body["reply_bytes"] = len(out[i - 1])
      body["reply_tag"] = auth.tag_of(out[i - 1])
      out[i] = reseal(buf, tagger)
  return out


def completion_of(frame_list, rid):
  """Index of request rid's COMPLETION in a message's frames."""
  for i, f in enumerate(frame_list):
    if codec.peek(f)[0] == Kind.COMPLETION and codec.decode(
        f, codec.HELLO_BOUNDS).body.request == rid:
      return i
  raise ValueError(f"no COMPLETION of request {rid}")


COMPLETION_BYTES = FIXED_BYTES[Kind.COMPLETION]

# A verifier deadline no healthy exchange misses, however loaded the
# machine: tests that need a timeout make it happen (`WarpClock`), they do
# not wait for one.
GENEROUS_S = 60.0


class WarpClock:
  """A verifier clock that tests move forward: monotonic time plus warps.

  `warp()` (any thread) moves it past any deadline set so far, e.g. when a
  fault-injecting proxy lost an exchange (`Proxy(on_lost=clock.warp)`):
  the verifier times the exchange out at once, under a deadline that is
  otherwise generous. What a test asserts then depends on the faults it
  injects, never on how fast the machine is.
  """

  def __init__(self, step_s=10 * GENEROUS_S):
    self.step_s = step_s
    self.offset = 0.0
    self.warps = 0
    self._lock = threading.Lock()

  def __call__(self):
    return time.monotonic() + self.offset

  def warp(self):
    with self._lock:
      self.offset += self.step_s
      self.warps += 1


class WarpOnReject(bridge.Counters):
  """Counters that warp `clock` after counting one of `codes`: the
  exchange a refused message belonged to times out once the refusal is
  counted (not before: the count is what a test checks)."""

  def __init__(self, name, clock, codes):
    super().__init__(name)
    self.clock = clock
    self.codes = set(codes)

  def reject(self, code, detail=""):
    super().reject(code, detail)
    if code in self.codes:
      self.clock.warp()


class WarpVerifier(bridge.Verifier):
  """A Verifier on a `WarpClock` whose socket waits in short slices, so a
  warp ends the wait it happens in (the real driver waits once, until the
  deadline)."""

  def __init__(self, *args, clock, slice_s=0.01, **kwargs):
    self.slice_s = slice_s
    super().__init__(*args, clock=clock, **kwargs)

  def _zmq_connect(self, address, max_message):
    endpoint = super()._zmq_connect(address, max_message)
    recv = endpoint.recv
    endpoint.recv = lambda timeout_s: recv(min(timeout_s, self.slice_s))
    return endpoint


class ExpiringVerifier(WarpVerifier):
  """A WarpVerifier that ends one exchange when told: `expire(tags)` (any
  thread; e.g. `Proxy(on_lost=verifier.expire)`) names an exchange by its
  (request, generation, round) tags (all, or some: a message may carry
  part of its exchange), and the driver's thread ends that
  exchange alone (TIMEOUT, `VerifierSession.poll` of its key) once its
  socket holds nothing more (a wait of one slice returned nothing, so
  what was sent before the name was read first, as a deadline reads
  it): the other exchange in flight keeps its deadline (a warp would end
  both). A name that matches no exchange in flight (it ended already) is
  dropped. `expire(None)` (the link was reset: what it carried is gone)
  ends every exchange in flight whose answer was not read yet, and
  records each one's tags in `reset_lost`. `expired` counts the
  exchanges it ended."""

  def __init__(self, *args, clock=time.monotonic, **kwargs):
    self._to_expire = []
    self._expire_lock = threading.Lock()
    self.expired = 0
    self.reset_lost = []
    super().__init__(*args, clock=clock, **kwargs)

  def expire(self, tags):
    with self._expire_lock:
      self._to_expire.append(None if tags is None else frozenset(
          tuple(int(x) for x in t) for t in tags))

  def _zmq_connect(self, address, max_message):
    endpoint = super()._zmq_connect(address, max_message)
    recv = endpoint.recv

    def recv_then_expire(timeout_s):
      with self._expire_lock:
        named = len(self._to_expire)     # names given before this wait
      got = recv(self.slice_s if named else timeout_s)
      if got is None and named:
        self._end_expired(named)
      return got
    endpoint.recv = recv_then_expire
    return endpoint

  def _end_expired(self, n):
    with self._expire_lock:
      lost, self._to_expire = self._to_expire[:n], self._to_expire[n:]
    session = self.session
    for tags in lost:
      for ex in list(session.exchanges.values()):
        named = frozenset((r,) + ex.tags[r] for r in ex.rids)
        if ex.staging or not (tags is None or tags and tags <= named):
          continue
        for effect in session.poll(math.inf, ex.key):
          self._ended[effect.key] = effect    # what `finish` picks up
        self.expired += 1
        if tags is None:
          self.reset_lost.append(named)


def drive(verifier, groups, rounds, in_flight=1, before_start=None):
  """`rounds` rounds of each group of requests (lists of ids); returns the
  RoundResults of each round in the order they were finished.

  in_flight 1: a round at a time, group after group. 2: pipelined, as
  `generate` runs groups: a group's round r + 1 starts as soon as its
  round r is finished, while the other group's round is out (every start
  but the first overlaps another round). The committed tokens are the
  same either way (each request's keys are its own).
  before_start(group, r, others): called before each start (others: the
  `InFlight`s of the other groups then out).
  """
  if in_flight == 1:
    out = []
    for r in range(rounds):
      for group in groups:
        if before_start is not None:
          before_start(group, r, [])
        out.append(verifier.round(group))
    return out
  assert in_flight == 2, in_flight
  flights, out = [], []

  def start(g, r):
    if before_start is not None:
      before_start(groups[g], r, flights[:g] + flights[g + 1:])
    return verifier.start(groups[g])

  for g in range(len(groups)):
    flights.append(start(g, 0))
  for r in range(rounds):
    for g in range(len(groups)):
      out.append(verifier.finish(flights[g]))
      if r + 1 < rounds:
        flights[g] = start(g, r + 1)
  return out


class Served:
  """A worker's loop in a thread behind a real ROUTER (`serve`)."""

  def __init__(self, worker, endpoint):
    self.worker = worker
    self.endpoint = endpoint
    self.address = worker.address = endpoint.address
    self.stop_event = threading.Event()
    self.thread = threading.Thread(target=worker.serve,
                                   args=(endpoint, self.stop_event),
                                   daemon=True)
    self.thread.start()

  def close(self):
    self.stop_event.set()
    self.thread.join(10)
    assert not self.thread.is_alive(), "the worker loop is stuck"
    self.endpoint.close()


def serve(worker, address="tcp://127.0.0.1:0", curve=None):
  """Binds `address` for `worker`, compiles its proposer, serves it."""
  endpoint = bridge.Endpoint.bind(address, max_message=worker.max_message,
                                  curve=curve)
  worker.warmup()
  return Served(worker, endpoint)


def start_worker_process(*args):
  """(process, address): this module run as a worker process (`args` on
  its command line), once it printed READY; killed if it exits first or
  makes no progress (`no_leftovers.wait_for_line`: no fixed deadline, a
  loaded machine only slows it). The caller kills it."""
  from tests import no_leftovers  # pylint: disable=g-import-not-at-top
  from tests import paths  # pylint: disable=g-import-not-at-top
  proc = subprocess.Popen(
      [sys.executable, "-m", "tests.bridge_harness", *args], cwd=paths.ROOT,
      env=paths.subprocess_env(JAX_PLATFORMS="cpu"), stdin=subprocess.PIPE,
      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  try:
    line = no_leftovers.wait_for_line(proc, proc.stdout, "READY ")
  except BaseException:
    proc.kill()
    proc.wait()
    raise
  return proc, line.split()[1]


def rss_kb(pid):
  """Resident set size of process `pid` in KB (Linux /proc)."""
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1])
  raise ValueError(f"no VmRSS for process {pid}")


def serve_until_stdin_closes(worker, curve=None):
  """A worker process's loop: prints READY <address>, serves until its
  stdin closes (the parent's signal to stop)."""
  import sys  # pylint: disable=g-import-not-at-top
  endpoint = bridge.Endpoint.bind("tcp://127.0.0.1:0",
                                  max_message=worker.max_message,
                                  curve=curve)
  worker.warmup()
  stop = threading.Event()
  threading.Thread(target=lambda: (sys.stdin.read(), stop.set()),
                   daemon=True).start()
  print("READY", endpoint.address, flush=True)
  worker.serve(endpoint, stop)
  endpoint.close()


@contextlib.contextmanager
def running(c, *, worker_cls=Tampering, timeout_s=GENEROUS_S, address=None,
            verify_fn=None, secret=SECRET, sampling_audit=True,
            requests=None):
  """(worker, verifier) over ZeroMQ with `requests` added; tears down.

  The verifier is a `WarpVerifier`: a test that needs an exchange to time
  out calls `verifier.clock.warp()` (or counts with `WarpOnReject`)."""
  served = serve(worker_cls(c, proposer_for(c), secret=secret),
                 address or "tcp://127.0.0.1:0")
  kwargs = {} if verify_fn is None else {"verify_fn": verify_fn}
  verifier = WarpVerifier(c, served.address,
                          target_fn=target_fn_for(toy(c.vocab)),
                          timeout_s=timeout_s, secret=secret,
                          sampling_audit=sampling_audit, clock=WarpClock(),
                          **kwargs)
  try:
    verifier.open()
    for rid in range(c.max_requests if requests is None else requests):
      verifier.add_request(rid, [rid + 1], seed=100 + rid)
    yield served.worker, verifier
  finally:
    served.close()
    verifier.close()


def random_secret():
  return os.urandom(auth.SECRET_BYTES)


def worker_main():
  """A worker process (`python -m tests.bridge_harness [KEYS_DIR]`): the
  SPARSE caps on a free port, until its stdin closes; with SECRET, or with
  KEYS_DIR's keys as `bridge.keys.load` gives them by default."""
  import sys  # pylint: disable=g-import-not-at-top
  from dyadic_jax.bridge import keys  # pylint: disable=g-import-not-at-top
  c = caps()
  secret, curve = SECRET, None
  if len(sys.argv) > 1:
    secret, curve = keys.load(sys.argv[1], "worker")
  serve_until_stdin_closes(bridge.Worker(c, proposer_for(c), secret=secret),
                           curve)


if __name__ == "__main__":
  worker_main()
