"""Adaptive depth over the bridge (HELLO feature ADAPTIVE_DEPTH): the
agreement, the same tokens as one process, and every refusal of a length
counted under its code (docs/wire.md, "HELLO features").

The rule's acceptance history is shared by a proposer's requests and read
in the order of its calls, so a bridged run commits `generate.Local`'s
tokens when the calls come in the same order: four prompts of a batch of
four (one group in one process; over the bridge one group, or two of two
that alternate, which draws in the same order).
"""

import collections
import dataclasses
import functools

import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import audit, engine as engine_lib, generate, hello
from dyadic_jax.bridge import proposer as proposer_lib
from dyadic_jax.models import toy_pair
from dyadic_jax.testing import session_pair
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.layouts import Feature, Kind, Representation
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness as h
from tests import wire_edits

V = 64
DEPTH = 4
PROMPTS = [[1, 2, 3], [4], [5, 6], [8, 9, 10]]
RULE = dj.AdaptiveDepth(max_depth=DEPTH, step_cost=0.3, min_depth=1)
PACKED = hello.DEFAULT_FEATURES | Feature.ADAPTIVE_DEPTH
FRAMES = Feature.ADAPTIVE_DEPTH          # per-frame answers (REPLY)
FORMS = {"packed": PACKED, "frames": FRAMES}


@functools.lru_cache(maxsize=None)
def _models():
  return toy_pair.make_models(toy_pair.ModelConfig(vocab=V, max_depth=DEPTH))


def _caps(rep, features):
  return bridge.Capabilities(vocab=V, max_depth=DEPTH, max_requests=4,
                             representation=rep, max_support=8,
                             features=features)


@functools.lru_cache(maxsize=None)
def _local_tokens(rep, adaptive=True):
  """`generate.Local`'s tokens: under RULE, or at fixed depth."""
  target, draft = _models()
  lengths = []
  link = generate.Local(draft, target, _caps(rep, 0),
                        admission=RULE if adaptive else None,
                        observe=lambda r, p, l, o: lengths.extend(
                            len(x.tokens) for x in p))
  out = generate.generate(link, PROMPTS, max_new_tokens=12, seed=5)
  # Under the rule, several lengths; else the session's depth.
  assert (len(set(lengths)) > 1) == adaptive
  return out.tokens


def _draw_with(propose):
  """A SessionPair proposer: adaptive proposals drawn under the rule
  (their lengths for `finish`), the others into the frame at full depth."""
  def draw(props):
    lengths = {}
    for p in props:
      args = (p.seed, p.generation, p.round, p.anchor, p.last_token, p.depth)
      if not p.adaptive:
        propose(*args, out=p.rows, request=p.request, context=p.context)
        continue
      rows = propose(*args, request=p.request, context=p.context)
      proposer_lib.write(p.rows, rows)
      if len(rows.tokens) != p.depth:
        lengths[p.entry] = len(rows.tokens)
    return {}, lengths
  return draw


class _InMemory:
  """`generate`'s Link over a `SessionPair`: the worker session draws with
  an adaptive proposer, the verifier session's plans run on an `Engine`
  (what `bridge.Verifier` does, no socket)."""

  def __init__(self, caps):
    target, draft = _models()
    self.caps = caps
    self.seconds = collections.defaultdict(float)
    self.in_flight = caps.max_slots
    self.engine = engine_lib.Engine(caps, target)
    self.pair = session_pair.SessionPair(
        caps, secret=h.SECRET, wants_adaptive=True, proposer=_draw_with(
            bridge.draft_proposer(draft, caps, admission=RULE)))
    assert self.pair.open() and self.pair.verifier.adaptive

  def add(self, rid, prompt, seed):
    self.pair.verifier.add_request(rid, prompt, seed)

  def remove(self, rid):
    self.engine.drop(rid)
    self.pair.to_worker(self.pair.remove(rid))

  def start(self, rids, depth):
    message = self.pair.begin(rids, depth)
    key = next(reversed(self.pair.verifier.exchanges))
    return key, collections.deque(self.pair.to_worker(message))

  def finish(self, handle):
    key, inbox = handle
    v = self.pair.verifier
    effects = []
    while inbox:
      effects += self.pair.to_verifier(inbox.popleft())
    (stage,) = [e for e in effects if e.key == key]
    depth = stage.rows.tokens.shape[-1]
    plan = self.pair.validate(stage, audit.proposal_draws(
        *v.draw_inputs(key), depth)).plan
    chains = [engine_lib.Chain(int(r), v.requests[int(r)].tokens,
                               v.requests[int(r)].seed, int(t[0]), int(t[1]))
              for r, t in zip(plan.rids, plan.tags)]
    outcomes = self.engine.run(chains, plan.codes, plan.rows, plan.counts,
                               plan.lengths)
    results, commit = self.pair.commit(plan, outcomes)
    self.pair.to_worker(commit)
    return [generate.Committed(r.rid, r.committed, r.accepted)
            for r in results]

  def round(self, rids, depth):
    return self.finish(self.start(rids, depth))

  def abandon(self):
    self.pair.verifier.abandon()


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("rep", [Representation.SPARSE,
                                 Representation.DENSE])
