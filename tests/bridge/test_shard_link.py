"""A shard link's two sessions (`bridge.shard_link`) in memory: no socket,
no thread, no clock; the time is an argument. The socket drivers are
tests/bridge/test_rank_links.py's."""

import numpy as np

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
