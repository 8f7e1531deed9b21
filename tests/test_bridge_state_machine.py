"""A stateful test of the bridge protocol: a real Worker, a real Verifier.

The worker is driven directly through `Worker.handle` and the verifier
through its public calls (`round`, `reset`, `reconnect`, `open`); between
them sits an in-memory network (`FakeEndpoint`, the interface of
`transport.Endpoint`) that this machine controls, and a fake clock, so a
timeout costs nothing and every run is deterministic. The network can drop,
duplicate, delay, replay or corrupt messages; the worker can restart; a
second verifier can try a mismatched HELLO.

Rules: `open_session` (initial HELLO, maybe after a refused one), `step`
(clean round), `step_lost` (STEP or reply lost: timeout), `step_duplicated`
(reply or STEP twice: a retry), `step_commit_lost` (COMMIT lost or twice),
`corrupt_reply` (one bit flipped), `deliver_late` (a lost reply arrives
after the verifier moved on), `replay_step` (an old STEP reaches the worker
again), `reset`, `reconnect` (maybe with a duplicated HELLO answer),
`hello_mismatch` (refused with IDENTITY_MISMATCH, nothing allocated) and
`restart_worker` (the next STEP gets UNKNOWN_SESSION; the verifier HELLOs
again).

The machine models both sides independently of their code: per request the
verifier's committed tokens, generation and round; per request the worker's
view (generation, round, cached reply slot, proposal, committed view); the
messages in flight; and every counter. After every step it checks that the
bridge agrees:

* nothing is applied after a failure: a failed round commits exactly one
  target-only token (TARGET_ONLY key of that round) and bumps the
  generation; the committed tokens change only through RoundResults;
* (rid, generation, round) tags never repeat (STEPs, results, COMMITs);
* the worker never draws a PROPOSAL key twice for one (seed, generation,
  round, position); a retry is answered from the cache, byte for byte;
* stale and duplicated messages are refused with STALE_GENERATION or
  DUPLICATE_ROUND and change nothing; the counters of both sides equal the
  model's (every fault is counted once, under its own code);
* every slot is FREE between rounds; a refused HELLO allocates nothing.
"""

import collections
import dataclasses
import functools
import types

import hypothesis
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule)
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import digest as digest_lib
from dyadic_jax.bridge import hello, staging
from dyadic_jax.bridge import verifier as verifier_module
from dyadic_jax.testing import toy_models
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import Kind, Representation

V, K, D = 16, 4, 3
RIDS = (0, 1)
SESSION = 0x5EED5EED
TIMEOUT_S = 2.0
ADDRESS = "fake://worker"
CAPS = bridge.Capabilities(vocab=V, max_depth=D, max_requests=2,
                           max_slots=2, representation=Representation.SPARSE,
                           max_support=K)
MISMATCHED = {
    "draft_id": dataclasses.replace(CAPS, draft_id="other-draft"),
    "max_support": dataclasses.replace(CAPS, max_support=8),
    "max_depth": dataclasses.replace(CAPS, max_depth=2),
    "vocab": bridge.Capabilities(vocab=2 * V, max_depth=D, max_requests=2,
                                 max_support=K),
    "dense": dataclasses.replace(CAPS, representation=Representation.DENSE),
    "greedy": bridge.Capabilities(mode=layouts.GREEDY_VERSION, vocab=V,
                                  max_depth=D, max_requests=2),
}
BATCH = st.sampled_from([(0,), (1,), (0, 1), (1, 0)])
DEPTH = st.sampled_from([2, 3])
COMMITS = ["deliver", "drop", "dup"]
# The events the model counts (others, e.g. byte counts, are not checked).
V_EVENTS = ("hellos", "rounds", "tokens", "fallbacks", "resets", "reconnects")
W_EVENTS = ("hellos", "proposals", "retries_served", "resyncs", "commits",
            "commits_unserved", "resets")


# -- shared, compiled once per module -----------------------------------------


@functools.cache
def _shared():
  """(propose, target_fn), warmed up: every shape a step uses is compiled."""
  toy = toy_models.make_toy(toy_models.ToyConfig(vocab=V, closeness=0.7))
  propose = bridge.draft_proposer(
      lambda prev: toy_models.draft_logits(toy, prev), CAPS)

  def target_fn(prefix, draft):
    prev = np.concatenate([prefix[-1:], draft]).astype(np.int32)
    return np.asarray(toy_models.target_logits(toy, prev))

  worker = bridge.Worker(CAPS, propose)
  clock = FakeClock()
  verifier = bridge.Verifier(CAPS, ADDRESS, target_fn=target_fn, clock=clock,
                             timeout_s=TIMEOUT_S, session=SESSION)
  drop = []

  def deliver(endpoint, frames):
    out = worker.handle(frames)
    if out and not drop:
      endpoint.inbox.append(tuple(bytes(f) for f in out))

  verifier.endpoint = FakeEndpoint(deliver, clock)
  verifier.open(attempts=1)
  for rid in RIDS:
    verifier.add_request(rid, [rid + 1], seed=1)
  for depth in (2, 3):
    verifier.round(list(RIDS), depth)        # verified
  drop.append(True)
  verifier.round(list(RIDS))                 # target-only
  _target_only_token(target_fn, [1], 1, 0, 1, 1)
  return propose, target_fn