def test_in_memory_sessions_commit_what_one_process_commits(rep, in_flight,
                                                            form):
  link = _InMemory(_caps(rep, FORMS[form]))
  out = generate.generate(link, PROMPTS, max_new_tokens=12, seed=5,
                          in_flight=in_flight)
  for a, b in zip(_local_tokens(rep), out.tokens):
    np.testing.assert_array_equal(a, b)
  counters = link.pair.verifier.counters
  assert counters.total_errors() == 0 and counters.events("fallbacks") == 0
  assert counters.events("short_answers") > 0
  assert link.pair.worker.counters.total_errors() == 0


@pytest.mark.parametrize("rep,in_flight,form", [
    (Representation.SPARSE, 1, "packed"), (Representation.SPARSE, 2, "frames"),
    (Representation.DENSE, 1, "frames"), (Representation.DENSE, 2, "packed"),
    (Representation.SPARSE, 2, "unagreed")])
def test_the_zeromq_drivers_commit_what_one_process_commits(rep, in_flight,
                                                            form):
  """Every pair of (q format, rounds in flight), each answer form once;
  and a worker with a rule on a session that did not agree on the feature
  (default capabilities): the STEP's depth, fixed depth's tokens."""
  target, draft = _models()
  agreed = form != "unagreed"
  caps = _caps(rep, FORMS[form] if agreed else hello.DEFAULT_FEATURES)
  served = h.serve(bridge.Worker(
      caps, bridge.draft_proposer(draft, caps, admission=RULE),
      secret=h.SECRET))
  verifier = bridge.Verifier(caps, served.address, target=target,
                             secret=h.SECRET, timeout_s=h.GENEROUS_S)
  try:
    if agreed:    # compiles verification at every depth 1..D
      verifier.warmup(PROMPTS[0])
    verifier.open()
    assert verifier.session.adaptive == agreed
    out = generate.generate(generate.Bridged(verifier), PROMPTS,
                            max_new_tokens=12, seed=5, in_flight=in_flight)
  finally:
    served.close()
    verifier.close()
  for a, b in zip(_local_tokens(rep, agreed), out.tokens):
    np.testing.assert_array_equal(a, b)
  assert verifier.counters.total_errors() == 0
  assert verifier.counters.events("fallbacks") == 0
  assert (verifier.counters.events("short_answers") > 0) == agreed
  assert (verifier.counters.events("overlapped") > 0) == (in_flight == 2)


def test_default_capabilities_never_offer_it():
  """Fixed depth stays the default: the HELLO of default capabilities
  offers every other feature of this build, never this one."""
  caps = bridge.Capabilities()
  assert not caps.features & Feature.ADAPTIVE_DEPTH
  body = codec.decode(hello.hello_frame(caps, 1, bytes(32)),
                      codec.HELLO_BOUNDS).body
  assert body.features == int(Feature.PACKED_REPLY | Feature.CONTEXT
                               | Feature.GMAC | Feature.PACKED_STEP) == 15
  assert int(Feature.ADAPTIVE_DEPTH) == 16


