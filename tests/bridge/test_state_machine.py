"""A stateful test of the protocol: the two sans-I/O sessions, directly.

A `WorkerSession` and a `VerifierSession` (`dyadic_jax.testing.
session_pair`: no sockets, no threads, an in-memory network this machine
controls and a fake clock, so a timeout costs nothing and every run is
deterministic). The proposer draws real
dyadic rows and real PROPOSAL draws (`audit.proposal_draws`), and the
verifier validates and audits every staged row, so a forged token is
caught as it would be in production; verification itself is a
deterministic stand-in (the soak and the pipeline test the distribution).

Rules: clean rounds; a lost STEP or reply (timeout); a duplicated reply or
STEP (a retry from the cache); a lost or duplicated COMMIT; a flipped bit
in a reply (fails authentication: the round times out); a buggy worker
that re-seals a reply with a token not drawn from its q (the audit); a
late reply delivered rounds later; an old STEP or COMMIT replayed to the
worker; reset, remove and re-add of a request; reconnect (maybe with a
duplicated HELLO answer); another verifier taking the worker over; a
worker restart; a storm of HELLOs without the key. ContextMachine runs
them all on a session that agreed on CONTEXT frames, with a context
budget small enough to evict. TwoInFlightMachine keeps two exchanges in
flight (HELLO's max_slots 2): a second round begun while the first is
out, answers read in either order, one exchange's answer dropped,
corrupted, forged, held back or timed out while the other commits, old
STEPs and COMMITs replayed to the worker, a reconnect ending both; per
exchange its tags, staging slot and fallback are its own.

What is checked, without re-deriving the sessions' classification:

* nothing is applied after a failure: a failed round commits exactly one
  target-only token and the request moves to a new generation;
  committed tokens change only through RoundResults;
* no stale, replayed or forged proposal is ever committed: every drafted
  token a verified round commits is the worker's proposal for exactly that
  request, generation and round, drawn from the q the verifier validated;
* (request, generation, round) tags never repeat; the worker never draws a
  PROPOSAL key twice (one ledger per worker incarnation); a retry is
  answered byte for byte from the cache;
* every fallback is counted (its code among the verifier's errors) and
  every round ends (verified, or with a code) with no exchange left;
* the worker's views stay bounded;
* with CONTEXT frames, a proposal's context, when the worker hands one,
  is exactly the verifier's committed prefix of that request (never a
  stale one), and the worker's contexts stay within their budget.
"""

import collections
import dataclasses
import hashlib

import hypothesis
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule)
import numpy as np

from dyadic_jax import bridge
from dyadic_jax.bridge import audit, hello
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.testing import session_pair
from dyadic_jax.wire import codec
from dyadic_jax.wire.layouts import Kind, Representation
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness as h

V, K, D = 16, 4, 3
RIDS = (0, 1)
SECRET = bytes(range(32))
TIMEOUT_S = 2.0
CAPS = hello.Capabilities(vocab=V, max_depth=D, max_requests=2, max_slots=2,
                          representation=Representation.SPARSE,
                          max_support=K)
# The same protocol with per-frame answers (REPLY + COMPLETION per request):
# what a peer that does not offer PACKED replies speaks.
CAPS_FRAMES = dataclasses.replace(CAPS, features=0)
BATCH = st.sampled_from([(0,), (1,), (0, 1), (1, 0)])
DEPTH = st.sampled_from([2, 3])
COMMITS = ["deliver", "drop", "dup"]
M = 1 << 24