def _target_only_token(target_fn, tokens, seed, generation, round_id,
                       anchor):
  """The token a failed round must commit, computed independently."""
  logits = target_fn(np.asarray(tokens, np.int32), np.zeros(0, np.int32))
  key = dj.draw_key(dj.round_key(seed, generation, round_id), anchor,
                    dj.Domain.TARGET_ONLY)
  token, status = dj.sample_target(logits[0], key)
  assert int(status) == 0
  return int(token)


# -- the network ---------------------------------------------------------------


class FakeClock:
  """Time that moves only when a receive waits out its timeout."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class FakeEndpoint:
  """The verifier's side of an in-memory network (transport.Endpoint API).

  `send` hands the message to `deliver(endpoint, frames)` (the network and
  the worker, which put any answer in `inbox`); `recv` returns the next
  message of `inbox`, or waits out its timeout on the fake clock.
  """

  def __init__(self, deliver, clock):
    self.deliver = deliver
    self.clock = clock
    self.inbox = collections.deque()
    self.popped = []           # messages received since the last reset
    self.closed = False

  def send(self, frames, peer=None):
    del peer
    assert not self.closed, "send on a closed endpoint"
    self.deliver(self, [bytes(f) for f in frames])
    return None                # no tracker: the frames were copied

  def recv(self, timeout_s):
    assert not self.closed, "recv on a closed endpoint"
    if self.inbox:
      msg = self.inbox.popleft()
      self.popped.append(msg)
      return None, list(msg)
    self.clock.now += max(float(timeout_s), 0.0)
    return None

  def close(self):
    self.closed = True
    self.inbox.clear()         # what the old socket had queued is lost


# -- helpers -------------------------------------------------------------------


def _tag(frame):
  """(generation, round) of a frame's header."""
  _, _, generation, round_id = codec.peek(frame)
  return generation, round_id


def _kind(msg):
  return codec.peek(msg[0])[0]


def _groups(msg):
  """[(rid, tag, frames)] of a reply message (a COMPLETION ends a group)."""
  out, rows = [], []
  for f in msg:
    rows.append(f)
    if codec.peek(f)[0] == Kind.COMPLETION:
      body = codec.decode(f, CAPS.bounds).body
      out.append((int(body["request"]), _tag(f), tuple(rows)))
      rows = []
  assert not rows, "reply rows without a COMPLETION"
  return out


def _late(tag, tags):
  """The refusal of a message claiming `tag` in an exchange of `tags` (rid
  -> tag, in batch order) when it is no request's tag but an older one of
  some request (STALE_GENERATION or DUPLICATE_ROUND), else None."""
  if tag in tags.values():
    return None
  for want in tags.values():
    if tag < want:
      return (Code.STALE_GENERATION if tag[0] < want[0]
              else Code.DUPLICATE_ROUND)
  return None


def _describe(msgs):
  """Kinds and tags of messages, for assertion messages."""
  return [" ".join(f"{Kind(codec.peek(f)[0]).name}{_tag(f)}" for f in msg)
          for msg in msgs]


def _reset_reason(msg):
  assert len(msg) == 1 and _kind(msg) == Kind.RESET, msg
  return Code(int(codec.decode(msg[0], hello.HELLO_BOUNDS).body["reason"]))


_DIGEST_AT = (layouts.HEADER.itemsize
              + layouts.BODIES[Kind.STEP].fields["prefix_digest"][1])


def _prefix_digest(frame):
  """The 32 bytes of a STEP's prefix digest, as sent."""
  return bytes(frame[_DIGEST_AT:_DIGEST_AT + 32])


