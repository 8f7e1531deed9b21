"""A shard link's two sessions (`bridge.shard_link`) in memory: no socket,
no thread, no clock; the time is an argument. Two rounds in flight (the
leader's two exchanges): each ends on its own, a fault in one changes no
other. The socket drivers are tests/bridge/test_rank_links.py's."""

import numpy as np
import pytest

from dyadic_jax.bridge import hello, shard_link
from dyadic_jax.wire import layouts
from dyadic_jax.wire.refusals import Code

SECRET = bytes(range(32))
CAPS = hello.Capabilities(vocab=1000, max_depth=3, max_requests=2,
                          representation=layouts.Representation.DENSE,
                          shards=2).link(1)


def _open():
  verifier = shard_link.ShardLinkSession(CAPS, secret=SECRET, timeout_s=1.0)
  worker = shard_link.ShardSourceSession(CAPS, secret=SECRET)
  for answer in worker.receive(verifier.hello(0.0).message):
    confirm = verifier.receive(answer.message, 0.0)
  assert verifier.is_open and worker.link is None   # not confirmed yet
  for send in confirm:
    assert worker.receive(send.message) == []
  assert worker.link_session == verifier.session
  return verifier, worker


def _reply(worker, request, tag, value):
  reply = worker.reply(request, tag, 3)
  reply.rows.values[:] = value
  reply.rows.tokens[:] = [5, 6, 7]
  reply.rows.n[:] = CAPS.width
  return bytes(worker.seal(reply))


def test_a_round_is_collected_when_every_frame_is_in():
  verifier, worker = _open()
  assert verifier.begin([10, 11], [(0, 4), (0, 4)], 3, now=1.0) == []
  assert verifier.receive(_reply(worker, 10, (0, 4), 0.25), 1.1) == []
  (done,) = verifier.receive(_reply(worker, 11, (0, 4), 0.5), 1.2)
  assert isinstance(done, shard_link.Collected)
  assert done.codes.tolist() == [0, 0]
  np.testing.assert_array_equal(done.rows.values[1, :3], 0.5)
  assert verifier.figures()["request_rounds"] == 2
  assert verifier.counters.total_errors() == 0


def test_stale_forged_and_missing_frames_are_refused():
  verifier, worker = _open()
  verifier.begin([10], [(0, 4)], 3, now=0.0)
  forged = bytearray(_reply(worker, 10, (0, 4), 0.25))
  forged[200] ^= 1
  assert verifier.receive(_reply(worker, 10, (0, 3), 0.25), 0.1) == []
  assert verifier.receive(bytes(forged), 0.2) == []
  assert verifier.poll(0.5) == []                   # before the deadline
  (done,) = verifier.poll(1.0)
  assert done.codes.tolist() == [Code.TIMEOUT]
  errors = verifier.counters.snapshot()["errors"]
  assert errors["DUPLICATE_ROUND"] == 1 and errors["AUTH_FAILED"] == 1
  # A round without one good frame: the next one says HELLO first.
  (again,) = verifier.begin([10], [(0, 5)], 3, now=2.0)
  assert not verifier.is_open
  for answer in worker.receive(again.message):
    verifier.receive(answer.message, 2.0)
  assert verifier.is_open


def test_no_frame_before_a_confirmed_session():
  worker = shard_link.ShardSourceSession(CAPS, secret=SECRET)
  assert worker.reply(0, (0, 1), 3) is None
  # A HELLO answered but never confirmed does not take the link.
  verifier = shard_link.ShardLinkSession(CAPS, secret=SECRET)
  worker.receive(verifier.hello(0.0).message)
  assert worker.reply(0, (0, 1), 3) is None


