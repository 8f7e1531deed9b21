"""Two rounds in flight (HELLO `max_slots` 2): the verifier begins group
B's round before it has verified group A's, so the worker drafts one while
the verifier verifies the other.

In memory (`dyadic_jax.testing.session_pair`), PACKED and per-frame
answers: each exchange has its own tags, deadline, staging slot and
fallback, and whatever happens to one (its answer dropped, corrupted,
refused or late) never touches the other; for the same keys the plans
equal those of one round at a time. The drivers over ZeroMQ:
tests/bridge/test_generate.py (same tokens with one or two in flight).
"""

import collections

import numpy as np
import pytest

from dyadic_jax import bridge
from dyadic_jax.bridge.effects import Stage, Verify
from dyadic_jax.testing import session_pair
from dyadic_jax.wire.layouts import Feature
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness as h

A, B = [0, 1], [2, 3]
DEPTH = 2
FORMS = {"packed": h.caps(features=Feature.PACKED_REPLY),
         "frames": h.caps(),
         "packed_step": h.caps(features=Feature.PACKED_REPLY
                               | Feature.PACKED_STEP),
         "frames_step": h.caps(features=Feature.PACKED_STEP)}


def _pair(caps, entropy=0):
  pair = session_pair.SessionPair(
      caps, secret=h.SECRET, proposer=h.draw_keyed_rows,
      worker_entropy=session_pair.CountingEntropy(entropy),
      verifier_entropy=session_pair.CountingEntropy(entropy + 1))
  assert pair.open()
  for rid in A + B:
    pair.verifier.add_request(rid, [rid + 1], seed=rid)
  return pair


def _plan(pair, effect):
  """The Plan of an exchange's effect (a Stage validated; no sampling
  audit: the stand-in proposer draws token 0 whatever the key)."""
  if isinstance(effect, Stage):
    assert pair.verifier.draw_inputs(effect.key)[0].tolist() == [
        pair.verifier.requests[r].seed for r in pair.verifier.exchanges[
            effect.key].rids]
    verdict = pair.caps.format.validate(effect.rows, vocab=pair.caps.vocab,
                                        draws=None)
    effect = pair.verifier.staged(verdict, effect.key)
  assert isinstance(effect, Verify)
  return effect.plan


def _commit(pair, plan):
  """Commits a plan (accept every draft, a fixed next token), as a
  verifier would after running it; the COMMIT goes to the worker."""
  outcomes = [(0, 1) if code else (DEPTH, 2) for code in plan.codes]
  results, commit = pair.commit(plan, outcomes)
  if commit is not None:
    pair.to_worker(commit)
  return results


def _both(pair):
  """Begins A then B; returns the worker's answer to each."""
  (a,) = pair.to_worker(pair.begin(A, DEPTH))
  (b,) = pair.to_worker(pair.begin(B, DEPTH))
  assert len(pair.verifier.exchanges) == 2
  return a, b


def _only(effects):
  (effect,) = effects
  return effect


def _summary(plan):
  return (plan.rids.tolist(), plan.tags.tolist(), plan.codes.tolist(),
          plan.rows.tokens.tolist())


@pytest.mark.parametrize("form", sorted(FORMS))
def test_two_in_flight_commit_what_one_at_a_time_commits(form):
  """Three rounds of each group, interleaved A B A B A B with the next
  round of a group begun before the other group's is verified, against
  the same rounds one at a time, and those of the per-frame form: the
  same plans (tags, drafted tokens: a function of every field of each
  request's STEP) and the same committed tokens."""
  one, two, frames = (_pair(FORMS[form]), _pair(FORMS[form]),
                      _pair(FORMS["frames"]))
  plans_one, plans_two = [], []
  for _ in range(3):
    for group in (A, B):
      plan = one.run_round(group, DEPTH, draws=None)
      plans_one.append(_summary(plan))
      _commit(one, plan)
      want = frames.run_round(group, DEPTH, draws=None)
      assert _summary(want) == plans_one[-1]
      _commit(frames, want)
  a, b = _both(two)
  for r in range(3):
    plan = _plan(two, _only(two.to_verifier(a)))
    plans_two.append(_summary(plan))
    _commit(two, plan)
    if r < 2:     # A's next round goes out before B is verified
      (a,) = two.to_worker(two.begin(A, DEPTH))
    plan = _plan(two, _only(two.to_verifier(b)))
    plans_two.append(_summary(plan))
    _commit(two, plan)
    if r < 2:
      (b,) = two.to_worker(two.begin(B, DEPTH))
  assert plans_two == plans_one
  for rid in A + B:
    assert (two.verifier.requests[rid].tokens
            == one.verifier.requests[rid].tokens
            == frames.verifier.requests[rid].tokens)
  assert two.verifier.counters.events("overlapped") == 5
  assert one.verifier.counters.events("overlapped") == 0
  for side in (two.verifier, two.worker):
    assert side.counters.total_errors() == 0