def _support(last_token):
  ids = np.sort((last_token + np.arange(K) * 3) % V).astype(np.int32)
  counts = np.array([M // 2, M // 4, M // 8, M // 8], np.int64)
  return ids, counts


class Recorder:
  """A proposer of real dyadic rows and real PROPOSAL draws; records every
  draw and refuses a key drawn twice."""

  def __init__(self):
    self.incarnation = 0
    self.keys = set()
    self.tokens = {}            # (seed, generation, round) -> tokens
    # check(p): called for every proposal (the context machine's check).
    self.check = None

  def __call__(self, proposals):
    """The pair's proposer: draws every proposal of one answer."""
    for p in proposals:
      self.draw(p)

  def draw(self, p):
    if self.check is not None:
      self.check(p)
    for position in range(p.anchor, p.anchor + p.depth):
      key = (self.incarnation, p.seed, p.generation, p.round, position)
      assert key not in self.keys, f"PROPOSAL key drawn twice: {key}"
      self.keys.add(key)
    draws = audit.proposal_draws([p.seed], [p.generation], [p.round],
                                 [p.anchor], p.depth)[0]
    prev, tokens = p.last_token, []
    for i in range(p.depth):
      ids, counts = _support(prev)
      index = int(np.searchsorted(np.cumsum(counts), draws[i], "right"))
      prev = int(ids[index])
      tokens.append(prev)
      p.rows.ids[i] = ids
      p.rows.values[i] = (counts / M).astype(np.float32)
      p.rows.n[i] = K
    p.rows.tokens[:] = tokens
    self.tokens[p.seed, p.generation, p.round] = tuple(tokens)


def _stand_in(seed, generation, round_id, what):
  """A deterministic 'random' integer for verification outcomes."""
  digest = hashlib.blake2b(f"{seed}/{generation}/{round_id}/{what}".encode(),
                           digest_size=8).digest()
  return int.from_bytes(digest, "little")


def _forge(pair, message):
  """A buggy worker's answer: `message` with the first drafted token of its
  first request replaced by another id its q gives mass, re-sealed with
  the worker's session key (the sampling audit's case)."""
  # The worker's key now (a STEP promoted its pending session).
  tagger = pair.worker.established.keys.send
  frames = h.frames(message)
  for i, f in enumerate(frames):
    if codec.peek(f)[0] == Kind.PACKED:   # the first record
      buf = bytearray(f)
      rows = codec.decode(buf, pair.caps.bounds._replace(packed=True)).rows
      live = rows.ids[0, 0, :rows.n[0, 0]]
      rows.tokens[0, 0] = int(next(x for x in live
                                   if x != rows.tokens[0, 0]))
      frames[i] = h.reseal(buf, tagger)
      break
    if codec.peek(f)[0] == Kind.REPLY:
      _, rows = h.reply_rows(f, pair.caps)
      live = rows.ids[0, :rows.n[0]]
      tokens = rows.tokens.copy()
      tokens[0] = int(next(x for x in live if x != rows.tokens[0]))
      frames[i] = h.rewrite_reply(f, pair.caps, tagger, tokens=tokens)
      break
  return h.join(h.reframe(frames, tagger))


def _outcomes(plan, model):
  """Deterministic stand-in verification outcomes of a plan's requests:
  (accepted, next token), or (0, a target-only token) where it fell
  back."""
  outcomes = []
  for i, rid in enumerate(plan.rids):
    g, r = (int(x) for x in plan.tags[i])
    seed = model[int(rid)].seed
    if plan.codes[i]:
      outcomes.append((0, _stand_in(seed, g, r, "target") % V))
    else:
      accepted = _stand_in(seed, g, r, "accepted") % (
          plan.rows.tokens.shape[1] + 1)
      outcomes.append((accepted, _stand_in(seed, g, r, "next") % V))
  return outcomes


def _check_committed(model, verifier):
  """Each request's committed tokens are its prompt and its results'."""
  for rid, m in model.items():
    tokens = list(m.prompt)
    for res in m.results:
      tokens.extend(res.committed)
    assert verifier.requests[rid].tokens == tokens


@dataclasses.dataclass
class RequestModel:
  seed: int
  prompt: list
  results: list = dataclasses.field(default_factory=list)


class Network:
  """Messages in flight towards the verifier (what reached the worker is
  the pair's `worker_received`)."""

  def __init__(self):
    self.inbox = collections.deque()
    self.late = []               # replies held back, deliverable later


class ProtocolMachine(RuleBasedStateMachine):
  """The two sessions; the network, the clock and faults are ours."""
  caps = CAPS        # PACKED answers (the default); FramesMachine: per frame
  wants_context = False       # ContextMachine: CONTEXT frames agreed
  context_budget = 1 << 22

  def __init__(self):
    super().__init__()
    self.recorder = Recorder()
    self.net = Network()
    self.pair = session_pair.SessionPair(
        self.caps, secret=SECRET, proposer=self.recorder,
        timeout_s=TIMEOUT_S, max_views=8, wants_context=self.wants_context,
        context_budget=self.context_budget)
    self.verifier = self.pair.verifier
    self.model = {}
    for rid in RIDS:
      self._add(rid)
    self.result_tags = set()
    self.fallbacks = 0
    self.others = 0

  def _add(self, rid):
    seed = 100 + rid + 1000 * len(self.model)
    self.verifier.add_request(rid, [rid + 1], seed=seed)
    self.model[rid] = RequestModel(seed, [rid + 1])

  # -- one round -----------------------------------------------------------------

  def _round(self, batch, depth, step_fault="deliver", commit="deliver",
             edit=None):
    pair, v = self.pair, self.verifier
    if not v.is_open and not pair.open():
      return
    step = pair.begin(list(batch), depth)
    tags = {rid: v.exchange.tags[rid] for rid in batch}
    answers = []
    if step_fault != "drop_step":
      answers = pair.to_worker(step)
      if step_fault == "dup_step":
        again = pair.to_worker(step)
        assert again == answers, "a retried STEP was not answered byte for byte"
        answers = answers + again
    if step_fault == "drop_reply":
      self.net.late.extend(answers)
      answers = []
    elif step_fault == "dup_reply":
      answers = answers + answers
    if edit is not None:
      answers = [edit(a) for a in answers]
    self.net.inbox.extend(answers)
    # Read until the round ends (the deadline passes when the inbox runs
    # dry); the staged rows are validated and audited.
    plan = pair.outcome(self.net.inbox)
    results, message = pair.commit(plan, _outcomes(plan, self.model))
    for res in results:
      self._check_result(res, tags[res.rid])
    if message is not None:
      copies = {"deliver": 1, "drop": 0, "dup": 2}[commit]
      for _ in range(copies):
        pair.to_worker(message)
    return results

  def _check_result(self, res, tag):
    m = self.model[res.rid]
    assert (res.generation, res.round) == tag
    key = (res.rid, res.generation, res.round)
    assert key not in self.result_tags, f"a tag repeated: {key}"
    self.result_tags.add(key)
    if res.fallback:
      self.fallbacks += 1
      assert res.code is not None and res.accepted == 0
      assert len(res.committed) == 1
      assert self.verifier.counters.errors(res.code) > 0, res
    else:
      drafted = self.recorder.tokens[(m.seed,) + tag]
      # Only the worker's own proposal for exactly this tag is committed.
      assert res.committed[:-1] == drafted[:res.accepted], (res, drafted)
    m.results.append(res)

  # -- rules -----------------------------------------------------------------

  @initialize(dup=st.booleans())
  def open_session(self, dup):
    assert self.pair.open(duplicate_answers=dup)

  def _worker_knows_us(self):
    return self.pair.worker_knows_verifier()

  @rule(batch=BATCH, depth=DEPTH)
  def step(self, batch, depth):
    """One round over a clean network: every request is verified (or, when
    the worker lost the session, refused with UNKNOWN_SESSION; or, when a
    replayed HELLO left the worker a session of our id with other keys,
    dropped there unauthenticated: the round times out)."""
    known = self._worker_knows_us() or not self.verifier.is_open
    counters = self.pair.worker.counters
    refused = {c: counters.errors(c)
               for c in (Code.UNKNOWN_SESSION, Code.AUTH_FAILED)}
    results = self._round(batch, depth)
    assert results is not None
    if known:
      assert not any(r.fallback for r in results), results
      return
    # One STEP message: one fate for the whole batch, the one the worker
    # counted.
    codes = {r.code for r in results}
    assert len(codes) == 1, results
    code = codes.pop()
    if code == Code.TIMEOUT:
      assert counters.errors(Code.AUTH_FAILED) > refused[Code.AUTH_FAILED]
    else:
      assert code == Code.UNKNOWN_SESSION, results
      assert counters.errors(code) > refused[code]

  @rule(batch=BATCH, depth=DEPTH,
        lost=st.sampled_from(["drop_step", "drop_reply"]),
        commit=st.sampled_from(COMMITS))
  def step_lost(self, batch, depth, lost, commit):
    # A late worker message already in the inbox (deliver_late) may answer
    # this round: a refusal of the same tags from a restarted worker.
    late = bool(self.net.inbox)
    results = self._round(batch, depth, lost, commit)
    allowed = {Code.TIMEOUT} | ({Code.UNKNOWN_SESSION} if late else set())
    assert results is None or all(r.code in allowed for r in results), results

  @rule(batch=BATCH, depth=DEPTH,
        dup=st.sampled_from(["dup_reply", "dup_step"]),
        commit=st.sampled_from(COMMITS))
  def step_duplicated(self, batch, depth, dup, commit):
    known = self._worker_knows_us() or not self.verifier.is_open
    results = self._round(batch, depth, dup, commit)
    assert results is not None
    if known:
      assert not any(r.fallback for r in results), results

  @rule(batch=BATCH, depth=DEPTH, bit=st.integers(0, 2 ** 14),
        commit=st.sampled_from(COMMITS))
  def corrupt_reply(self, batch, depth, bit, commit):
    """One bit of a reply flips on the wire: it cannot authenticate."""
    def flip(message):
      buf = bytearray(message)
      b = bit % (8 * len(buf))
      buf[b // 8] ^= 1 << (b % 8)
      return bytes(buf)
    before = self.verifier.counters.total_errors()
    results = self._round(batch, depth, "deliver", commit, flip)
    if results is not None:
      assert all(r.fallback for r in results)
      assert self.verifier.counters.total_errors() > before

  @rule(batch=BATCH, depth=DEPTH)
  def buggy_worker_forges_a_token(self, batch, depth):
    """A worker with the key re-seals its reply with one drafted token that
    its q gives mass but its draw did not pick: the sampling audit."""
    if not self._worker_knows_us():
      return
    known = True
    results = self._round(batch, depth, "deliver", "deliver",
                          lambda message: _forge(self.pair, message))
    assert results[0].fallback, results
    if known:
      assert results[0].code == Code.SAMPLING_MISMATCH, results

  @precondition(lambda self: self.net.late)
  @rule(data=st.data())
  def deliver_late(self, data):
    message = self.net.late.pop(data.draw(st.integers(0, len(
        self.net.late) - 1)))
    self.net.inbox.append(message)

  @precondition(lambda self: self.pair.worker_received)
  @rule(data=st.data())
  def replay_to_worker(self, data):
    """An old STEP, COMMIT, RESET or HELLO reaches the worker again: refused,
    ignored or answered from the cache; no key is drawn twice."""
    seen = self.pair.worker_received
    message = seen[data.draw(st.integers(0, len(seen) - 1))]
    for answer in self.pair.to_worker(message):
      self.net.inbox.append(answer)

  @rule(rid=st.sampled_from(RIDS))
  def remove_and_readd(self, rid):
    message = self.pair.remove(rid)
    if message is not None:
      self.pair.to_worker(message)
    del self.model[rid]
    self._add(rid)      # a new request on the same id: tags continue

  @rule(rid=st.sampled_from([0, 1, None]))
  def reset(self, rid):
    message = self.pair.reset(rid)
    if message is not None:
      assert self.pair.to_worker(message) == []

  @rule(dup=st.booleans())
  def reconnect(self, dup):
    self.verifier.reconnect()
    self.net.inbox.clear()           # the old socket's queue is gone
    assert self.pair.open(duplicate_answers=dup)

  @rule()
  def another_verifier_takes_over(self):
    other = bridge.VerifierSession(self.caps, secret=SECRET,
                                   counters=Counters(log=False))
    for answer in self.pair.to_worker(other.hello().message):
      other.receive(answer)
    self.others += 1      # each request its own seed, as in production
    other.add_request(9, [1], seed=10 ** 6 + self.others)
    self.pair.to_worker(other.begin([9], 2, 0.0)[0].message)

  @rule()
  def restart_worker(self):
    self.recorder.incarnation += 1
    self.pair.restart_worker()

  @rule(n=st.integers(1, 5))
  def hello_storm_without_the_key(self, n):
    stranger = bridge.VerifierSession(self.caps, secret=bytes(32),
                                      counters=Counters(log=False))
    before = self.pair.worker.established
    for _ in range(n):
      assert self.pair.to_worker(stranger.hello().message) == []
      stranger.close()               # its next HELLO opens a new session
    assert self.pair.worker.established is before

  # -- invariants ----------------------------------------------------------------

  @invariant()
  def committed_tokens_are_the_results(self):
    _check_committed(self.model, self.verifier)

  @invariant()
  def rounds_end_and_are_counted(self):
    v = self.verifier
    assert v.exchange is None
    assert v.counters.events("fallbacks") == self.fallbacks

  @invariant()
  def worker_state_is_bounded(self):
    worker = self.pair.worker
    assert len(worker.views) <= worker.max_views


class FramesMachine(ProtocolMachine):
  caps = CAPS_FRAMES


class ContextMachine(ProtocolMachine):
  """The same rules on a session with CONTEXT frames (a small budget)."""
  wants_context = True
  context_budget = 8

  def __init__(self):
    super().__init__()
    self.recorder.check = self._check_context
    self.contexts_seen = 0

  def _check_context(self, p):
    if p.context is None:
      return
    rid = next((r for r, m in self.model.items() if m.seed == p.seed), None)
    if rid is None:
      return        # another verifier's request (another_verifier_takes_over)
    self.contexts_seen += 1
    prefix = self.verifier.requests[rid].tokens[:p.anchor]
    assert len(p.context) == p.anchor and list(p.context) == prefix, (
        p, list(p.context), prefix)
    assert not p.context.flags.writeable

  @invariant()
  def contexts_stay_in_budget(self):
    worker = self.pair.worker
    held = sum(v.context.n for v in worker.views.values()
               if v.context is not None)
    assert worker.context_tokens == held <= worker.context_budget

  def teardown(self):
    # Negotiated: a verifier that opened its session agreed on CONTEXT.
    assert self.verifier.bounds.max_context
    super().teardown()


# -- two rounds in flight --------------------------------------------------------

GROUPS = ((0, 1), (2, 3))


@dataclasses.dataclass
class Flight:
  """An exchange in flight, as the machine sees it."""
  rids: list
  tags: dict                 # rid -> (generation, round)
  answers: list              # the worker's answer and copies, undelivered
  faults: set = dataclasses.field(default_factory=set)   # applied to it


class TwoInFlightMachine(RuleBasedStateMachine):
  """Two exchanges in flight at once (HELLO's max_slots = 2) on the two
  sessions: a second round begins while the first is out, answers are
  read in any order, one exchange's answer is dropped, corrupted, forged,
  held back (late) or timed out while the other commits, old STEPs and
  COMMITs are replayed to the worker, and a reconnect ends both. Per
  exchange: its results carry its own tags (never reused),
  no token is committed twice (each result starts where the request's
  committed tokens end), a verified drafted token is the worker's own
  proposal for that tag, at most max_slots exchanges hold distinct
  staging slots, and an exchange falls back only for a fault applied to
  it (fallback isolation), with its code counted."""
  caps = CAPS

  def __init__(self):
    super().__init__()
    self.recorder = Recorder()
    self.pair = session_pair.SessionPair(
        self.caps, secret=SECRET, proposer=self.recorder,
        timeout_s=TIMEOUT_S)
    self.verifier = self.pair.verifier
    self.model = {}
    for group in GROUPS:
      for rid in group:
        self.verifier.add_request(rid, [rid + 1], seed=100 + rid)
        self.model[rid] = RequestModel(100 + rid, [rid + 1])
    self.flights = {}          # exchange key -> Flight
    self.late = []             # answers held back, deliverable later
    self.result_tags = set()
    self.fallbacks = 0
    self.overlaps = 0

  @initialize()
  def open_session(self):
    assert self.pair.open()

  # -- rules -------------------------------------------------------------------

  @precondition(lambda self: len(self.flights) < 2)
  @rule(group=st.sampled_from(GROUPS), depth=DEPTH,
        step=st.sampled_from(["deliver", "drop", "dup"]))
  def begin(self, group, depth, step):
    """A round of `group` begins (the second one in flight when the other
    group's is out); its STEP reaches the worker, twice, or never."""
    if any(r in f.rids for f in self.flights.values() for r in group):
      return
    if not self.verifier.is_open:
      assert self.pair.open()
    self.overlaps += bool(self.flights)
    message = self.pair.begin(list(group), depth)
    key = max(self.verifier.exchanges)
    flight = Flight(list(group), dict(self.verifier.exchanges[key].tags),
                    [])
    if step == "drop":
      flight.faults.add("STEP dropped")
    else:
      flight.answers = self.pair.to_worker(message)
      if step == "dup":
        again = self.pair.to_worker(message)
        assert again == flight.answers, "a retry was not answered byte for byte"
        flight.answers += again
    self.flights[key] = flight

  @precondition(lambda self: any(f.answers for f in self.flights.values()))
  @rule(data=st.data(),
        fate=st.sampled_from(["deliver"] * 4 + ["corrupt", "forge", "hold"]),
        commit=st.sampled_from(COMMITS))
  def answer(self, data, fate, commit):
    """One exchange's next answer (either exchange's, in any order): read,
    corrupted on the wire (fails authentication, dropped), re-sealed with
    a forged token by a buggy worker (the audit) or held back (late)."""
    key = data.draw(st.sampled_from(sorted(
        k for k, f in self.flights.items() if f.answers)))
    flight = self.flights[key]
    message = flight.answers.pop(0)
    if fate == "hold":
      flight.faults.add("answer held")
      self.late.append(message)
      return
    if fate == "corrupt":
      flight.faults.add("answer corrupted")
      buf = bytearray(message)
      bit = data.draw(st.integers(0, 8 * len(buf) - 1))
      buf[bit // 8] ^= 1 << (bit % 8)
      before = self.verifier.counters.total_errors()
      assert self.pair.to_verifier(bytes(buf)) == []
      assert self.verifier.counters.total_errors() == before + 1
      return
    if fate == "forge":
      flight.faults.add("token forged")
      message = _forge(self.pair, message)
    self._end(self.pair.to_verifier(message), commit)

  @precondition(lambda self: any(not f.answers
                                 for f in self.flights.values()))
  @rule(data=st.data(), commit=st.sampled_from(COMMITS))
  def time_out(self, data, commit):
    """The deadline of an exchange whose answer is lost, dropped or held
    passes; the other keeps its own."""
    key = data.draw(st.sampled_from(sorted(
        k for k, f in self.flights.items() if not f.answers)))
    flight = self.flights[key]
    flight.faults.add("timed out")
    self.late += flight.answers
    flight.answers = []
    effects = self.verifier.poll(float("inf"), key)
    assert [e.key for e in effects] == [key]
    self._end(effects, commit)

  @precondition(lambda self: self.late)
  @rule(data=st.data())
  def deliver_late(self, data):
    """A held answer arrives: it answers its exchange if still in flight,
    else it is refused (stale or duplicate) and changes nothing."""
    message = self.late.pop(data.draw(st.integers(0, len(self.late) - 1)))
    before = {k: self.verifier.exchanges[k].answered.copy()
              for k in self.flights}
    effects = self.pair.to_verifier(message)
    if not effects:
      for k, answered in before.items():
        assert (self.verifier.exchanges[k].answered == answered).all()
    self._end(effects, "deliver")

  @precondition(lambda self: any(
      codec.peek(m)[0] in (Kind.STEP, Kind.COMMIT)
      for m in self.pair.worker_received))
  @rule(data=st.data())
  def replay_to_worker(self, data):
    """An old STEP or COMMIT reaches the worker again while rounds are in
    flight: refused, or answered from its cache (a copy, late); no key is
    drawn twice (the Recorder)."""
    seen = [m for m in self.pair.worker_received
            if codec.peek(m)[0] in (Kind.STEP, Kind.COMMIT)]
    self.late += self.pair.to_worker(
        seen[data.draw(st.integers(0, len(seen) - 1))])

  @precondition(lambda self: len(self.flights) == 2)
  @rule()
  def reconnect(self):
    """A new session ends both exchanges in flight (TIMEOUT)."""
    ended = set(self.flights)
    for flight in self.flights.values():
      flight.faults.add("reconnected")
      self.late += flight.answers
      flight.answers = []
    self.verifier.reconnect()
    effects = self.pair.poll()
    assert sorted(e.key for e in effects) == sorted(ended)
    for effect in effects:
      assert (effect.plan.codes == Code.TIMEOUT).all()
    self._end(effects, "deliver")
    assert self.pair.open()

  # -- ending an exchange --------------------------------------------------------

  def _end(self, effects, commit):
    """Validates (and audits) a Stage, commits each ended exchange."""
    v = self.verifier
    for effect in effects:
      if isinstance(effect, bridge.Stage):
        draws = audit.proposal_draws(*v.draw_inputs(effect.key),
                                     effect.rows.tokens.shape[-1])
        effect = self.pair.validate(effect, draws)
      flight = self.flights.pop(effect.key)
      plan = effect.plan
      anchors = {r: len(v.requests[r].tokens) for r in flight.rids}
      results, message = self.pair.commit(plan, _outcomes(plan, self.model))
      for res in results:
        self._check_result(res, flight, anchors[res.rid])
      if message is not None:
        for _ in range({"deliver": 1, "drop": 0, "dup": 2}[commit]):
          self.pair.to_worker(message)

  def _check_result(self, res, flight, anchor):
    m = self.model[res.rid]
    tag = flight.tags[res.rid]
    assert (res.generation, res.round) == tag
    key = (res.rid,) + tag
    assert key not in self.result_tags, f"a tag repeated: {key}"
    self.result_tags.add(key)
    assert res.anchor == anchor       # nothing committed twice or skipped
    if res.fallback:
      self.fallbacks += 1
      # Isolation: only a fault applied to this exchange fails it.
      assert flight.faults, ("a fallback without a fault of its own", res)
      assert self.verifier.counters.errors(res.code) > 0, res
      allowed = {Code.TIMEOUT}
      if "token forged" in flight.faults:
        allowed.add(Code.SAMPLING_MISMATCH)
      assert res.code in allowed, (res, flight.faults)
    else:
      drafted = self.recorder.tokens[(m.seed,) + tag]
      assert res.committed[:-1] == drafted[:res.accepted], (res, drafted)
    m.results.append(res)

  # -- invariants ----------------------------------------------------------------

  @invariant()
  def committed_tokens_are_the_results(self):
    _check_committed(self.model, self.verifier)

  @invariant()
  def exchanges_hold_their_own_slots(self):
    exchanges = self.verifier.exchanges
    assert sorted(exchanges) == sorted(self.flights)
    assert len(exchanges) <= self.caps.max_slots
    slots = [id(ex.slot) for ex in exchanges.values()]
    assert len(set(slots)) == len(slots)
    for key, flight in self.flights.items():
      assert exchanges[key].tags == flight.tags

  @invariant()
  def every_fallback_and_overlap_is_counted(self):
    counters = self.verifier.counters
    assert counters.events("fallbacks") == self.fallbacks
    assert counters.events("overlapped") == self.overlaps


class TwoInFlightFramesMachine(TwoInFlightMachine):
  caps = CAPS_FRAMES


SETTINGS = hypothesis.settings(
    derandomize=True, database=None, deadline=None, max_examples=80,
    stateful_step_count=30, report_multiple_bugs=False,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])


def _test_case(machine, examples):
  case = machine.TestCase
  case.settings = hypothesis.settings(SETTINGS, max_examples=examples)
  return case


# One exchange at a time: 120 examples in all, as before PACKED answers
# were the default; two in flight: 60.
TestProtocol = _test_case(ProtocolMachine, 80)
TestProtocolFrames = _test_case(FramesMachine, 40)
TestProtocolContext = _test_case(ContextMachine, 40)
TestTwoInFlight = _test_case(TwoInFlightMachine, 40)
TestTwoInFlightFrames = _test_case(TwoInFlightFramesMachine, 20)


def test_a_retried_hello_keeps_one_session_key():
  """The same HELLO twice (a lost answer, retried) gets the same answer:
  the verifier's key matches the worker's whichever answer it read."""
  worker = bridge.WorkerSession(CAPS, secret=SECRET)
  v = bridge.VerifierSession(CAPS, secret=SECRET)
  first = v.hello().message
  a = worker.finish(worker.receive(first))
  b = worker.finish(worker.receive(v.hello().message))
  assert bytes(a[0].message) == bytes(b[0].message)
  v.receive(bytes(b[0].message))
  assert v.is_open
  assert v.keys.send.tag(b"x" * 64) == worker.pending.keys.recv.tag(
      b"x" * 64)