def test_two_rounds_in_flight_each_end_on_their_own():
  """Rounds A and B in flight (the leader's two exchanges): B's frames come
  first and complete B; A's frame is forged, so A ends at its deadline
  with a TIMEOUT. Each is staged in its own buffer: B's rows are B's."""
  verifier, worker = _open()
  assert verifier.begin([10], [(0, 4)], 3, now=0.0, key=7) == []
  assert verifier.begin([11, 12], [(0, 2), (1, 0)], 3, now=0.1, key=8) == []
  forged = bytearray(_reply(worker, 10, (0, 4), 0.25))
  forged[200] ^= 1
  assert verifier.receive(_reply(worker, 12, (1, 0), 0.75), 0.2) == []
  assert verifier.receive(bytes(forged), 0.3) == []
  (b,) = verifier.receive(_reply(worker, 11, (0, 2), 0.5), 0.4)
  assert b.key == 8 and b.codes.tolist() == [0, 0]
  assert verifier.poll(0.9) == []                 # A's deadline is 1.0
  (a,) = verifier.poll(1.0)
  assert a.key == 7 and a.codes.tolist() == [Code.TIMEOUT]
  assert a.rows is not b.rows
  np.testing.assert_array_equal(b.rows.values[0, :3], 0.5)
  np.testing.assert_array_equal(b.rows.values[1, :3], 0.75)
  np.testing.assert_array_equal(a.rows.values, 0.0)   # nothing staged
  assert verifier.counters.errors(Code.AUTH_FAILED) == 1
  # A ended unheard, but the link carried B's frames meanwhile: no HELLO.
  verifier.release(7)
  assert verifier.begin([10], [(0, 5)], 3, now=1.1, key=9) == []
  assert verifier.is_open


def test_a_frame_of_one_round_never_lands_in_the_other():
  """A frame names its request: a frame of A's request with B's tag, or
  of a request of no round in flight, is refused and counted; B, in
  flight beside A, keeps its requests' frames only."""
  verifier, worker = _open()
  verifier.begin([10], [(0, 4)], 3, now=0.0, key=1)
  verifier.begin([11], [(0, 9)], 3, now=0.0, key=2)
  assert verifier.receive(_reply(worker, 10, (0, 9), 0.5), 0.1) == []
  assert verifier.receive(_reply(worker, 13, (0, 4), 0.5), 0.1) == []
  errors = verifier.counters.snapshot()["errors"]
  assert errors == {"DUPLICATE_ROUND": 1, "STALE_GENERATION": 1}
  (a,) = verifier.receive(_reply(worker, 10, (0, 4), 0.25), 0.2)
  (b,) = verifier.receive(_reply(worker, 11, (0, 9), 0.5), 0.3)
  assert (a.key, b.key) == (1, 2)
  assert a.codes.tolist() == b.codes.tolist() == [0]
  np.testing.assert_array_equal(a.rows.values[0, :3], 0.25)


def test_a_silent_link_says_hello_again_with_a_round_in_flight():
  """Neither round hears a frame (a dead worker rank): the next round
  begins with a fresh HELLO although B is still in flight."""
  verifier, worker = _open()
  verifier.begin([10], [(0, 4)], 3, now=0.0, key=1)
  verifier.begin([11], [(0, 4)], 3, now=0.5, key=2)
  (a,) = verifier.poll(1.0)
  assert a.key == 1 and verifier.silent
  verifier.release(1)
  (hello_,) = verifier.begin([10], [(0, 5)], 3, now=1.0, key=3)
  assert not verifier.is_open and verifier.in_flight(2)
  for answer in worker.receive(hello_.message):
    verifier.receive(answer.message, 1.0)
  assert verifier.is_open


def test_misuse_of_rounds_is_refused_and_changes_nothing():
  verifier, _ = _open()
  verifier.begin([10, 11], [(0, 4), (0, 4)], 3, now=0.0, key=1)
  with pytest.raises(RuntimeError, match="in flight"):
    verifier.begin([12], [(0, 4)], 3, now=0.0, key=1)
  with pytest.raises(RuntimeError, match=r"\[11\]"):
    verifier.begin([11], [(0, 5)], 3, now=0.0, key=2)
  verifier.begin([12], [(0, 4)], 3, now=0.0, key=2)
  (_, _) = verifier.poll(2.0)
  # Both buffers are held until their rounds are released (max_slots 2).
  with pytest.raises(RuntimeError, match="buffers held"):
    verifier.begin([13], [(0, 4)], 3, now=2.0, key=3)
  assert not verifier.in_flight(3)
  verifier.release(1)
  verifier.begin([13], [(0, 4)], 3, now=2.0, key=3)
  assert verifier.in_flight(3) and verifier.round_deadline(3) == 3.0