def test_a_third_round_or_a_request_in_flight_is_refused():
  pair = _pair(FORMS["packed"])
  _both(pair)
  with pytest.raises(RuntimeError, match="max_slots"):
    pair.begin([4], DEPTH)
  pair.verifier.exchanges.pop(max(pair.verifier.exchanges))
  with pytest.raises(ValueError, match="in flight"):
    pair.begin([1], DEPTH)


def test_one_slot_keeps_one_round_in_flight():
  pair = _pair(h.caps(features=Feature.PACKED_REPLY, max_slots=1))
  pair.to_worker(pair.begin(A, DEPTH))
  with pytest.raises(RuntimeError, match="max_slots"):
    pair.begin(B, DEPTH)


def test_the_two_exchanges_hold_two_staging_slots():
  pair = _pair(FORMS["frames"])
  _both(pair)
  first, second = pair.verifier.exchanges.values()
  assert first.slot is not second.slot
  assert {id(first.slot), id(second.slot)} == {
      id(s) for s in pair.verifier.slots}


def _check_b_commits(pair, b):
  """B's answer still stages, verifies and commits in full."""
  plan = _plan(pair, _only(pair.to_verifier(b)))
  assert plan.rids.tolist() == B and not plan.codes.any()
  results = _commit(pair, plan)
  assert [r.fallback for r in results] == [False, False]


def _check_a_fell_back(pair, effects, code):
  plan = _plan(pair, _only(effects))
  assert plan.rids.tolist() == A
  assert plan.codes.tolist() == [code, code]
  results = _commit(pair, plan)
  assert all(r.fallback and r.code == code for r in results)
  for rid in A:
    assert pair.verifier.requests[rid].generation == 1


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_dropped_answer_times_out_alone(form):
  pair = _pair(FORMS[form])
  _, b = _both(pair)          # A's answer is lost
  _check_b_commits(pair, b)
  pair.now += pair.verifier.timeout_s
  _check_a_fell_back(pair, pair.poll(), Code.TIMEOUT)
  assert pair.verifier.counters.errors(Code.TIMEOUT) == 2
  assert pair.verifier.counters.total_errors() == 2
  assert not pair.verifier.exchanges


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_corrupted_answer_is_dropped_and_touches_nothing_else(form):
  """A flipped bit: AUTH_FAILED, dropped unattributed; A times out, B is
  untouched, in either order of arrival."""
  for b_first in (False, True):
    pair = _pair(FORMS[form])
    a, b = _both(pair)
    bad = bytearray(a)
    bad[-1] ^= 1
    if b_first:
      _check_b_commits(pair, b)
    assert pair.to_verifier(bytes(bad)) == []
    assert pair.verifier.counters.errors(Code.AUTH_FAILED) == 1
    if not b_first:
      _check_b_commits(pair, b)
    pair.now += pair.verifier.timeout_s
    _check_a_fell_back(pair, pair.poll(), Code.TIMEOUT)


def test_a_worker_refusal_of_one_step_fails_that_round_alone():
  """A's requests refused in their answer (an honest worker whose draft
  failed: a status): A falls back with that code at once, B commits."""
  for form in sorted(FORMS):
    pair = _pair(FORMS[form])

    def draw(props):
      h.draw_half_rows(props)
      return {p.entry: Code.PROPOSER_FAILED for p in props
              if p.request in A}

    pair.proposer = draw
    a, b = _both(pair)
    _check_a_fell_back(pair, pair.to_verifier(a), Code.PROPOSER_FAILED)
    pair.proposer = h.draw_half_rows
    _check_b_commits(pair, b)


def test_a_late_answer_is_stale_after_its_round_fell_back():
  pair = _pair(FORMS["packed"])
  a, b = _both(pair)
  pair.now += pair.verifier.timeout_s
  effects = pair.poll()      # both past their deadline: both fall back
  assert sorted(_plan(pair, e).rids.tolist()[0] for e in effects) == [0, 2]
  for effect in effects:
    _commit(pair, effect.plan)
  before = pair.verifier.counters.errors(Code.STALE_GENERATION)
  assert pair.to_verifier(a) == [] and pair.to_verifier(b) == []
  assert pair.verifier.counters.errors(Code.STALE_GENERATION) - before == 4


