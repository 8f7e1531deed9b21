"""CONTEXT frames (HELLO feature CONTEXT): negotiation, the prefix the
worker's proposer is handed, its resending, its loss, every refusal of a
CONTEXT frame counted with no state change, the worker's memory budget
(docs/wire.md, "HELLO features: the CONTEXT frame").

In memory (`dyadic_jax.testing.session_pair`), except one run through the
real drivers over ZeroMQ.
"""

import collections
import inspect

import pytest

from dyadic_jax import bridge
from dyadic_jax.testing import session_pair
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.layouts import Feature, Kind
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness as h
from tests import wire_edits

CONTEXT = h.caps(features=Feature.CONTEXT)
PROMPTS = {0: [1, 2, 3], 1: [4]}
_COUNT = layouts.HEADER_BYTES + 4      # the CONTEXT body's count field
_TOKENS = layouts.FIXED_BYTES[Kind.CONTEXT]


class Drafts:
  """The pair's proposer: valid rows (token 0, half the mass on ids 0 and
  1), and every proposal's context, by request."""

  def __init__(self):
    self.contexts = collections.defaultdict(list)

  def __call__(self, props):
    for p in props:
      self.contexts[p.request].append(
          None if p.context is None else p.context.tolist())
    h.draw_half_rows(props)

  def last(self, rid):
    return self.contexts[rid][-1]


def _pair(verifier_caps=CONTEXT, worker_caps=None, wants_context=True,
          **kw):
  drafts = Drafts()
  pair = session_pair.SessionPair(verifier_caps, secret=h.SECRET,
                                  proposer=drafts,
                                  wants_context=wants_context, **kw)
  if worker_caps is not None:
    pair.worker = bridge.WorkerSession(worker_caps, secret=h.SECRET,
                                       wants_context=wants_context)
  assert pair.open()
  for rid, prompt in PROMPTS.items():
    pair.verifier.add_request(rid, prompt, seed=rid)
  return pair, drafts


def _kinds(message):
  return [codec.peek(f)[0] for f in h.frames(message)]


def _round(pair, rids=(0, 1), outcomes=None, commit=True, lose=False):
  """One round; returns the STEP message. outcomes: per request
  (accepted, next token); lose: the answer never arrives (a fallback)."""
  step = pair.begin(list(rids), 2)
  answers = pair.to_worker(step)
  plan = pair.outcome(collections.deque([] if lose else answers),
                      draws=None)
  outcomes = outcomes or [(i % 3, 5 + i) for i in range(len(rids))]
  _, message = pair.commit(plan, outcomes)
  if commit and message is not None:    # None: the session closed
    pair.to_worker(message)
  return step


def _worker_state(pair):
  return {rid: (v.generation, v.round, v.anchor, None if v.context is None
                else v.context.tokens().tolist())
          for rid, v in pair.worker.views.items()}


# -- negotiation ---------------------------------------------------------------


