"""A rank link's two ends (`bridge.rank_links`) over real loopback sockets.

ShardSender (worker rank s) and ShardReceiver (verifier rank s) in one
process: the HELLO with the block's capabilities, REPLY frames of block s
staged only when authentic, of this link's session and of the round's
tags; anything else is refused with its code and counted, and a request
whose frame never comes is a TIMEOUT; with two rounds in flight a fault in
one leaves the other whole. The multi-process agreement and the
pipeline's faults across ranks are tests/experiments/test_pp1_pipeline.py's.
"""

import threading
import time

import numpy as np
import pytest

from dyadic_jax.bridge import hello, rank_links
from dyadic_jax.wire import layouts
from dyadic_jax.wire.refusals import Code, ProtocolError

SECRET = bytes(range(32))
CAPS = hello.Capabilities(vocab=1000, max_depth=3, max_requests=2,
                          representation=layouts.Representation.DENSE,
                          shards=2)


@pytest.fixture
def link():
  sender = rank_links.ShardSender(CAPS.link(1), "tcp://127.0.0.1:0",
                                  secret=SECRET)
  receiver = rank_links.ShardReceiver(CAPS.link(1), sender.address,
                                      secret=SECRET, timeout_s=5.0)
  receiver.open(attempts=3)
  _wait(lambda: sender.link_session is not None)   # the confirmation is in
  yield sender, receiver
  receiver.close()
  sender.close()


def _wait(condition):
  deadline = time.monotonic() + 60      # a guard, not a measurement
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert condition()


def _send(sender, request, tag, depth=3, seed=0, edit=None):
  reply = sender.frame(request, tag, depth)
  assert reply is not None
  rows = reply.rows
  values = np.random.default_rng(seed).random((depth, CAPS.width))
  rows.values[:] = values.astype(np.float32)
  rows.tokens[:] = [5, 6, 7][:depth]
  rows.n[:] = CAPS.width
  values = rows.values.copy()
  if edit is None:
    sender.send(reply)
    return values
  # Damage after sealing: what a wire fault does (a forger has no key).
  raw = bytearray(sender.session.seal(reply))
  edit(raw)
  sender._outbox.put(bytes(raw))  # pylint: disable=protected-access
  return values


def test_capabilities_of_a_link():
  assert CAPS.width == 500
  assert CAPS.link(0).shard_range == (0, 500)
  assert CAPS.link(1).shard_range == (500, 1000)
  uneven = hello.Capabilities(vocab=1001, representation=(
      layouts.Representation.DENSE), shards=2, shard=1)
  assert uneven.width == 501 and uneven.shard_range == (501, 1001)
  with pytest.raises(ValueError):
    hello.Capabilities(shards=2)      # sparse q keeps one link
  with pytest.raises(ValueError):
    CAPS.link(2)


def test_frames_of_the_round_are_staged(link):
  sender, receiver = link
  want = [_send(sender, rid, (0, 4), seed=rid) for rid in (10, 11)]
  rows, codes = receiver.collect([10, 11], [(0, 4), (0, 4)], 3)
  assert codes.tolist() == [0, 0]
  for i in range(2):
    np.testing.assert_array_equal(rows.values[i, :3], want[i])
    assert rows.tokens[i, :3].tolist() == [5, 6, 7]
  assert receiver.counters.total_errors() == 0
  assert receiver.figures()["request_rounds"] == 2


def test_stale_and_forged_frames_are_refused(link):
  sender, receiver = link
  _send(sender, 10, (0, 3))                     # last round's tag
  _send(sender, 10, (0, 4), edit=lambda f: f.__setitem__(
      200, f[200] ^ 1))                         # one bit of q flipped
  receiver.timeout_s = 0.5
  _, codes = receiver.collect([10], [(0, 4)], 3)
  assert codes.tolist() == [Code.TIMEOUT]
  errors = receiver.counters.snapshot()["errors"]
  assert errors["DUPLICATE_ROUND"] == 1 and errors["AUTH_FAILED"] == 1
  assert errors["TIMEOUT"] == 1
  # A round without one good frame: the next one starts with a new HELLO
  # (the worker rank may be a restarted process), and its frame, sent
  # under the new session, is staged.
  receiver.timeout_s = 5.0
  before = sender.link_session
  out = []
  collect = threading.Thread(target=lambda: out.append(receiver.collect(
      [10], [(0, 5)], 3)))
  collect.start()
  _wait(lambda: sender.link_session != before)
  want = _send(sender, 10, (0, 5))
  collect.join()
  rows, codes = out[0]
  assert codes.tolist() == [0]
  np.testing.assert_array_equal(rows.values[0, :3], want)