def test_b_answered_first_is_kept_until_a_is_verified():
  """Answers may come in any order: each stages into its own slot."""
  pair = _pair(FORMS["packed"])
  a, b = _both(pair)
  stage_b = _only(pair.to_verifier(b))
  stage_a = _only(pair.to_verifier(a))
  assert isinstance(stage_a, Stage) and isinstance(stage_b, Stage)
  assert stage_a.key < stage_b.key
  assert _plan(pair, stage_a).rids.tolist() == A
  assert _plan(pair, stage_b).rids.tolist() == B


def test_a_reconnect_ends_both_rounds():
  pair = _pair(FORMS["packed"])
  a, b = _both(pair)
  pair.verifier.reconnect()
  effects = pair.poll()
  assert [e.plan.rids.tolist() for e in effects] == [A, B]
  assert all((e.plan.codes == Code.TIMEOUT).all() for e in effects)
  assert not pair.verifier.exchanges


def test_the_answers_of_both_rounds_in_one_inbox():
  """`outcome` over an inbox that holds B's answer before A's."""
  pair = _pair(FORMS["packed"])
  a, b = _both(pair)
  effects = []
  for message in collections.deque([b, a]):
    effects += pair.to_verifier(message)
  assert sorted(e.key for e in effects) == sorted(pair.verifier.exchanges)
  assert np.all([isinstance(e, Stage) for e in effects])


class _WarpAfter(bridge.Counters):
  """Verifier counters that warp the clock past every deadline once the
  `n`-th message has been received: what the driver read by then counts,
  and whatever is still out times out (no wall-clock wait)."""

  def __init__(self, clock, n):
    super().__init__("verifier")
    self.clock, self.left = clock, n

  def event(self, name, n=1):
    super().event(name, n)
    if name == "bytes_in":
      self.left -= 1
      if self.left == 0:
        self.clock.warp()


def _drop(messages, tagger):
  del messages, tagger


def _flip(messages, tagger):
  del tagger
  bad = bytearray(messages[-1])
  bad[-1] ^= 1
  return messages[:-1] + [bytes(bad)]


@pytest.mark.parametrize("tamper,received", [(_drop, 1), (_flip, 2)])
def test_the_driver_commits_b_while_a_answer_is_lost(tamper, received):
  """Over ZeroMQ: A's answer dropped (or corrupted: AUTH_FAILED) while
  B's arrives. `finish(A)` keeps B's answer for B and times A out;
  `finish(B)` verifies B in full."""
  c = h.caps(features=Feature.PACKED_REPLY)
  with h.running(c, requests=4) as (worker, verifier):
    verifier.round(A)                    # warm, in sync
    verifier.round(B)
    verifier.session.counters = _WarpAfter(verifier.clock, received)
    worker.tamper = tamper
    a = verifier.start(A)
    b = verifier.start(B)
    lost = verifier.finish(a)
    kept = verifier.finish(b)
  assert [r.rid for r in lost] == A and [r.rid for r in kept] == B
  assert all(r.fallback and r.code == Code.TIMEOUT for r in lost)
  assert not any(r.fallback for r in kept)
  errors = verifier.counters.snapshot()["errors"]
  want = {"TIMEOUT": 2}
  if tamper is _flip:
    want["AUTH_FAILED"] = 1
  assert errors == want
  assert verifier.counters.events("overlapped") == 1


@pytest.mark.parametrize("swap", [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3),
                                  (2, 3)])
def test_a_reordered_answer_fails_its_own_round_alone(swap):
  """B's per-frame answer with two frames swapped, read before A's: what
  of it cannot be attributed to one request fails B's unanswered requests
  (or nothing, once B is answered in full), never A's, though both
  rounds carry the same (generation, round) (the two-in-flight soak
  found A failed with BAD_SEQUENCE for B's frames)."""
  pair = _pair(FORMS["frames"])
  a, b = _both(pair)
  frames = h.frames(b)
  i, j = swap
  frames[i], frames[j] = frames[j], frames[i]
  effects = pair.to_verifier(h.join(frames)) + pair.to_verifier(a)
  pair.now += pair.verifier.timeout_s        # what B still waits for
  effects += pair.poll()
  plans = {p.rids.tolist()[0]: p for p in (_plan(pair, e) for e in effects)}
  assert sorted(plans) == [A[0], B[0]]
  assert not plans[A[0]].codes.any(), plans[A[0]].codes
  assert plans[B[0]].codes.any()      # a swap always breaks B's sequence
