"""The worker loop: answers HELLO, STEP, COMMIT and RESET over a ROUTER.

One STEP message holds one STEP frame per request of a batch; the answer is
one message with, per request, its D REPLY frames then its COMPLETION, all
written into one of the preallocated slot buffers and sent without a copy.

Per request the worker keeps its committed view (anchor, last token, prefix
digest, from COMMITs) and the reply of the latest round it served:

* a STEP of a newer round draws a new proposal (PROPOSAL keys of that
  seed, generation, round and position); a newer generation first drops
  every speculative state of the request;
* a STEP of the round just served is a retry: the cached frames are sent
  again, byte for byte (no key is ever drawn twice);
* an older round or generation is refused (DUPLICATE_ROUND,
  STALE_GENERATION) and counted; nothing is drawn or sent for it;
* a STEP whose anchor or digest disagrees with the committed view (a COMMIT
  was lost) resyncs the view from the STEP, counted as an event.

Run it as its own process with `serve`; `experiments/bridge_worker.py` is
the command-line entry point.
"""

import threading
import time

from absl import logging

from dyadic_jax.bridge import digest as digest_lib
from dyadic_jax.bridge import hello
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.transport import Endpoint
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import Kind

POLICY_GREEDY = 0
POLICY_SAMPLED = 1


class _View:
  """What the worker knows of one request."""

  def __init__(self):
    self.generation = 0       # newest generation seen (older are stale)
    self.round = -1           # newest round served in that generation
    self.anchor = None        # committed view: next position
    self.last_token = None
    self.digest = None
    self.proposal = None      # tokens of the served round (for COMMIT)
    self.cached = None        # (slot, frames) of the served round
    self.committed = (-1, -1)  # (generation, round) of the last COMMIT