def test_two_rounds_in_flight_a_fault_in_one_leaves_the_other(link):
  """Rounds A and B in flight on one link (the leader's two exchanges): A's
  frame is forged, B's come whole. A ends at its deadline (TIMEOUT) while
  B's frames, read meanwhile, wait staged for B's finish; the session
  stays (the link was heard), and the next round is staged as usual."""
  sender, receiver = link
  before = sender.link_session
  receiver.timeout_s = 0.5            # A's deadline: it must pass
  receiver.begin([10], [(0, 4)], 3, key=1)
  receiver.timeout_s = 60.0           # B's: never reached
  receiver.begin([11, 12], [(0, 4), (0, 4)], 3, key=2)
  want = [_send(sender, rid, (0, 4), seed=rid) for rid in (11, 12)]
  _send(sender, 10, (0, 4), edit=lambda f: f.__setitem__(200, f[200] ^ 1))
  _, codes = receiver.finish(1)
  assert codes.tolist() == [Code.TIMEOUT]
  rows, codes = receiver.finish(2)
  assert codes.tolist() == [0, 0]
  for i in range(2):
    np.testing.assert_array_equal(rows.values[i, :3], want[i])
  with pytest.raises(RuntimeError, match="not in flight"):
    receiver.finish(2)
  assert receiver.counters.errors(Code.AUTH_FAILED) == 1
  receiver.begin([10], [(0, 5)], 3, key=3)
  want = _send(sender, 10, (0, 5), seed=3)
  rows, codes = receiver.finish(3)
  assert codes.tolist() == [0] and sender.link_session == before
  np.testing.assert_array_equal(rows.values[0, :3], want)


def test_another_block_is_refused_at_hello():
  sender = rank_links.ShardSender(CAPS.link(1), "tcp://127.0.0.1:0",
                                  secret=SECRET)
  try:
    receiver = rank_links.ShardReceiver(CAPS.link(0), sender.address,
                                        secret=SECRET, timeout_s=2.0)
    with pytest.raises(ProtocolError) as e:
      receiver.open(attempts=2)
    assert e.value.code == Code.IDENTITY_MISMATCH
    assert sender.counters.errors(Code.IDENTITY_MISMATCH) == 1
    receiver.close()
  finally:
    sender.close()


def test_a_peer_without_the_key_opens_nothing():
  sender = rank_links.ShardSender(CAPS.link(1), "tcp://127.0.0.1:0",
                                  secret=SECRET)
  try:
    receiver = rank_links.ShardReceiver(CAPS.link(1), sender.address,
                                        secret=bytes(32), timeout_s=0.3)
    with pytest.raises(ProtocolError) as e:
      receiver.open(attempts=2)
    assert e.value.code == Code.TIMEOUT
    assert sender.counters.errors(Code.AUTH_FAILED) == 2
    assert sender.frame(0, (0, 1), 3) is None      # nothing to send on
    receiver.close()
  finally:
    sender.close()


def test_a_replayed_hello_cannot_take_the_link(link):
  """A HELLO recorded and replayed (by someone without the key) opens a
  pending session only: frames keep going out in the confirmed one."""
  sender, receiver = link
  before = sender.link_session
  import zmq  # pylint: disable=g-import-not-at-top
  replay = zmq.Context.instance().socket(zmq.DEALER)
  replay.connect(sender.address)
  receiver.session.reconnect()
  replay.send(receiver.session.hello(0.0).message)   # never confirmed
  _wait(lambda: sender.counters.events("hellos") >= 2)
  assert sender.link_session == before
  replay.close(0)


def test_first_nonzero_code_per_request():
  codes = np.array([[0, 5, 0, 0], [3, 7, 0, 2]], np.int32)
  assert rank_links._first_nonzero(codes).tolist() == [3, 5, 0, 2]  # pylint: disable=protected-access
