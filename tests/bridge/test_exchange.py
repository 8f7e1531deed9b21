"""The round in flight's state table (`bridge.exchange`): every edge a
session takes is in the table, every other event is an ExchangeError, and
the sessions' rounds walk the table (answered, staged, judged; late or
refused in full: failed)."""

import pytest

from dyadic_jax.bridge import exchange as exchange_lib
from dyadic_jax.bridge.effects import Stage, Verify
from dyadic_jax.bridge.exchange import Event, ExchangeError, State
from dyadic_jax.testing import session_pair
from dyadic_jax.wire.layouts import Feature
from tests import bridge_harness as h

DEPTH = 2


def _pair(caps):
  pair = session_pair.SessionPair(
      caps, secret=h.SECRET, proposer=h.draw_keyed_rows,
      worker_entropy=session_pair.CountingEntropy(0),
      verifier_entropy=session_pair.CountingEntropy(1))
  assert pair.open()
  for rid in (0, 1):
    pair.verifier.add_request(rid, [rid + 1], seed=rid)
  return pair


def _begin(pair, rids):
  send, ex = pair.verifier.begin(rids, DEPTH, pair.now)
  return send.message, ex


STATES = {State.SENT, State.ANSWERING, State.STAGED, State.DONE,
          State.FAILED}
EVENTS = (Event.ANSWER, Event.STAGE, Event.VERDICT, Event.FALL_BACK)


def test_the_table_names_every_state_and_ends_in_done_or_failed():
  assert set(exchange_lib.TRANSITIONS) == STATES
  assert exchange_lib.TRANSITIONS[State.DONE] == {}
  assert exchange_lib.TRANSITIONS[State.FAILED] == {}
  reached = {nxt for edges in exchange_lib.TRANSITIONS.values()
             for nxt in edges.values()}
  assert reached == STATES - {State.SENT}
  assert {e for edges in exchange_lib.TRANSITIONS.values()
          for e in edges} == set(EVENTS)


@pytest.mark.parametrize("features", [Feature.PACKED_REPLY, Feature(0)],
                         ids=["packed", "frames"])
def test_a_round_walks_sent_answering_staged_done(features):
  pair = _pair(h.caps(features=features))
  step, ex = _begin(pair, [0, 1])
  assert ex.state == State.SENT and ex.key in pair.verifier.exchanges
  effects = []
  for message in pair.to_worker(step):
    effects += pair.to_verifier(message)
  (stage,) = effects
  assert isinstance(stage, Stage) and ex.state == State.STAGED
  verdict = pair.caps.format.validate(stage.rows, vocab=pair.caps.vocab,
                                      draws=None)
  pair.verifier.staged(verdict, stage.key)
  assert ex.state == State.DONE and not pair.verifier.exchanges


def test_a_deadline_fails_the_exchange_and_an_illegal_event_raises():
  pair = _pair(h.caps())
  _, ex = _begin(pair, [0])
  (verify,) = pair.verifier.poll(ex.deadline)
  assert isinstance(verify, Verify) and ex.state == State.FAILED
  for event in EVENTS:
    with pytest.raises(ExchangeError, match="failed"):
      ex.fire(event)


def test_begin_takes_the_deadline_and_expire_ends_an_unsent_step():
  pair = _pair(h.caps())
  _, ex = pair.verifier.begin([0], DEPTH, 10.0, timeout_s=3.0)
  assert ex.deadline == 13.0
  assert pair.verifier.poll(12.0) == []
  pair.verifier.expire(ex.key)
  (verify,) = pair.verifier.poll(0.0)
  assert verify.key == ex.key and ex.state == State.FAILED


def test_every_round_has_one_number_fallback_rounds_too():
  pair = _pair(h.caps())
  _, first = _begin(pair, [0])
  bare = pair.verifier.fallback([1], 7)
  (verify,) = pair.verifier.poll(first.deadline)
  assert verify.key == verify.plan.key == first.key
  assert bare.key == bare.plan.key == first.key + 1
  _, third = _begin(pair, [1])
  assert third.key == first.key + 2