class Worker:
  """Serves proposals for a verifier. Not thread safe: one loop owns it."""

  def __init__(self, caps, propose_fn, *, counters=None):
    self.caps = caps
    self.propose = propose_fn
    self.counters = counters or Counters("worker")
    self.session = None
    self.views = {}
    self._buffers = None      # slot frame buffers, allocated after HELLO
    self._trackers = None
    self._next_slot = 0
    self._sending = set()     # slots whose buffers the last answer refers to

  def warmup(self):
    """Compiles the proposer before the first STEP (a STEP must not wait
    for a compile past the verifier's deadline). The draw uses a seed no
    request is given (-1 as uint64) and is thrown away."""
    self.propose(2 ** 64 - 1, 0, 0, 0, 0, self.caps.max_depth)

  # -- HELLO -----------------------------------------------------------------

  def _hello(self, frame):
    try:
      theirs, session = hello.decode_hello(frame)
      hello.negotiate(self.caps, theirs)
    except ProtocolError as e:
      self.counters.reject(e.code, str(e))
      peeked = codec.peek(frame)
      return [codec.encode(Kind.RESET, session=peeked[1] if peeked else 0,
                           generation=0, round_id=0,
                           body={"request": layouts.ALL_REQUESTS,
                                 "reason": e.code},
                           version=self.caps.mode)]
    if session != self.session:
      self.session, self.views = session, {}
      if self._buffers is None:   # sized from the agreed bounds, once
        size = self.caps.max_reply_bytes // self.caps.max_requests
        self._buffers = [[bytearray(size)
                          for _ in range(self.caps.max_requests)]
                         for _ in range(self.caps.max_slots)]
        self._trackers = [[] for _ in range(self.caps.max_slots)]
    self.counters.event("hellos")
    return [hello.hello_frame(self.caps, session)]

  # -- messages --------------------------------------------------------------

  def handle(self, frames):
    """Answers one message (a list of frame buffers): frames or None."""
    self._sending = set()
    if not frames:
      self.counters.reject(Code.BAD_SEQUENCE, "empty message")
      return None
    peeked = codec.peek(frames[0])
    if peeked and peeked[0] == Kind.HELLO:
      return self._hello(frames[0])
    if self.session is None or (peeked and peeked[1] != self.session):
      self.counters.reject(Code.UNKNOWN_SESSION, str(peeked))
      if not peeked or peeked[0] != Kind.STEP:
        return None        # only a STEP waits for an answer
      # Tagged like the STEP, so that a late one is recognized as stale.
      return [codec.encode(Kind.RESET, session=peeked[1], generation=peeked[2],
                           round_id=peeked[3],
                           body={"request": layouts.ALL_REQUESTS,
                                 "reason": Code.UNKNOWN_SESSION},
                           version=self.caps.mode)]
    try:
      decoded = [codec.decode(f, self.caps.bounds) for f in frames]
    except ProtocolError as e:
      self.counters.reject(e.code, "in a verifier message")
      return None
    kinds = {int(f.header["kind"]) for f in decoded}
    if len(kinds) != 1 or any(int(f.header["session"]) != self.session
                              for f in decoded):
      self.counters.reject(Code.BAD_SEQUENCE, f"mixed message {kinds}")
      return None
    kind = kinds.pop()
    if kind == Kind.STEP:
      return self._steps(decoded)
    if kind == Kind.COMMIT:
      for f in decoded:
        self._commit(f)
    elif kind == Kind.RESET:
      for f in decoded:
        self._reset(f)
    else:
      self.counters.reject(Code.BAD_SEQUENCE, f"{Kind(kind).name} to worker")
    return None

  def _steps(self, steps):
    if len(steps) > self.caps.max_requests:
      self.counters.reject(Code.ABSURD_LENGTH, f"{len(steps)} requests")
      return None
    fresh, out = [], []
    for f in steps:
      r = int(f.body["request"])
      gen, rnd = int(f.header["generation"]), int(f.header["round"])
      view = self.views.setdefault(r, _View())
      if gen < view.generation:
        self.counters.reject(Code.STALE_GENERATION, f"request {r} gen {gen}")
      elif gen == view.generation and rnd == view.round and view.cached:
        self.counters.event("retries_served")
        self._sending.add(view.cached[0])
        out.extend(view.cached[1])
      elif gen == view.generation and rnd <= view.round:
        self.counters.reject(Code.DUPLICATE_ROUND, f"request {r} round {rnd}")
      else:
        fresh.append((f, view))
    if fresh:
      slot = self._take_slot()
      self._sending.add(slot)
      for i, (f, view) in enumerate(fresh):
        out.extend(self._serve(f, view, slot, i))
    return out or None

  def _take_slot(self):
    # Round robin; wait until ZeroMQ released the slot's previous frames,
    # and forget the cached replies that lived in it.
    slot = self._next_slot
    self._next_slot = (slot + 1) % self.caps.max_slots
    for tracker in self._trackers[slot]:
      tracker.wait()
    self._trackers[slot] = []
    for view in self.views.values():
      if view.cached and view.cached[0] == slot:
        view.cached = None
    return slot

  def track(self, tracker):
    """Keeps the slots of the last answer until ZeroMQ has sent it."""
    if tracker is not None:
      for slot in self._sending:
        self._trackers[slot].append(tracker)

  def _serve(self, step, view, slot, index):
    r = int(step.body["request"])
    gen, rnd = int(step.header["generation"]), int(step.header["round"])
    if gen > view.generation:
      view.cached = view.proposal = None   # a new generation: drop it all
    view.generation, view.round = gen, rnd
    anchor, last = int(step.body["anchor"]), int(step.body["last_token"])
    # numpy drops an S32 field's trailing NUL bytes: the digest has 32.
    prefix = bytes(step.body["prefix_digest"]).ljust(32, b"\0")
    depth = int(step.body["depth"])
    if (view.anchor, view.last_token, view.digest) != (anchor, last, prefix):
      if view.anchor is not None:
        self.counters.event("resyncs")
      view.anchor, view.last_token, view.digest = anchor, last, prefix
    header = dict(session=self.session, generation=gen, round_id=rnd,
                  version=self.caps.mode)
    status = 0
    sampled = int(step.body["policy"]) == POLICY_SAMPLED
    if sampled == self.caps.greedy:
      status = (Code.SAMPLED_ON_GREEDY if self.caps.greedy
                else Code.BAD_SEQUENCE)
    elif not 1 <= depth <= self.caps.max_depth or not (
        0 <= last < self.caps.vocab):
      status = Code.ABSURD_LENGTH
    frames = []
    if status:
      self.counters.reject(status, f"STEP of request {r}")
      depth = 0
    else:
      start = time.perf_counter()
      proposal = self.propose(int(step.body["seed"]), gen, rnd, anchor, last,
                              depth)
      self.counters.event("propose_us",
                          int((time.perf_counter() - start) * 1e6))
      view.proposal = proposal.tokens
      buf = memoryview(self._buffers[slot][index])
      offset = 0
      for i in range(depth):
        values = ids = None
        if not self.caps.greedy:
          n = int(proposal.n[i])
          values = proposal.values[i, :n]
          if proposal.ids is not None:
            ids = proposal.ids[i, :n]
        frame = codec.encode(
            Kind.REPLY, body={"request": r, "position": i,
                              "token": int(proposal.tokens[i]),
                              "mass": 0 if self.caps.greedy else 1 << 24},
            values=values, ids=ids, out=buf[offset:], **header)
        frames.append(frame)
        offset += len(frame)
    crc = 0
    for frame in frames:     # from each frame's own CRC: no second pass
      crc = codec.frame_crc(frame, crc)
    frames.append(codec.encode(
        Kind.COMPLETION, body={
            "request": r, "depth": depth, "status": int(status),
            "replies_crc": crc, "reply_bytes": sum(len(f) for f in frames),
            "anchor": anchor,
            "context_version": int(step.body["context_version"])},
        **header))
    view.cached = (slot, frames)
    self.counters.event("proposals")
    return frames

  def _commit(self, f):
    r = int(f.body["request"])
    tag = (int(f.header["generation"]), int(f.header["round"]))
    view = self.views.setdefault(r, _View())
    if tag <= view.committed:
      code = (Code.STALE_GENERATION if tag[0] < view.committed[0]
              else Code.DUPLICATE_ROUND)
      self.counters.reject(code, f"COMMIT of request {r} {tag}")
      return
    fallback = bool(int(f.body["fallback"]))
    if tag != (view.generation, view.round):
      # A round this worker never served (its STEP was lost): the verifier
      # fell back, so the committed token is the target-only one.
      self.counters.event("commits_unserved")
      view.generation, view.round, view.proposal = tag[0], tag[1], None
    committed = [] if fallback or view.proposal is None else list(
        view.proposal[:int(f.body["accepted"])])
    committed.append(int(f.body["next_token"]))
    view.digest = (None if view.digest is None or view.proposal is None
                   and not fallback else
                   digest_lib.extend(view.digest, committed))
    view.anchor = int(f.body["new_position"])
    view.last_token = committed[-1]
    view.cached = view.proposal = None
    view.committed = tag
    self.counters.event("commits")

  def _reset(self, f):
    r = int(f.body["request"])
    gen = int(f.header["generation"])
    targets = (list(self.views) if r == layouts.ALL_REQUESTS else [r])
    for key in targets:
      view = self.views.setdefault(key, _View())
      view.cached = view.proposal = None
      if gen > view.generation:   # a new generation: no round served in it
        view.generation, view.round = gen, -1
    self.counters.event("resets")

  # -- the loop --------------------------------------------------------------

  def serve(self, endpoint, stop=None, idle_s=0.05):
    """Answers messages on `endpoint` until `stop` (an Event) is set."""
    stop = stop or threading.Event()
    while not stop.is_set():
      got = endpoint.recv(idle_s)
      if got is None:
        continue
      peer, frames = got
      out = self.handle(frames)
      if out:
        self.track(endpoint.send(out, peer))


def serve_forever(caps, propose_fn, address, *, ready=None, on_exit=None):
  """Binds `address` and serves until interrupted (SystemExit, Ctrl-C).

  ready(address) is called once the proposer is compiled and the socket
  bound; on_exit(worker) when the loop ends, whatever ended it.
  """
  endpoint = Endpoint.bind(address)
  worker = Worker(caps, propose_fn)
  worker.warmup()
  logging.info("worker listening on %s", endpoint.address)
  if ready:
    ready(endpoint.address)
  try:
    worker.serve(endpoint)
  except (SystemExit, KeyboardInterrupt):
    pass
  finally:
    worker.counters.log()
    if on_exit:
      on_exit(worker)
    endpoint.close()