@pytest.mark.parametrize("offer,wants", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_context_only_when_both_sides_agree(offer, wants):
  caps = h.caps(features=Feature.CONTEXT if offer else 0)
  pair, drafts = _pair(caps, wants_context=bool(wants))
  agreed = bool(offer and wants)
  assert bool(pair.verifier.bounds.max_context) == agreed
  steps = [_round(pair) for _ in range(3)]
  first = [Kind.CONTEXT, Kind.STEP] * 2 if agreed else [Kind.STEP] * 2
  assert _kinds(steps[0]) == first
  assert all(_kinds(s) == [Kind.STEP] * 2 for s in steps[1:])
  if not agreed:     # the protocol as before: no frame, no context
    assert all(c is None for cs in drafts.contexts.values() for c in cs)
    assert pair.worker.counters.events("contexts_lost") == 0
  assert pair.worker.counters.events("contexts") == (2 if agreed else 0)
  assert pair.verifier.counters.total_errors() == 0
  assert pair.worker.counters.total_errors() == 0


def test_a_worker_whose_caps_lack_the_feature_is_sent_none():
  # An older build's worker: its features hold PACKED_REPLY alone.
  pair, drafts = _pair(worker_caps=h.caps(features=Feature.PACKED_REPLY))
  assert not pair.verifier.bounds.max_context
  assert _kinds(_round(pair)) == [Kind.STEP] * 2
  assert drafts.last(0) is None


def test_the_worker_bounds_grow_only_with_wants_context():
  plain = bridge.WorkerSession(CONTEXT, secret=h.SECRET)
  wants = bridge.WorkerSession(CONTEXT, secret=h.SECRET, wants_context=True)
  r = CONTEXT.max_requests
  assert plain.max_frames == r and wants.max_frames == 2 * r
  assert plain.max_message == max(layouts.FIXED_BYTES[Kind.HELLO],
                                  r * layouts.FIXED_BYTES[Kind.STEP])
  assert wants.max_message == r * (
      layouts.FIXED_BYTES[Kind.STEP] + layouts.FIXED_BYTES[Kind.CONTEXT]
      + 4 * CONTEXT.max_context)


# -- the prefix ------------------------------------------------------------------


def test_the_context_is_the_committed_prefix_round_after_round():
  pair, drafts = _pair()
  for k in range(5):
    tokens = {rid: list(q.tokens) for rid, q in pair.verifier.requests.items()}
    _round(pair, outcomes=[(k % 3, 5 + k), (2, 7)])
    for rid in PROMPTS:
      assert drafts.last(rid) == tokens[rid]
  for rid, view in pair.worker.views.items():
    assert view.context.tokens().tolist() == pair.verifier.requests[
        rid].tokens
  assert pair.worker.counters.events("contexts") == 2     # sent once each
  assert pair.verifier.counters.events("contexts") == 2
  assert pair.worker.counters.events("contexts_lost") == 0


def test_the_context_is_read_only_and_stays_as_handed():
  pair, _ = _pair()
  got = []
  inner = pair.proposer

  def keep(props):
    got.extend(p.context for p in props)
    inner(props)
  pair.proposer = keep
  _round(pair)
  _round(pair)
  first = got[0]
  assert not first.flags.writeable
  assert first.tolist() == PROMPTS[0]        # later COMMITs appended after
  assert len(got[2]) > len(first)


@pytest.mark.parametrize("how", ["fallback", "reset", "reconnect",
                                 "remove", "restart"])
def test_a_new_generation_resends_the_context(how):
  pair, drafts = _pair()
  _round(pair)
  if how == "fallback":
    _round(pair, lose=True)                  # the answer is lost: TIMEOUT
  elif how == "reset":
    pair.to_worker(pair.reset(0))
  elif how == "reconnect":
    pair.verifier.reconnect()
    assert pair.open()
  elif how == "remove":
    pair.to_worker(pair.remove(0))
    pair.verifier.add_request(0, [9, 8], seed=7)
  else:          # a restarted worker refuses the STEP; the next opens anew
    pair.restart_worker()
    _round(pair)
    assert not pair.verifier.is_open
    assert pair.open()
  for _ in range(2):
    before = list(pair.verifier.requests[0].tokens)
    step = _round(pair)
    assert drafts.last(0) == before
  assert Kind.CONTEXT not in _kinds(step)     # once a generation
  view = pair.worker.views[0]
  assert view.context.tokens().tolist() == pair.verifier.requests[0].tokens


def test_a_lost_commit_makes_the_context_unknown_until_the_next_generation():
  pair, drafts = _pair()
  _round(pair)
  _round(pair, commit=False)                 # the COMMIT is lost
  _round(pair)
  assert drafts.last(0) is None and drafts.last(1) is None
  assert pair.worker.counters.events("contexts_lost") == 2
  assert pair.worker.views[0].context is None
  _round(pair, rids=(0,), lose=True)         # a fallback: generation + 1
  before = list(pair.verifier.requests[0].tokens)
  assert Kind.CONTEXT in _kinds(_round(pair, rids=(0,)))
  assert drafts.last(0) == before


def test_a_prefix_beyond_max_context_is_not_sent():
  caps = h.caps(features=Feature.CONTEXT, max_context=2)
  pair, drafts = _pair(caps)
  assert _kinds(_round(pair)) == [Kind.STEP, Kind.CONTEXT, Kind.STEP]
  assert drafts.last(0) is None and drafts.last(1) == [4]
  assert pair.verifier.counters.events("contexts_too_long") == 1
  assert pair.worker.counters.events("contexts_lost") == 1
  assert pair.worker.counters.total_errors() == 0


# -- refusals --------------------------------------------------------------------


def _first_context(pair):
  """The first round's STEP message of request 0 alone (CONTEXT, STEP),
  not yet delivered, and the session's tagger to reseal edits."""
  step = pair.begin([0], 2)
  assert _kinds(step) == [Kind.CONTEXT, Kind.STEP]
  return h.frames(step), pair.tagger("session_to_worker")


def _set(frame, offset, value, tagger, nbytes=4):
  return wire_edits.set_field(frame, offset, value, nbytes, tagger)


def _flip_tag(frame):
  buf = bytearray(frame)
  buf[layouts.TAG_OFFSET] ^= 1
  return bytes(buf)


EDITS = {
    "too_many": (lambda c, s, t: [_set(c, _COUNT, 9, t), s],
                 Code.ABSURD_LENGTH),
    "none": (lambda c, s, t: [_set(c, _COUNT, 0, t), s], Code.ABSURD_LENGTH),
    "wrong_size": (lambda c, s, t: [_set(c, _COUNT, 2, t), s],
                   Code.UNEXPECTED_SIZE),
    "token_high": (lambda c, s, t: [_set(c, _TOKENS + 4, h.V, t), s],
                   Code.TOKEN_OUT_OF_RANGE),
    "token_negative": (lambda c, s, t: [_set(c, _TOKENS, 2 ** 32 - 1, t),
                                        s], Code.TOKEN_OUT_OF_RANGE),
    "bad_tag": (lambda c, s, t: [_flip_tag(c), s], Code.AUTH_FAILED),
    "after_its_step": (lambda c, s, t: [s, c], Code.BAD_SEQUENCE),
    "alone": (lambda c, s, t: [c], Code.BAD_SEQUENCE),
    "twice": (lambda c, s, t: [c, c, s], Code.BAD_SEQUENCE),
    "other_request": (lambda c, s, t: [_set(c, layouts.HEADER_BYTES, 1, t,
                                            2), s], Code.BAD_SEQUENCE),
    "other_round": (lambda c, s, t: [_set(c, 28, 9, t), s],
                    Code.BAD_SEQUENCE),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_every_bad_context_is_refused_and_changes_nothing(name):
  caps = h.caps(features=Feature.CONTEXT, max_context=8)
  pair, drafts = _pair(caps)
  _round(pair, rids=(1,))           # request 1's view holds a context
  (context, step), tagger = _first_context(pair)
  edit, code = EDITS[name]
  before = _worker_state(pair), pair.worker.context_tokens
  events = pair.worker.counters.snapshot()["events"]
  assert pair.to_worker(h.join(edit(context, step, tagger))) == []
  assert pair.worker.counters.errors(code) == 1
  assert pair.worker.counters.total_errors() == 1
  assert pair.worker.counters.snapshot()["events"] == events
  assert (_worker_state(pair), pair.worker.context_tokens) == before
  assert 0 not in drafts.contexts
  # The message as sent is still drawn, with its context.
  answers = pair.to_worker(h.join([context, step]))
  assert answers and drafts.last(0) == PROMPTS[0]


def test_a_context_on_a_session_without_it_is_unknown_kind():
  pair, drafts = _pair(wants_context=False)
  step = h.frames(pair.begin([0], 2))
  tagger = pair.tagger("session_to_worker")
  context = codec.encode_context(
      session=pair.verifier.session, generation=0, round_id=1, request=0,
      tokens=PROMPTS[0], send=tagger)
  assert pair.to_worker(h.join([context] + step)) == []
  assert pair.worker.counters.errors(Code.UNKNOWN_KIND) == 1
  assert not drafts.contexts


# -- memory ----------------------------------------------------------------------


def test_the_budget_evicts_the_least_recently_used_contexts():
  caps = h.caps(features=Feature.CONTEXT, max_requests=4)
  pair, drafts = _pair(caps, context_budget=10)
  for rid in (2, 3):
    pair.verifier.add_request(rid, [rid] * 4, seed=rid)
  _round(pair, rids=(0, 1), outcomes=[(0, 1), (0, 1)])   # 4 + 2 tokens
  assert pair.worker.context_tokens == 6
  _round(pair, rids=(2,), outcomes=[(0, 1)])            # + 5: over 10
  assert pair.worker.counters.events("contexts_evicted") == 1
  assert pair.worker.views[0].context is None            # least recent
  assert pair.worker.context_tokens == 7 <= pair.worker.context_budget
  _round(pair, rids=(0, 2), outcomes=[(0, 1), (0, 1)])
  assert drafts.last(0) is None and drafts.last(2) == [2] * 4 + [1]
  assert pair.worker.counters.events("contexts_lost") == 1


def test_remove_drops_the_context():
  pair, _ = _pair()
  _round(pair)
  pair.to_worker(pair.remove(0))
  assert 0 not in pair.worker.views
  assert pair.worker.context_tokens == pair.worker.views[1].context.n


# -- the drivers -----------------------------------------------------------------


class _Recording(h.Tampering):
  """A worker that records every proposal's context (then draws with the
  real proposer, `request=` and `context=` included)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, wants_context=True, **kwargs)
    self.contexts = []

  def draw(self, p):
    self.contexts.append((p.request, None if p.context is None
                          else p.context.tolist()))
    super().draw(p)


def test_rounds_through_the_drivers_carry_the_context():
  c = h.caps(features=Feature.CONTEXT)
  with h.running(c, worker_cls=_Recording) as (worker, verifier):
    prefixes = []
    for _ in range(3):
      prefixes.append({r: list(q.tokens)
                       for r, q in verifier.session.requests.items()})
      results = verifier.round(list(range(c.max_requests)))
      assert not any(r.fallback for r in results)
    assert worker.max_message == worker.session.max_message > 1024
    got = collections.defaultdict(list)
    for rid, ctx in worker.contexts:
      got[rid].append(ctx)
    for rid in range(c.max_requests):
      assert got[rid] == [p[rid] for p in prefixes]
    assert worker.counters.total_errors() == 0


def test_serve_forever_takes_wants_context():
  assert "wants_context" in inspect.signature(bridge.serve_forever).parameters


def test_a_restarted_worker_refuses_a_message_that_opens_with_a_context():
  # The worker's refusal is keyed by the message's first frame: here the
  # CONTEXT, and the verifier still takes it (and opens a new session).
  pair, drafts = _pair()
  pair.restart_worker()
  step = pair.begin([0, 1], 2)
  assert _kinds(step)[0] == Kind.CONTEXT
  (refusal,) = pair.to_worker(step)
  plan = pair.outcome(collections.deque([refusal]), draws=None)
  assert list(plan.codes) == [Code.UNKNOWN_SESSION] * 2
  assert pair.verifier.counters.errors(Code.AUTH_FAILED) == 0
  assert not pair.verifier.is_open and pair.open()
  pair.commit(plan, [(0, 5), (0, 6)])
  before = {r: list(q.tokens) for r, q in pair.verifier.requests.items()}
  assert _kinds(_round(pair))[0] == Kind.CONTEXT
  assert drafts.last(0) == before[0] and drafts.last(1) == before[1]