@pytest.mark.parametrize("offer", [True, False])
@pytest.mark.parametrize("accept", [True, False])
@pytest.mark.parametrize("wants", [True, False])
def test_agreed_only_when_offered_accepted_and_wanted(offer, accept, wants):
  """The verifier offers it (its capabilities name it), the worker's
  capabilities accept it, and its session wants it (a proposer with a
  rule): all three, or every answer keeps the STEP's depth."""
  verifier_caps = _caps(Representation.SPARSE, FRAMES if offer else 0)
  pair = session_pair.SessionPair(verifier_caps, secret=h.SECRET,
                                  proposer=h.draw_half_rows)
  pair.worker = bridge.WorkerSession(
      dataclasses.replace(verifier_caps,
                          features=FRAMES if accept else 0),
      secret=h.SECRET, wants_adaptive=wants)
  assert pair.open()
  agreed = offer and accept and wants
  assert pair.verifier.adaptive == agreed
  assert pair.worker.established is None     # pending until a frame
  pair.verifier.add_request(0, [1], seed=0)
  seen = []
  pair.proposer = lambda props: (seen.extend(p.adaptive for p in props),
                                 h.draw_half_rows(props))[1]
  plan = pair.run_round([0], 2, draws=None)
  assert seen == [agreed] and not plan.codes.any()
  assert list(plan.lengths) == [2]


def _shorten(rid, d):
  """A proposer that draws every row, then says request `rid` has d."""
  def draw(props):
    h.draw_half_rows(props)
    return {}, {p.entry: d for p in props if p.request == rid}
  return draw


def _pair(features, proposer, *, worker_adaptive=None):
  pair = session_pair.SessionPair(_caps(Representation.SPARSE, features),
                                  secret=h.SECRET, proposer=proposer,
                                  wants_adaptive=True)
  assert pair.open()
  for rid in (0, 1):
    pair.verifier.add_request(rid, [rid + 1], seed=rid)
  if worker_adaptive is not None:
    # A buggy worker that thinks its session agreed on short answers (the
    # pending session becomes the established one at its first STEP).
    pair.worker.pending = pair.worker.pending._replace(
        adaptive=worker_adaptive)
  return pair


def _state(pair):
  v = pair.verifier
  return {r: (list(q.tokens), q.generation, q.round)
          for r, q in v.requests.items()}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_short_answer_without_the_feature_is_refused(form):
  """As any answer of the wrong depth: BAD_SEQUENCE, counted, its request
  falls back; the other request verifies; nothing else changes."""
  features = FORMS[form] & ~Feature.ADAPTIVE_DEPTH
  pair = _pair(features, _shorten(0, 1), worker_adaptive=True)
  assert not pair.verifier.adaptive
  before = _state(pair)
  errors = pair.verifier.counters.total_errors()
  plan = pair.run_round([0, 1], 3, draws=None)
  assert list(plan.codes) == [Code.BAD_SEQUENCE, 0]
  assert list(plan.lengths) == [3, 3]
  assert pair.verifier.counters.errors(Code.BAD_SEQUENCE) == 1
  assert pair.verifier.counters.total_errors() == errors + 1
  assert pair.verifier.counters.events("short_answers") == 0
  # Nothing committed or moved before the plan is committed.
  after = _state(pair)
  assert {r: s[0] for r, s in after.items()} == {
      r: s[0] for r, s in before.items()}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("length", [0, 4])
def test_the_worker_never_sends_a_length_outside_1_to_depth(form, length):
  """The driver's length 0 or past the STEP's depth fails its proposal
  (PROPOSER_FAILED, counted by the worker): that request falls back."""
  pair = _pair(FORMS[form], _shorten(0, length))
  plan = pair.run_round([0, 1], 3, draws=None)
  assert list(plan.codes) == [Code.PROPOSER_FAILED, 0]
  assert pair.worker.counters.errors(Code.PROPOSER_FAILED) == 1


def _edit_packed(pair, message, depth):
  """The PACKED answer with request 0's record depth set, resealed with
  the worker's key (an honest but buggy worker)."""
  buf = bytearray(message)
  f = codec.decode(buf, pair.verifier.bounds)
  f.records["depth"][0] = depth
  return wire_edits.reseal(buf, pair.tagger("session_to_verifier"))