def _flip(frame, bit):
  """`frame` with bit `bit` (modulo its size) inverted."""
  buf = bytearray(frame)
  bit %= 8 * len(buf)
  buf[bit // 8] ^= 1 << (bit % 8)
  return bytes(buf)


@dataclasses.dataclass
class WorkerView:
  """The model of what the worker knows of one request."""
  generation: int = 0
  round: int = -1
  cached: int | None = None         # slot of the cached reply
  proposal: tuple | None = None     # tokens of the served round
  view: tuple | None = None         # (anchor, last token, prefix digest)
  committed: tuple = (-1, -1)


@dataclasses.dataclass
class RequestModel:
  """The model of one request on the verifier."""
  seed: int
  tokens: list
  digest: bytes
  generation: int = 0
  round: int = 0


class Recorder:
  """Wraps the proposer: records every draw, refuses a key drawn twice."""

  def __init__(self, propose):
    self.propose = propose
    self.incarnation = 0        # a restarted worker starts a new ledger
    self.keys = set()
    self.tokens = {}            # (seed, generation, round) -> tokens

  def __call__(self, seed, generation, round_id, anchor, last_token, depth):
    for position in range(anchor, anchor + depth):
      key = (self.incarnation, seed, generation, round_id, position)
      assert key not in self.keys, f"PROPOSAL key drawn twice: {key}"
      self.keys.add(key)
    proposal = self.propose(seed, generation, round_id, anchor, last_token,
                            depth)
    self.tokens[seed, generation, round_id] = tuple(
        int(t) for t in proposal.tokens)
    return proposal


# -- the machine ---------------------------------------------------------------


class BridgeMachine(RuleBasedStateMachine):
  """A worker and a verifier; the network, the clock and faults are ours."""

  def __init__(self):
    super().__init__()
    self.propose, self.target_fn = _shared()
    self._saved_endpoint = verifier_module.Endpoint
    verifier_module.Endpoint = types.SimpleNamespace(connect=self._connect)
    self.clock = FakeClock()
    self.recorder = Recorder(self.propose)
    self.worker = bridge.Worker(CAPS, self.recorder)
    self.verifier = bridge.Verifier(CAPS, ADDRESS, target_fn=self.target_fn,
                                    clock=self.clock, timeout_s=TIMEOUT_S,
                                    session=SESSION)
    # The model.
    self.requests = {}
    for rid in RIDS:
      self.verifier.add_request(rid, [rid + 1], seed=100 + rid)
      self.requests[rid] = RequestModel(100 + rid, [rid + 1],
                                        digest_lib.of([rid + 1]))
    self.v_open = False
    self.v_errors, self.v_events = collections.Counter(), (
        collections.Counter())
    self.results = []            # every RoundResult, in order
    self.result_tags = set()
    self.sent_tags = set()
    self._new_worker_model()
    # The network.
    self.plan = None             # (STEP fault, COMMIT fault) of this round
    self.fresh = set()           # (rid, tag) the worker served this round
    self.hello_fault = "deliver"
    self.sends = []              # (kind, frames, answers queued) per send
    self.sent_steps = []         # every STEP message the verifier sent
    self.late = []               # dropped replies, deliverable later

  def _new_worker_model(self):
    self.w_session = None
    self.w_views = {}
    self.w_next_slot = 0
    self.w_errors, self.w_events = collections.Counter(), (
        collections.Counter())
    self.served = {}             # (rid, tag) -> frames of the fresh reply

  def teardown(self):
    verifier_module.Endpoint = self._saved_endpoint
    self.verifier.close()

  def _connect(self, address):
    assert address == ADDRESS, address
    return FakeEndpoint(self._deliver, self.clock)

  # -- the network and the worker's side of the model --------------------------

  def _deliver(self, endpoint, frames):
    kind = codec.peek(frames[0])[0]
    queued = []
    if kind == Kind.HELLO:
      out = self._to_worker(frames)
      copies = 2 if self.hello_fault == "dup" else 1
      queued += [out] * copies
    elif kind == Kind.STEP:
      queued = self._step_network(frames)
    elif kind == Kind.COMMIT:
      fault = self.plan[1] if self.plan else "deliver"
      for _ in range({"deliver": 1, "drop": 0, "dup": 2}[fault]):
        out = self._to_worker(frames)
        if out is not None:
          queued.append(out)
    elif kind == Kind.RESET:
      out = self._to_worker(frames)
      if out is not None:
        queued.append(out)
    else:
      raise AssertionError(f"the verifier sent a {Kind(kind).name}")
    endpoint.inbox.extend(queued)
    self.sends.append((kind, tuple(frames), queued))

  def _step_network(self, frames):
    msg = tuple(frames)
    for f in frames:
      step = codec.decode(f, CAPS.bounds)
      key = (int(step.body["request"]),) + _tag(f)
      assert key not in self.sent_tags, f"STEP tag sent twice: {key}"
      self.sent_tags.add(key)
    self.sent_steps.append(msg)
    fault = self.plan[0]
    if fault == "drop_step":
      return []
    out = self._to_worker(frames)
    if out is None:
      return []
    if fault == "drop_reply":
      self.late.append(out)
      return []
    if fault == "dup_reply":
      return [out, out]
    if fault == "dup_step":
      again = self._to_worker(frames)
      assert again == out, "a retried STEP was not answered byte for byte"
      return [out, again]
    if fault[0] == "corrupt":
      _, index, bit = fault
      index %= len(out)
      return [out[:index] + (_flip(out[index], bit),) + out[index + 1:]]
    assert fault == "deliver", fault
    return [out]

  def _to_worker(self, frames):
    """worker.handle(frames), checked against the model's prediction."""
    kind = codec.peek(frames[0])[0]
    if kind == Kind.HELLO:
      expect = self._model_hello(frames[0])
    elif self.w_session is None:   # only a STEP waits for an answer
      expect = ("reset", Code.UNKNOWN_SESSION) if kind == Kind.STEP else None
      self.w_errors[Code.UNKNOWN_SESSION] += 1
    elif kind == Kind.STEP:
      expect = self._model_step(frames)
    elif kind == Kind.COMMIT:
      expect = self._model_commit(frames)
    else:
      expect = self._model_reset(frames)
    out = self.worker.handle(list(frames))
    out = None if out is None else tuple(bytes(f) for f in out)
    if expect is None:
      assert out is None, f"the worker answered {Kind(kind).name}"
    elif expect[0] == "reset":
      assert out is not None and _reset_reason(out) == expect[1], (
          f"expected a RESET {expect[1].name}, got {out and _kind(out)}")
    elif expect[0] == "hello":
      assert out is not None and len(out) == 1 and _kind(out) == Kind.HELLO
      assert hello.decode_hello(out[0]) == (CAPS, expect[1])
    else:
      self._check_steps_answer(expect[1], expect[2], out)
    return out

  def _model_hello(self, frame):
    theirs, session = hello.decode_hello(frame)
    try:
      hello.negotiate(CAPS, theirs)
    except ProtocolError:
      self.w_errors[Code.IDENTITY_MISMATCH] += 1
      return ("reset", Code.IDENTITY_MISMATCH)
    if session != self.w_session:
      self.w_session, self.w_views = session, {}
    self.w_events["hellos"] += 1
    return ("hello", session)

  def _model_step(self, frames):
    retries, fresh = [], []
    for f in frames:
      step = codec.decode(f, CAPS.bounds)
      rid, tag = int(step.body["request"]), _tag(f)
      view = self.w_views.setdefault(rid, WorkerView())
      if tag[0] < view.generation:
        self.w_errors[Code.STALE_GENERATION] += 1
      elif tag == (view.generation, view.round) and view.cached is not None:
        self.w_events["retries_served"] += 1
        retries.append((rid, tag))
      elif tag[0] == view.generation and tag[1] <= view.round:
        self.w_errors[Code.DUPLICATE_ROUND] += 1
      else:
        fresh.append((rid, tag, step, f))
    if fresh:
      slot, self.w_next_slot = self.w_next_slot, (self.w_next_slot + 1) % (
          CAPS.max_slots)
      for view in self.w_views.values():
        if view.cached == slot:
          view.cached = None
      for rid, tag, step, f in fresh:
        view = self.w_views[rid]
        if tag[0] > view.generation:
          view.cached = view.proposal = None
        view.generation, view.round = tag
        seen = (int(step.body["anchor"]), int(step.body["last_token"]),
                _prefix_digest(f))
        if view.view != seen:
          if view.view is not None:
            self.w_events["resyncs"] += 1
          view.view = seen
        view.cached = slot
        self.w_events["proposals"] += 1
    if not retries and not fresh:
      return None
    return ("steps", retries, [(rid, tag, int(step.body["seed"]))
                               for rid, tag, step, _ in fresh])

  def _check_steps_answer(self, retries, fresh, out):
    assert out is not None, (
        "the worker sent nothing for a servable STEP; it refused "
        f"{self.worker.counters.snapshot()['errors']}")
    groups = _groups(out)
    assert [(rid, tag) for rid, tag, _ in groups] == retries + [
        (rid, tag) for rid, tag, _ in fresh], (groups, retries, fresh)
    for rid, tag, rows in groups[:len(retries)]:
      assert rows == self.served[rid, tag], (
          f"retry of request {rid} {tag} is not the cached bytes")
    for (rid, tag, seed), (_, _, rows) in zip(fresh, groups[len(retries):]):
      self.served[rid, tag] = rows
      self.fresh.add((rid, tag))
      self.w_views[rid].proposal = self.recorder.tokens[(seed,) + tag]
      tokens = [int(codec.decode(r, CAPS.bounds).body["token"])
                for r in rows[:-1]]
      assert tuple(tokens) == self.w_views[rid].proposal

  def _model_commit(self, frames):
    for f in frames:
      body = codec.decode(f, CAPS.bounds).body
      rid, tag = int(body["request"]), _tag(f)
      view = self.w_views.setdefault(rid, WorkerView())
      if tag <= view.committed:
        self.w_errors[Code.STALE_GENERATION if tag[0] < view.committed[0]
                      else Code.DUPLICATE_ROUND] += 1
        continue
      fallback = bool(int(body["fallback"]))
      if tag != (view.generation, view.round):
        self.w_events["commits_unserved"] += 1
        view.generation, view.round = tag
        view.proposal = None
      committed = [] if fallback or view.proposal is None else list(
          view.proposal[:int(body["accepted"])])
      committed.append(int(body["next_token"]))
      digest = None if view.view is None else view.view[2]
      if digest is not None and (view.proposal is not None or fallback):
        digest = digest_lib.extend(digest, committed)
      else:
        digest = None
      view.view = (int(body["new_position"]), committed[-1], digest)
      view.cached = view.proposal = None
      view.committed = tag
      self.w_events["commits"] += 1
    return None

  def _model_reset(self, frames):
    for f in frames:
      body = codec.decode(f, CAPS.bounds).body
      rid, generation = int(body["request"]), _tag(f)[0]
      targets = (list(self.w_views) if rid == layouts.ALL_REQUESTS
                 else [rid])
      for key in targets:
        view = self.w_views.setdefault(key, WorkerView())
        view.cached = view.proposal = None
        if generation > view.generation:   # a new generation: no round yet
          view.generation, view.round = generation, -1
      self.w_events["resets"] += 1
    return None

  # -- the verifier's side of the model ----------------------------------------

  def _expect_open(self, queue, popped):
    """Consumes `queue` as `Verifier.open` should; True once open."""
    while queue:
      msg = queue.popleft()
      popped.append(msg)
      kind = _kind(msg)
      if kind == Kind.RESET and codec.peek(msg[0])[1:] == (SESSION, 0, 0):
        self.v_errors[_reset_reason(msg)] += 1   # the HELLO is refused
        return False
      if kind != Kind.HELLO or hello.decode_hello(msg[0])[1] != SESSION:
        continue                   # a late answer to an earlier exchange
      self.v_open = True
      self.v_events["hellos"] += 1
      return True
    return False

  def _expect_exchange(self, queue, popped, tags):
    """Consumes `queue` as `Verifier._collect` should: {rid: None | Code}."""
    outcome = {}
    while len(outcome) < len(tags):
      if not queue:
        for rid in tags:
          outcome.setdefault(rid, Code.TIMEOUT)
        break
      msg = queue.popleft()
      popped.append(msg)
      late = _late(_tag(msg[0]), tags)
      try:
        for f in msg:
          codec.decode(f, CAPS.bounds, validate_rows=False)
      except ProtocolError as e:
        self.v_errors[e.code] += 1
        if not late:               # else it claims an exchange that is over
          for rid in tags:
            outcome.setdefault(rid, e.code)
        continue
      kind = _kind(msg)
      if kind == Kind.HELLO:
        continue                   # a late answer to an earlier HELLO
      if kind == Kind.RESET:
        if late:                   # the answer to an exchange that is over
          self.v_errors[late] += 1
          continue
        reason = _reset_reason(msg)
        self.v_errors[reason] += 1
        if reason == Code.UNKNOWN_SESSION:
          self.v_open = False
        for rid in tags:
          outcome.setdefault(rid, reason)
        continue
      for rid, tag, _ in _groups(msg):
        want = tags.get(rid)
        if want is None:           # a request that is not in this batch
          req = self.requests[rid]
          want = (req.generation, req.round + 1)
        if tag == want and rid in tags:
          if rid in outcome:
            self.v_errors[Code.DUPLICATE_ROUND] += 1
          else:
            outcome[rid] = None
        elif tag[0] < want[0]:
          self.v_errors[Code.STALE_GENERATION] += 1
        elif tag < want:
          self.v_errors[Code.DUPLICATE_ROUND] += 1
        else:
          self.v_errors[Code.BAD_SEQUENCE] += 1
    return outcome

  def _round(self, batch, depth, plan):
    endpoint = self.verifier.endpoint
    pending = collections.deque(endpoint.inbox)
    endpoint.popped = []
    self.sends, self.plan, self.fresh = [], plan, set()
    try:
      results = self.verifier.round(list(batch), depth)
    finally:
      self.plan = None
    kinds = [Kind(kind).name for kind, _, _ in self.sends]
    want = ([] if self.v_open else ["HELLO"]) + ["STEP", "COMMIT"]
    assert kinds == want, f"the verifier sent {kinds}, not {want}: {results}"
    # What the verifier should have read, in order, and left in the inbox.
    sends, popped = list(self.sends), []
    if not self.v_open:
      kind, _, queued = sends.pop(0)
      assert kind == Kind.HELLO, "a closed session must HELLO first"
      pending.extend(queued)
      assert self._expect_open(pending, popped), "the session did not open"
    kind, steps, queued = sends.pop(0)
    assert kind == Kind.STEP, f"expected the STEP, got {Kind(kind).name}"
    pending.extend(queued)
    tags = {}
    for rid, frame in zip(batch, steps, strict=True):
      req = self.requests[rid]
      req.round += 1
      tags[rid] = (req.generation, req.round)
      body = codec.decode(frame, CAPS.bounds).body
      assert (int(body["request"]), _tag(frame)) == (rid, tags[rid])
      assert (int(body["anchor"]), int(body["last_token"]),
              _prefix_digest(frame)) == (len(req.tokens), req.tokens[-1],
                                         req.digest)
    outcome = self._expect_exchange(pending, popped, tags)
    kind, commits, queued = sends.pop(0)
    assert kind == Kind.COMMIT and not sends, "one COMMIT message per round"
    pending.extend(queued)
    assert endpoint.popped == popped, (
        f"the verifier read {_describe(endpoint.popped)}, expected "
        f"{_describe(popped)}: {results}")
    assert list(endpoint.inbox) == list(pending), (
        f"left {_describe(endpoint.inbox)}, expected {_describe(pending)}")
    # The results: verified, or exactly one target-only token.
    timed_out = Code.TIMEOUT in outcome.values()
    if timed_out:    # the watchdog: the whole batch falls back
      self.v_errors[Code.TIMEOUT] += sum(
          c == Code.TIMEOUT for c in outcome.values())
    assert [r.rid for r in results] == list(batch)
    for res, frame in zip(results, commits, strict=True):
      req = self.requests[res.rid]
      tag = tags[res.rid]
      assert (res.generation, res.round) == tag
      assert (res.rid,) + tag not in self.result_tags, "a tag repeated"
      self.result_tags.add((res.rid,) + tag)
      assert res.anchor == len(req.tokens)
      code = outcome[res.rid] or (Code.TIMEOUT if timed_out else None)
      if code is None:
        assert not res.fallback and res.code is None, (res, outcome)
        assert 1 <= len(res.committed) <= depth + 1
        assert res.accepted == len(res.committed) - 1
        drafted = self.recorder.tokens[(req.seed,) + tag]
        assert res.committed[:-1] == drafted[:res.accepted], (res, drafted)
      else:
        assert res.fallback and res.code == code, (res, code)
        assert res.accepted == 0 and len(res.committed) == 1
        assert res.committed[0] == _target_only_token(
            self.target_fn, req.tokens, req.seed, tag[0], tag[1],
            res.anchor)
        req.generation, req.round = req.generation + 1, 0
        self.v_events["fallbacks"] += 1
      req.tokens.extend(res.committed)
      req.digest = digest_lib.extend(req.digest, res.committed)
      self.results.append(res)
      self.v_events["rounds"] += 1
      self.v_events["tokens"] += len(res.committed)
      # The COMMIT says exactly what was committed.
      body = codec.decode(frame, CAPS.bounds).body
      assert (int(body["request"]), _tag(frame)) == (res.rid, tag)
      assert (int(body["accepted"]), int(body["fallback"]),
              int(body["status"]), int(body["next_token"]),
              int(body["new_position"])) == (
                  res.accepted, int(res.fallback), int(res.code or 0),
                  res.committed[-1], len(req.tokens))
      # A worker that served this round and got its COMMIT agrees with the
      # verifier on the committed prefix.
      if (res.rid, tag) in self.fresh and plan[1] != "drop":
        view = self.worker.views[res.rid]
        assert (view.anchor, view.last_token, view.digest) == (
            len(req.tokens), req.tokens[-1], req.digest), res.rid
    return results

  # -- rules -------------------------------------------------------------------

  @initialize(first=st.sampled_from([None] + sorted(MISMATCHED)))
  def open_session(self, first):
    """HELLO both ways (after, maybe, a mismatched HELLO of another side)."""
    if first is not None:
      self.hello_mismatch(first)
      assert self.worker._buffers is None, "a refused HELLO allocated slots"
    self.sends = []
    self.verifier.open(attempts=1)
    assert [kind for kind, _, _ in self.sends] == [Kind.HELLO]
    popped = []
    assert self._expect_open(collections.deque(self.sends[0][2]), popped)
    assert self.verifier.pool is not None

  @rule(batch=BATCH, depth=DEPTH)
  def step(self, batch, depth):
    """One round over a clean network: every request is verified."""
    self._round(batch, depth, ("deliver", "deliver"))

  @rule(batch=BATCH, depth=DEPTH,
        lost=st.sampled_from(["drop_step", "drop_reply"]),
        commit=st.sampled_from(COMMITS))
  def step_lost(self, batch, depth, lost, commit):
    """The STEP or its reply is lost: the batch times out and falls back
    (a lost reply may still arrive later: `deliver_late`)."""
    self._round(batch, depth, (lost, commit))

  @rule(batch=BATCH, depth=DEPTH,
        dup=st.sampled_from(["dup_reply", "dup_step"]),
        commit=st.sampled_from(COMMITS))
  def step_duplicated(self, batch, depth, dup, commit):
    """The reply arrives twice, or the STEP does (a retry the worker answers
    from its cache): the second copy is refused as DUPLICATE_ROUND."""
    self._round(batch, depth, (dup, commit))

  @rule(batch=BATCH, depth=DEPTH, commit=st.sampled_from(["drop", "dup"]))
  def step_commit_lost(self, batch, depth, commit):
    """The COMMIT is lost (the worker resyncs from the next STEP) or arrives
    twice (the second is refused as DUPLICATE_ROUND)."""
    self._round(batch, depth, ("deliver", commit))

  @precondition(lambda self: self.w_session is not None)
  @rule(batch=BATCH, depth=DEPTH, index=st.integers(0, 2 * D + 1),
        bit=st.integers(0, 2 ** 12), commit=st.sampled_from(COMMITS))
  def corrupt_reply(self, batch, depth, index, bit, commit):
    """One bit of one reply frame flips: the whole batch falls back."""
    self._round(batch, depth, (("corrupt", index, bit), commit))

  @precondition(lambda self: self.late)
  @rule(data=st.data())
  def deliver_late(self, data):
    """A reply dropped earlier arrives now (read during the next round)."""
    msg = self.late.pop(data.draw(st.integers(0, len(self.late) - 1)))
    self.verifier.endpoint.inbox.append(msg)

  @precondition(lambda self: self.sent_steps and self.w_session is not None)
  @rule(data=st.data())
  def replay_step(self, data):
    """An old STEP reaches the worker again (a delayed duplicate): refused
    or answered from the cache; no key is drawn twice."""
    msg = self.sent_steps[data.draw(st.integers(0, len(self.sent_steps) - 1))]
    self.plan = ("deliver", "deliver")
    try:
      out = self._to_worker(msg)
    finally:
      self.plan = None
    if out is not None:
      self.verifier.endpoint.inbox.append(out)

  @rule(rid=st.sampled_from([0, 1, None]))
  def reset(self, rid):
    """Cancels a request (or all): a new generation on both sides."""
    self.sends = []
    self.verifier.reset(rid)
    for r in (RIDS if rid is None else [rid]):
      req = self.requests[r]
      req.generation, req.round = req.generation + 1, 0
    self.v_events["resets"] += 1
    assert [kind for kind, _, _ in self.sends] == [Kind.RESET]
    assert not self.sends[0][2], "the worker answered a RESET"

  @rule(dup=st.booleans())
  def reconnect(self, dup):
    """A new socket and HELLO: every request moves to a new generation; what
    the old socket had queued is lost."""
    self.sends = []
    self.hello_fault = "dup" if dup else "deliver"
    try:
      self.verifier.reconnect()
    finally:
      self.hello_fault = "deliver"
    for req in self.requests.values():
      req.generation, req.round = req.generation + 1, 0
    self.v_events["reconnects"] += 1
    assert [kind for kind, _, _ in self.sends] == [Kind.HELLO]
    queue, popped = collections.deque(self.sends[0][2]), []
    assert self._expect_open(queue, popped)
    assert self.verifier.endpoint.popped == popped
    assert list(self.verifier.endpoint.inbox) == list(queue)

  @rule(which=st.sampled_from(sorted(MISMATCHED)))
  def hello_mismatch(self, which):
    """Another verifier with other capabilities: refused, nothing changes."""
    worker = self.worker
    state = (worker.session, worker.views, worker._buffers)
    other = bridge.Verifier(MISMATCHED[which], ADDRESS,
                            target_fn=self.target_fn, clock=self.clock,
                            timeout_s=TIMEOUT_S, session=SESSION + 1)
    with pytest.raises(ProtocolError) as refused:
      other.open(attempts=1)
    assert refused.value.code == Code.IDENTITY_MISMATCH
    assert other.pool is None and not other._open
    assert other.counters.snapshot() == {
        "errors": {"IDENTITY_MISMATCH": 1}, "events": {}}
    assert all(a is b for a, b in zip(
        (worker.session, worker.views, worker._buffers), state))
    other.close()

  @rule()
  def restart_worker(self):
    """The worker process restarts: it knows no session until a HELLO."""
    self.recorder.incarnation += 1
    self.worker = bridge.Worker(CAPS, self.recorder)
    self._new_worker_model()

  # -- invariants ------------------------------------------------------------

  def check_all_invariants(self):
    for name in ("slots_free", "verifier_state",
                 "results_account_for_everything", "counters",
                 "worker_views"):
      getattr(self, name)()

  @invariant()
  def slots_free(self):
    pool = self.verifier.pool
    assert pool is None or all(s.state == staging.SlotState.FREE
                               for s in pool.slots)

  @invariant()
  def verifier_state(self):
    for rid, model in self.requests.items():
      req = self.verifier.requests[rid]
      assert req.tokens == model.tokens
      assert req.digest == model.digest
      assert (req.generation, req.round) == (model.generation, model.round)
    assert self.verifier.used_tags == self.result_tags
    assert self.verifier._open == self.v_open

  @invariant()
  def results_account_for_everything(self):
    """Committed tokens change only through RoundResults."""
    for rid in RIDS:
      tokens = [rid + 1]
      for res in self.results:
        if res.rid == rid:
          tokens.extend(res.committed)
      assert self.verifier.requests[rid].tokens == tokens
    counters = self.verifier.counters
    assert counters.events("rounds") == len(self.results)
    assert counters.events("fallbacks") == sum(r.fallback
                                               for r in self.results)
    assert counters.events("tokens") == sum(len(r.committed)
                                            for r in self.results)

  @invariant()
  def counters(self):
    """Every refusal counted once under its code; the modelled events."""
    for counters, errors, events, names in (
        (self.verifier.counters, self.v_errors, self.v_events, V_EVENTS),
        (self.worker.counters, self.w_errors, self.w_events, W_EVENTS)):
      assert counters.snapshot()["errors"] == {
          c.name: n for c, n in sorted(errors.items()) if n}, counters.name
      assert {n: counters.events(n) for n in names} == {
          n: events[n] for n in names}, counters.name

  @invariant()
  def worker_views(self):
    assert (self.worker._buffers is None) == (self.w_session is None)
    assert self.worker.session == self.w_session
    assert set(self.worker.views) == set(self.w_views)
    for rid, model in self.w_views.items():
      view = self.worker.views[rid]
      assert view.generation == model.generation
      assert view.committed == model.committed
      assert (view.cached is None) == (model.cached is None)
      got = None if view.anchor is None else (view.anchor, view.last_token,
                                              view.digest)
      assert got == model.view, (rid, got, model.view)


# Sequences the machine shrank to, replayed as plain tests (each in well
# under a second once `_shared` is warm): the first three were bridge bugs
# fixed since, the others are open at the time of writing.
PINNED = {
    "duplicated_hello_answer": [
        ("reconnect", dict(dup=True)),
        ("step", dict(batch=(0,), depth=2))],
    "late_unknown_session_reset": [
        ("restart_worker", {}),
        ("step_duplicated", dict(batch=(0,), depth=2, dup="dup_reply",
                                 commit="deliver")),
        ("step", dict(batch=(0,), depth=2))],
    "corrupt_reply_with_mixed_tags": [
        ("step", dict(batch=(0,), depth=2)),
        ("corrupt_reply", dict(batch=(1, 0), depth=2, index=0, bit=0,
                               commit="deliver"))],
    "reset_then_round": [
        ("step", dict(batch=(0,), depth=2)),
        ("reset", dict(rid=0)),
        ("step", dict(batch=(0,), depth=2))],
    "late_reply_of_another_request": [
        ("step_duplicated", dict(batch=(1,), depth=2, dup="dup_reply",
                                 commit="deliver")),
        ("step", dict(batch=(0,), depth=2))],
    "prefix_digest_ending_in_nul": [
        ("step", dict(batch=(1, 0), depth=3)),
        ("step", dict(batch=(1,), depth=2)),
        ("step", dict(batch=(0, 1), depth=2)),
        ("step", dict(batch=(0, 1), depth=3)),
        ("step", dict(batch=(1,), depth=2))],
    "corrupt_kind_reads_hello": [   # bit 49: REPLY (3) -> HELLO (1)
        ("corrupt_reply", dict(batch=(0,), depth=2, index=0, bit=49,
                               commit="deliver"))],
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_sequence(name):
  machine = BridgeMachine()
  try:
    machine.open_session(None)
    machine.check_all_invariants()
    for rule_name, kwargs in PINNED[name]:
      getattr(machine, rule_name)(**kwargs)
      machine.check_all_invariants()
  finally:
    machine.teardown()


TestBridge = BridgeMachine.TestCase
# About 150 x 37 steps (some 2,500 rounds) in ~20 s after a ~10 s warm-up
# on 2 CPU cores. One bug is shrunk and reported at a time (a failing run
# stays short); derandomized, so CI sees the same sequences every run.
TestBridge.settings = hypothesis.settings(
    derandomize=True, database=None, deadline=None, max_examples=150,
    stateful_step_count=40, report_multiple_bugs=False,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