@pytest.mark.parametrize("length,code", [(0, Code.BAD_SEQUENCE),
                                         (3, Code.BAD_SEQUENCE)])
def test_a_packed_record_outside_1_to_depth_is_refused(length, code):
  pair = _pair(PACKED, _shorten(0, 1))
  assert pair.verifier.adaptive
  (message,) = pair.to_worker(pair.begin([0, 1], 2))
  before = _state(pair)
  plan = pair.outcome(collections.deque([_edit_packed(pair, message,
                                                      length)]), draws=None)
  assert list(plan.codes) == [code, 0]
  assert pair.verifier.counters.errors(code) == 1
  assert pair.verifier.counters.total_errors() == 1
  assert _state(pair) == before


def test_a_reply_outside_1_to_depth_is_refused():
  """Per-frame answers: a REPLY of 0 rows is refused by the codec
  (ABSURD_LENGTH); one of more rows than its STEP's (the STEP edited to
  depth 3, the exchange's is 2) by the session (BAD_SEQUENCE)."""
  pair = _pair(FRAMES, _shorten(0, 1))
  step = pair.begin([0, 1], 2)
  message, = pair.to_worker(step)
  frames = h.frames(message)
  assert codec.decode(frames[0], pair.verifier.bounds).body.depth == 1
  to_verifier = pair.tagger("session_to_verifier")
  frames[0] = h.set_field(frames[0], Kind.REPLY, "depth", 0, to_verifier)
  plan = pair.outcome(collections.deque([h.join(h.reframe(
      frames, to_verifier))]), draws=None)
  assert list(plan.codes) == [Code.ABSURD_LENGTH, 0]
  pair.commit(plan, [(0, 5), (0, 6)])
  # A STEP of depth 3 where the verifier's exchange has 2.
  pair.proposer = h.draw_half_rows
  longer = []
  for f in h.frames(pair.begin([0, 1], 2)):
    longer.append(h.set_field(f, Kind.STEP, "depth", 3,
                              pair.tagger("session_to_worker")))
  message, = pair.to_worker(h.join(longer))
  assert codec.decode(h.frames(message)[0],
                      pair.verifier.bounds).body.depth == 3
  errors = pair.verifier.counters.errors(Code.BAD_SEQUENCE)
  plan = pair.outcome(collections.deque([message]), draws=None)
  assert list(plan.codes) == [Code.BAD_SEQUENCE] * 2
  assert pair.verifier.counters.errors(Code.BAD_SEQUENCE) == errors + 2


def test_a_short_answer_leaves_the_others_of_its_batch_at_full_depth():
  """One request short, the other full: the plan's lengths, rows past a
  short one's length not read (their verdicts ignored), the COMMIT of
  what was drawn."""
  pair = _pair(PACKED, _shorten(0, 1))
  plan = pair.run_round([0, 1], 3, draws=None)
  assert not plan.codes.any() and list(plan.lengths) == [1, 3]
  assert pair.verifier.counters.events("short_answers") == 1
  results, commit = pair.commit(plan, [(1, 7), (3, 8)])
  assert [r.accepted for r in results] == [1, 3]
  pair.to_worker(commit)
  assert pair.worker.counters.total_errors() == 0
  view = pair.worker.views[0]
  assert view.anchor == 1 + 2 and view.last_token == 7


def test_the_plan_broadcast_carries_the_lengths():
  """A multi-rank verifier's followers get the leader's lengths (the plan
  padded to max_requests x max_depth and back, `bridge.ranks`)."""
  from dyadic_jax.bridge import ranks  # pylint: disable=g-import-not-at-top
  pair = _pair(PACKED, _shorten(0, 1))
  plan = pair.run_round([0, 1], 3, draws=None)
  size, padded = ranks.pad(plan, pair.caps)
  assert list(padded.lengths) == [1, 3, DEPTH, DEPTH]
  back = ranks.unpad(size, padded)
  np.testing.assert_array_equal(back.lengths, plan.lengths)
  np.testing.assert_array_equal(back.rows.tokens, plan.rows.tokens)
