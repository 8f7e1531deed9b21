"""PACKED replies (HELLO feature PACKED_REPLY) and PACKED_STEP frames
(PACKED_STEP, the same design towards the worker): negotiation,
interoperation with per-frame peers (the same plans and tokens), and every
refusal of a packed answer or STEP counted under its own code with no
state change (docs/wire.md, "HELLO features").

In memory (`dyadic_jax.testing.session_pair`), except one round through
the real drivers over ZeroMQ.
"""

import collections
import dataclasses

import numpy as np
import pytest

from dyadic_jax import bridge
from dyadic_jax.bridge import hello
from dyadic_jax.testing import session_pair
from dyadic_jax.wire import auth, codec, layouts
from dyadic_jax.wire.layouts import Feature, Kind, Representation
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness as h
from tests import wire_edits

M = 1 << 24
PACKED = h.caps(features=Feature.PACKED_REPLY)
FRAMES = h.caps()
RIDS = [0, 1]


_draw = h.draw_half_rows


def _failing(rid):
  def draw(props):
    _draw(props)
    return {p.entry: Code.PROPOSER_FAILED for p in props if p.request == rid}
  return draw


def _pair(verifier_caps=PACKED, worker_caps=None, proposer=_draw):
  pair = session_pair.SessionPair(verifier_caps, secret=h.SECRET,
                                  proposer=proposer)
  if worker_caps is not None:
    pair.worker = bridge.WorkerSession(worker_caps, secret=h.SECRET)
  assert pair.open()
  for rid in RIDS:
    pair.verifier.add_request(rid, [rid + 1], seed=rid)
  return pair


def _answer(pair, depth=2):
  (message,) = pair.to_worker(pair.begin(RIDS, depth))
  return message


def _edit(pair, message, fn):
  """The PACKED answer with fn(header, body, records, rows) applied to a
  copy, resealed with the worker's key (an honest but buggy worker)."""
  buf = bytearray(message)
  f = codec.decode(buf, pair.verifier.bounds)
  fn(buf, f.body, f.records, f.rows)
  return wire_edits.reseal(buf, pair.tagger("session_to_verifier"))


def _outcome(pair, *messages):
  return pair.outcome(collections.deque(messages), draws=None)


def _state(pair):
  v = pair.verifier
  return ({r: list(q.tokens) for r, q in v.requests.items()},
          {r: (q.generation, q.round) for r, q in v.requests.items()},
          None if v.exchange is None else v.exchange.answered.copy())


def _kinds(message):
  return [codec.peek(f)[0] for f in codec.split(
      message, max_frames=8, max_bytes=1 << 24)]


@pytest.mark.parametrize("rep", [Representation.SPARSE,
                                 Representation.DENSE])
@pytest.mark.parametrize("bits", [
    Feature.PACKED_REPLY, Feature.PACKED_STEP,
    Feature.PACKED_REPLY | Feature.PACKED_STEP], ids=lambda b: b.name)
@pytest.mark.parametrize("offer,accept", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_packed_and_per_frame_peers_interoperate(rep, bits, offer, accept):
  # A verifier that offers PACKED (answers, STEPs) with a worker that does
  # not (an old worker: features without the bit), and the other way
  # round: per-frame messages; each packed form only when both have it.
  # Every round's plan and COMMIT are those of a per-frame pair: the
  # drafted tokens depend on every field of the STEP the worker read.
  pair = _pair(h.caps(rep, features=bits if offer else 0),
               h.caps(rep, features=bits if accept else 0),
               proposer=h.draw_keyed_rows)
  frames = _pair(h.caps(rep), proposer=h.draw_keyed_rows)
  agreed = bits if offer and accept else Feature(0)
  packed, steps = (bool(agreed & Feature.PACKED_REPLY),
                   bool(agreed & Feature.PACKED_STEP))
  assert pair.verifier.bounds.packed == packed
  assert pair.verifier.bounds.packed_step == steps
  for n in range(3):
    step = pair.begin(RIDS, 2)
    assert _kinds(step) == ([Kind.PACKED_STEP] if steps else
                            [Kind.STEP] * 2)
    (message,) = pair.to_worker(step)
    assert _kinds(message) == (
        [Kind.PACKED] if packed else [Kind.REPLY, Kind.COMPLETION] * 2)
    plan = _outcome(pair, message)
    want = frames.run_round(RIDS, 2, draws=None)
    assert not plan.codes.any()
    assert plan.tags.tolist() == want.tags.tolist()
    assert plan.rows.tokens.tolist() == want.rows.tokens.tolist()
    outcomes = [(2 - n % 2, 3), (n % 2, 4)]
    for p, rows in ((pair, plan), (frames, want)):
      _, commit = p.commit(rows, outcomes)
      p.to_worker(commit)
  assert {r: q.tokens for r, q in pair.verifier.requests.items()} == {
      r: q.tokens for r, q in frames.verifier.requests.items()}
  assert pair.worker.established.bounds.packed_step == steps
  for p in (pair, frames):
    assert p.verifier.counters.total_errors() == 0
    assert p.worker.counters.total_errors() == 0


def test_an_answer_beyond_the_offer_is_refused(monkeypatch):
  pair = session_pair.SessionPair(FRAMES, secret=h.SECRET, proposer=_draw)
  monkeypatch.setattr(hello, "agree", lambda mine, offered: (
      Feature.PACKED_REPLY))
  assert not pair.open(attempts=1)
  assert pair.verifier.refused == Code.IDENTITY_MISMATCH
  assert pair.verifier.counters.errors(Code.IDENTITY_MISMATCH) == 1


def test_unknown_feature_bits_are_dropped_not_refused():
  pair = session_pair.SessionPair(PACKED, secret=h.SECRET, proposer=_draw)
  offer = bytearray(pair.hello())
  offer[274:276] = (0xFFFF).to_bytes(2, "little")
  offer = wire_edits.reseal(offer, pair.tagger("hello_to_worker"))
  (answer,) = pair.to_worker(offer)
  body = codec.decode(answer, codec.HELLO_BOUNDS).body
  assert body.features == Feature.PACKED_REPLY


@pytest.mark.parametrize("bits", [0, Feature.PACKED_STEP])
def test_a_retry_gets_the_packed_frame_again(bits):
  pair = _pair(h.caps(features=Feature.PACKED_REPLY | bits))
  step = pair.begin(RIDS, 2)
  assert _kinds(step)[0] == (Kind.PACKED_STEP if bits else Kind.STEP)
  (first,) = pair.to_worker(step)
  (again,) = pair.to_worker(step)
  assert bytes(again) == bytes(first)
  assert pair.worker.counters.events("retries_served") == 2
  plan = _outcome(pair, first, again)
  assert not plan.codes.any()


def test_a_duplicate_answer_is_counted_and_changes_nothing():
  pair = _pair()
  message = _answer(pair)
  pair.to_verifier(message)        # Stage: every request answered
  before = _state(pair)
  pair.to_verifier(message)
  assert pair.verifier.counters.errors(Code.DUPLICATE_ROUND) == 2
  assert _state(pair)[0] == before[0] and _state(pair)[1] == before[1]


def test_a_refused_record_fails_its_request_alone():
  pair = _pair(proposer=_failing(1))
  message = _answer(pair)
  f = codec.decode(message, pair.verifier.bounds)
  assert list(f.records["status"]) == [0, Code.PROPOSER_FAILED]
  assert list(f.records["depth"]) == [2, 0]
  assert not f.rows.values[1].any()           # zeros, never old bytes
  plan = _outcome(pair, message)
  assert list(plan.codes) == [0, Code.PROPOSER_FAILED]
  assert pair.verifier.counters.errors(Code.PROPOSER_FAILED) == 1


def _set(name, value, record=1):
  def fn(buf, body, records, rows):
    del buf, body, rows
    records[name][record] = value
  return fn


def _header_round(buf, body, records, rows):
  del body, records, rows
  buf[28:32] = (99).to_bytes(4, "little")


# Edits of an authentic answer (resealed: the worker's key): the code each
# must be refused with, and the requests it fails, or (None, awaited): the
# record is dropped and those requests are still awaited.
EDITS = {
    "status": (_set("status", 999), Code.BAD_STATUS, [1]),
    "known_status": (_set("status", Code.NON_FINITE), Code.NON_FINITE, [1]),
    "anchor": (_set("anchor", 77), Code.STATE_MISMATCH, [1]),
    "context": (_set("context_version", 5), Code.STATE_MISMATCH, [1]),
    "depth": (_set("depth", 1), Code.BAD_SEQUENCE, [1]),
    "future_round": (_set("round", 9), Code.BAD_SEQUENCE, [1]),
    "header_tag": (_header_round, Code.BAD_SEQUENCE, [0, 1]),
    "older_round": (_set("round", 0), Code.DUPLICATE_ROUND, (None, [1])),
    "stranger": (_set("request", 7), Code.BAD_SEQUENCE, (None, [1])),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_each_bad_record_has_its_own_refusal(name):
  edit, code, failed = EDITS[name]
  pair = _pair()
  effects = pair.to_verifier(_edit(pair, _answer(pair), edit))
  assert pair.verifier.counters.snapshot()["errors"] == {code.name: 1}
  ex = pair.verifier.exchange
  if failed[0] is None:
    assert not effects
    assert [i for i in range(len(RIDS)) if not ex.answered[i]] == failed[1]
    assert not ex.codes.any()
    return
  (effect,) = effects
  plan = (effect.plan if isinstance(effect, bridge.Verify)
          else pair.validate(effect).plan)
  assert [i for i, c in enumerate(plan.codes) if c] == failed
  assert all(plan.codes[i] == code for i in failed)


@pytest.mark.parametrize("what", ["flipped", "other_key", "truncated"])
def test_an_unauthentic_answer_changes_nothing(what):
  pair = _pair()
  message = bytearray(_answer(pair))
  before = _state(pair)
  if what == "flipped":
    message[-1] ^= 1
  elif what == "other_key":
    message = wire_edits.reseal(message, pair.tagger("hello_to_verifier"))
  else:
    message = message[:-4]
  assert pair.to_verifier(bytes(message)) == []
  after = _state(pair)
  assert after[0] == before[0] and after[1] == before[1]
  assert not after[2].any()
  code = Code.TRUNCATED if what == "truncated" else Code.AUTH_FAILED
  assert pair.verifier.counters.snapshot()["errors"] == {code.name: 1}


def test_each_form_is_refused_on_the_other_session():
  # A per-frame answer on a packed session, and a PACKED frame on a
  # per-frame one: UNKNOWN_KIND (a form the session did not agree on).
  for mine, theirs in ((PACKED, FRAMES), (FRAMES, PACKED)):
    pair = _pair(mine)
    message = _answer(pair)
    tagger = pair.tagger("session_to_verifier")
    if mine is PACKED:     # the same rows as per-frame REPLY + COMPLETION
      f = codec.decode(message, pair.verifier.bounds)
      buf = bytearray(theirs.bounds.reply_bytes(2))
      frame, rows = codec.begin_reply(
          buf, bounds=theirs.bounds, session=pair.verifier.session,
          generation=0, round_id=1, request=0, depth=2)
      for a, b in zip(rows, f.rows):
        if a is not None:
          a[...] = b[0]
      reply = wire_edits.reseal(buf, tagger)
      forged = reply + codec.encode(
          Kind.COMPLETION, session=pair.verifier.session, generation=0,
          round_id=1, send=tagger, body={
              "request": 0, "depth": 2, "reply_bytes": len(reply),
              "anchor": 1, "reply_tag": reply[32:48]})
    else:
      f = codec.decode(codec.split(message, max_frames=4, max_bytes=1 << 20)[
          0], pair.verifier.bounds)
      packed = codec.begin_packed(
          bytearray(PACKED.bounds.packed_bytes(1, 2)), bounds=PACKED.bounds,
          session=pair.verifier.session, generation=0, round_id=1,
          requests=1, depth=2)
      packed.records[0] = (0, 2, 0, 0, 0, 1, 1, 0)
      for a, b in zip(packed.rows, f.rows):
        if a is not None:
          a[0] = b
      forged = wire_edits.reseal(bytearray(packed.frame), tagger)
    pair.to_verifier(forged)
    assert pair.verifier.counters.errors(Code.UNKNOWN_KIND) == 1


def test_one_depth_per_packed_frame():
  # A STEP message whose STEPs ask for different depths (no verifier sends
  # one): the first STEP's depth is the frame's, the other is refused.
  pair = _pair()
  step = bytearray(pair.begin(RIDS, 2))
  one = layouts.FIXED_BYTES[Kind.STEP]
  step[one + 52:one + 54] = (3).to_bytes(2, "little")
  tagger = pair.tagger("session_to_worker")
  step = bytes(step[:one]) + wire_edits.reseal(bytearray(step[one:]), tagger)
  (message,) = pair.to_worker(step)
  f = codec.decode(message, pair.verifier.bounds)
  assert f.body.depth == 2
  assert list(f.records["status"]) == [0, Code.BAD_SEQUENCE]
  assert pair.worker.counters.errors(Code.BAD_SEQUENCE) == 1


def test_the_link_to_rank_s_offers_no_feature():
  c = dataclasses.replace(PACKED, representation=Representation.DENSE,
                          shards=2)
  assert c.link(0).features == Feature.PACKED_REPLY
  assert c.link(1).features == 0


def test_a_round_through_the_drivers_is_packed():
  with h.running(PACKED) as (worker, verifier):
    results = verifier.round(list(range(PACKED.max_requests)))
    assert not any(r.fallback for r in results)
    assert verifier.session.bounds.packed
    assert worker.session.established.packed
    assert verifier.counters.total_errors() == 0


# -- GMAC (HELLO feature GMAC): the PACKED answer's tag ------------------------

GMAC = h.caps(features=Feature.PACKED_REPLY | Feature.GMAC)


def _counter(frame):
  return int.from_bytes(bytes(frame[12:16]), "little")


@pytest.mark.parametrize("offer,accept", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_gmac_is_used_exactly_when_both_sides_have_it(offer, accept):
  def with_gmac(on):
    return h.caps(Representation.DENSE, features=Feature.PACKED_REPLY | (
        Feature.GMAC if on else 0))
  pair = _pair(with_gmac(offer), with_gmac(accept))
  agreed = bool(offer and accept)
  for n in range(1, 4):
    message = _answer(pair)
    (frame,) = codec.split(message, max_frames=8, max_bytes=1 << 24)
    # A GMAC frame carries the worker's count of sealed frames, a BLAKE3
    # frame zero there.
    assert _counter(frame) == (n if agreed else 0)
    blake3_only = isinstance(pair.verifier.keys.recv, auth.Blake3Tag)
    assert blake3_only == (not agreed)
    plan = _outcome(pair, message)
    assert not plan.codes.any()
    _, commit = pair.commit(plan, [(2, 3), (1, 4)])
    pair.to_worker(commit)
  assert pair.verifier.counters.total_errors() == 0
  assert pair.worker.counters.total_errors() == 0


def test_a_gmac_session_refuses_a_blake3_tag_and_any_edit():
  pair = _pair(GMAC)
  message = bytes(_answer(pair))
  before = _state(pair)
  # The frame under this session's own BLAKE3 key (what it would carry
  # without GMAC), and with each byte of its nonce changed (the seal
  # counter: AUTH_FAILED; the session id: refused before its tag is read,
  # as another session's): each refused and counted, and nothing moves.
  forged = [wire_edits.reseal(bytearray(message),
                              pair.verifier.keys.recv.other)]
  for offset in range(12, 24):
    buf = bytearray(message)
    buf[offset] ^= 1
    forged.append(bytes(buf))
  for n, bad in enumerate(forged, 1):
    assert pair.to_verifier(bad) == []
    after = _state(pair)
    assert after[0] == before[0] and after[1] == before[1]
    assert not after[2].any()
    assert pair.verifier.counters.total_errors() == n
  assert pair.verifier.counters.errors(Code.AUTH_FAILED) >= 5
  assert not _outcome(pair, message).codes.any()   # the real one still counts


def test_a_packed_step_keeps_blake3_on_a_gmac_session():
  pair = _pair(h.caps(features=Feature.PACKED_REPLY | Feature.GMAC
                      | Feature.PACKED_STEP))
  (step,) = codec.split(pair.begin(RIDS, 2), max_frames=4, max_bytes=4096)
  assert codec.peek(step)[0] == Kind.PACKED_STEP and _counter(step) == 0
  assert auth.check(step, pair.verifier.keys.send.other)   # BLAKE3's
  assert not _outcome(pair, *pair.to_worker(step)).codes.any()


def test_gmac_tags_bind_every_byte_and_count_the_seals():
  v = auth.session_keys(h.SECRET, 7, b"v" * 32, b"w" * 32, auth.VERIFIER,
                        gmac=True)
  w = auth.session_keys(h.SECRET, 7, b"v" * 32, b"w" * 32, auth.WORKER,
                        gmac=True)
  plain = auth.session_keys(h.SECRET, 7, b"v" * 32, b"w" * 32, auth.WORKER)
  frame = bytearray(layouts.HEADER_BYTES + 40)
  frame[:4] = layouts.MAGIC
  frame[6:8] = int(Kind.PACKED).to_bytes(2, "little")
  frame[16:24] = (7).to_bytes(8, "little")
  frame[48:] = bytes(range(40))
  tags = set()
  for n in (1, 2, 3):      # the same bytes sealed again: a new nonce and tag
    auth.seal(frame, w.send)
    assert _counter(frame) == n and auth.check(frame, v.recv)
    tags.add(auth.tag_of(frame))
  assert len(tags) == 3
  assert not auth.check(frame, plain.send)        # not BLAKE3's tag
  assert not auth.check(frame, w.recv)            # reflected
  for bit in range(len(frame) * 8):
    if layouts.TAG_OFFSET * 8 <= bit < (layouts.TAG_OFFSET + 16) * 8:
      continue
    buf = bytearray(frame)
    buf[bit // 8] ^= 1 << (bit % 8)
    assert not auth.check(buf, v.recv), bit
  # Every other kind keeps the BLAKE3 tag of the same session.
  frame[6:8] = int(Kind.STEP).to_bytes(2, "little")
  assert v.send.tag(frame) == auth.session_keys(
      h.SECRET, 7, b"v" * 32, b"w" * 32, auth.VERIFIER).send.tag(frame)


def test_the_gmac_sealer_stops_before_its_counter_wraps():
  w = auth.session_keys(h.SECRET, 7, b"v" * 32, b"w" * 32, auth.WORKER,
                        gmac=True)
  frame = bytearray(layouts.HEADER_BYTES)
  frame[6:8] = int(Kind.PACKED).to_bytes(2, "little")
  w.send.packed._sealed = 0xFFFFFFFE
  assert not w.send.spent
  auth.seal(frame, w.send)
  assert _counter(frame) == 0xFFFFFFFF
  assert w.send.spent
  with pytest.raises(auth.SealsExhausted, match="2\\^32 - 1 frames") as e:
    auth.seal(frame, w.send)
  assert e.value.code == Code.SESSION_EXHAUSTED


def test_the_counters_end_ends_the_session_with_a_counted_refusal():
  """The worker's sealer sealed 2^32 - 1 frames: the next STEP is refused
  (SESSION_EXHAUSTED, counted on both sides, nothing drawn), the verifier
  closes its session and the next HELLO opens a new one with new keys, in
  which the rounds go on. Before: the sealer's RuntimeError escaped
  `WorkerSession.finish` and the worker process exited."""
  drawn = []

  def draw(props):
    drawn.extend(props)
    return _draw(props)
  pair = _pair(GMAC, proposer=draw)
  pair.run_round(RIDS, 2, draws=None)    # the session is established
  old = pair.worker.established
  old.keys.send.packed._sealed = 0xFFFFFFFE
  plan = pair.run_round(RIDS, 2, draws=None)     # the last frame it seals
  assert list(plan.codes) == [0, 0]
  drawn.clear()
  plan = pair.run_round(RIDS, 2, draws=None)
  assert not drawn
  assert list(plan.codes) == [Code.SESSION_EXHAUSTED] * 2
  assert pair.worker.counters.errors(Code.SESSION_EXHAUSTED) == 1
  assert pair.verifier.counters.errors(Code.SESSION_EXHAUSTED) == 1
  assert pair.worker.established is None and not pair.verifier.is_open
  assert pair.open()
  plan = pair.run_round(RIDS, 2, draws=None)
  assert list(plan.codes) == [0, 0]
  new = pair.worker.established
  assert new is not None and new is not old and not new.keys.send.spent


def test_gmac_is_not_offered_where_a_packed_frame_could_pass_2_gib():
  big = bridge.Capabilities(representation=Representation.DENSE,
                            max_depth=255, max_requests=1024)
  assert not big.features & Feature.GMAC
  assert big.features & Feature.PACKED_REPLY
  assert bridge.Capabilities(representation=Representation.DENSE
                             ).features & Feature.GMAC


@pytest.mark.parametrize("rep", [Representation.SPARSE,
                                 Representation.DENSE])
def test_the_usual_answer_is_staged_where_it_arrived(rep):
  # Every record as expected: the Stage reads the q rows in the received
  # message (no copy into the slot); a record that is not (request 1's
  # proposer failed) sends the others through the slot. Both plans verify
  # the same rows.
  for proposer, in_place in ((_draw, True), (_failing(1), False)):
    pair = _pair(h.caps(rep, features=Feature.PACKED_REPLY),
                 proposer=proposer)
    message = bytes(_answer(pair))
    (stage,) = pair.to_verifier(message)
    arrived = np.frombuffer(message, np.uint8)
    assert np.shares_memory(stage.rows.values, arrived) == in_place
    assert not np.shares_memory(stage.rows.tokens, arrived)
    verdict = pair.caps.format.validate(stage.rows, vocab=pair.caps.vocab,
                                        device=True)
    plan = pair.verifier.staged(verdict).plan
    assert plan.codes.tolist() == ([0, 0] if in_place else
                                   [0, Code.PROPOSER_FAILED])


def test_a_slot_reuses_its_layout_for_its_shape_only():
  """The worker keeps each slot's PACKED layout and per-request rows and
  reuses them for a batch of the same shape: its answers are byte for
  byte those of a worker that lays every answer out anew, through batches
  of other sizes and depths, and slots replaced while the transport holds
  them (reclaimed); each is accepted."""
  caps = h.caps(features=Feature.PACKED_REPLY, max_requests=3, max_slots=2)
  pairs = [session_pair.SessionPair(
      caps, secret=h.SECRET, proposer=_draw,
      worker_entropy=session_pair.CountingEntropy(1),
      verifier_entropy=session_pair.CountingEntropy(2)) for _ in range(2)]
  for pair in pairs:
    assert pair.open()
    for rid in range(3):
      pair.verifier.add_request(rid, [rid + 1], seed=rid)
  cached, fresh = pairs
  for rids, depth, release in [
      ([0, 1, 2], 2, True), ([0, 1], 2, True), ([0, 1, 2], 2, True),
      ([0, 1, 2], 3, True), ([0, 1, 2], 3, False), ([0, 1, 2], 3, False),
      ([2], 1, True), ([0, 1, 2], 3, True), ([1, 2], 3, True)]:
    fresh.worker.replies.layouts = [None] * caps.max_slots
    got = []
    for pair in pairs:
      answer = pair.worker.receive(pair.begin(rids, depth), pair.now)
      pair.proposer(answer.propose)
      (send,) = pair.worker.finish(answer, {})
      got.append(bytes(send.message))
      if release:
        pair.worker.released(send.slot)
      plan = _outcome(pair, got[-1])
      assert not plan.codes.any() and len(plan.rids) == len(rids)
    assert got[0] == got[1], (rids, depth)
  assert cached.worker.counters.events("slots_reclaimed") == 2


# -- PACKED_STEP (HELLO feature PACKED_STEP): a batch's STEPs in one frame -----

STEP_FORMS = {"frames": h.caps(features=Feature.PACKED_REPLY),
              "packed": h.caps(features=Feature.PACKED_REPLY
                               | Feature.PACKED_STEP)}


def _steps_of(pair, message):
  """The `codec.Step`s of a STEP message of either form (not checked)."""
  steps = []
  for f in codec.split(message, max_frames=8, max_bytes=1 << 20):
    got = codec.decode(f, pair.verifier.bounds)
    steps.extend(got.steps or (codec.Step(got.body, got.tag),))
  return steps


def _step_message(pair, steps, tagger="session_to_worker"):
  """A STEP message of `steps` in the pair's form, sealed with `tagger`
  (a PACKED_STEP takes its depth and policy from the first step)."""
  send, session = pair.tagger(tagger), pair.verifier.session
  if pair.verifier.bounds.packed_step:
    b = steps[0].body
    return codec.encode_packed_step(
        session=session, depth=b.depth, policy=b.policy, send=send,
        records=[(s.body.request, 0, s.body.last_token, *s.tag, s.body.seed,
                  s.body.anchor, s.body.context_version, s.body.prefix_digest)
                 for s in steps])
  return b"".join(codec.encode(
      Kind.STEP, session=session, generation=s.tag[0], round_id=s.tag[1],
      send=send, body=s.body._asdict()) for s in steps)


def _edit_step(index, **fields):
  def edit(steps):
    steps[index] = steps[index]._replace(
        body=steps[index].body._replace(**fields))
    return steps
  return edit


def _edit_all(**fields):
  def edit(steps):
    return [s._replace(body=s.body._replace(**fields)) for s in steps]
  return edit


# Edits of the verifier's STEPs (resealed: a buggy verifier's own): the
# worker's refusals, {request: answer status}; the same in either form.
STEP_EDITS = {
    "duplicate_request": (_edit_step(1, request=0), {"BAD_SEQUENCE": 1},
                          {0: 0}),
    "all_requests": (_edit_step(1, request=0xFFFF), {"BAD_SEQUENCE": 1},
                     {0: 0}),
    "last_token": (_edit_step(1, last_token=h.V),
                   {"TOKEN_OUT_OF_RANGE": 1},
                   {0: 0, 1: Code.TOKEN_OUT_OF_RANGE}),
    "anchor": (_edit_step(0, anchor=hello.MAX_POSITION),
               {"ABSURD_LENGTH": 1}, {0: Code.ABSURD_LENGTH, 1: 0}),
    "depth": (_edit_all(depth=h.DEPTH + 1), {"ABSURD_LENGTH": 2},
              {0: Code.ABSURD_LENGTH, 1: Code.ABSURD_LENGTH}),
    "greedy_policy": (_edit_all(policy=0), {"BAD_SEQUENCE": 2},
                      {0: Code.BAD_SEQUENCE, 1: Code.BAD_SEQUENCE}),
    "unknown_policy": (_edit_all(policy=9), {"BAD_STATUS": 2},
                       {0: Code.BAD_STATUS, 1: Code.BAD_STATUS}),
}


@pytest.mark.parametrize("name", sorted(STEP_EDITS))
def test_a_packed_step_record_is_judged_as_its_step_frame(name):
  """Each record of a PACKED_STEP is refused (or answered) with the code
  its own STEP frame gets: per record, counted, and nothing drawn for it;
  the other records are drawn as usual."""
  edit, errors, statuses = STEP_EDITS[name]
  for form, caps in STEP_FORMS.items():
    pair = _pair(caps)
    steps = edit(_steps_of(pair, pair.begin(RIDS, 2)))
    (message,) = pair.to_worker(_step_message(pair, steps))
    f = codec.decode(message, pair.verifier.bounds)
    got = {int(r["request"]): int(r["status"]) for r in f.records}
    assert got == statuses, form
    assert pair.worker.counters.snapshot()["errors"] == errors, form
    assert pair.worker.counters.events("proposals") == len(statuses), form


def _replayed(pair, message):
  """The first round's STEP again after its next round was served."""
  (answer,) = pair.to_worker(message)
  plan = _outcome(pair, answer)
  _, commit = pair.commit(plan, [(2, 3), (1, 4)])
  pair.to_worker(commit)
  pair.to_worker(pair.begin(RIDS, 2))
  return message


def _served_with_another_body(pair, message):
  """The round's STEPs again, served already, with other seeds."""
  pair.to_worker(message)
  return _step_message(pair, [s._replace(body=s.body._replace(
      seed=s.body.seed + 1)) for s in _steps_of(pair, message)])


def _reseal_header_round(pair, message):
  buf = bytearray(message)
  buf[28:32] = (7).to_bytes(4, "little")
  return wire_edits.reseal(buf, pair.tagger("session_to_worker"))


# A PACKED_STEP message refused whole, counted with the code, unanswered
# (but UNKNOWN_SESSION's refusal), nothing drawn and no view moved.
STEP_MESSAGES = {
    "flipped_bit": (lambda p, m: m[:-1] + bytes([m[-1] ^ 1]),
                    Code.AUTH_FAILED, 1),
    "other_key": (lambda p, m: wire_edits.reseal(
        bytearray(m), p.tagger("hello_to_worker")), Code.AUTH_FAILED, 1),
    "truncated": (lambda p, m: m[:-8], Code.TRUNCATED, 1),
    "other_session": (lambda p, m: wire_edits.set_field(
        m, 16, p.verifier.session ^ 1, 8, p.tagger("session_to_worker")),
                      Code.UNKNOWN_SESSION, 1),
    "replayed": (_replayed, Code.DUPLICATE_ROUND, 2),
    "served_tag_other_body": (_served_with_another_body, Code.BAD_SEQUENCE,
                              2),
    "header_tag": (_reseal_header_round, Code.BAD_SEQUENCE, 1),
    "oversize": (lambda p, m: m + m, Code.ABSURD_LENGTH, 1),
    "two_frames": (lambda p, m: b"".join(
        _step_message(p, [s]) for s in _steps_of(p, m)),
                   Code.BAD_SEQUENCE, 1),
    "per_frame_steps": (lambda p, m: b"".join(codec.encode(
        Kind.STEP, session=p.verifier.session, generation=s.tag[0],
        round_id=s.tag[1], send=p.tagger("session_to_worker"),
        body=s.body._asdict()) for s in _steps_of(p, m)),
                        Code.UNKNOWN_KIND, 1),
}


@pytest.mark.parametrize("name", sorted(STEP_MESSAGES))
def test_a_bad_packed_step_changes_nothing(name):
  edit, code, count = STEP_MESSAGES[name]
  pair = _pair(STEP_FORMS["packed"])
  message = pair.begin(RIDS, 2)
  bad = bytes(edit(pair, message))
  worker = pair.worker
  before = (worker.counters.events("proposals"),
            {r: (v.generation, v.round, v.anchor)
             for r, v in worker.views.items()})
  errors = worker.counters.total_errors()
  answer = pair.to_worker(bad)
  assert worker.counters.errors(code) == count
  assert worker.counters.total_errors() - errors == count
  assert (worker.counters.events("proposals"),
          {r: (v.generation, v.round, v.anchor)
           for r, v in worker.views.items()}) == before
  if code == Code.UNKNOWN_SESSION:
    (refusal,) = answer
    assert _kinds(refusal) == [Kind.RESET]
  else:
    assert answer == []


def test_contexts_travel_before_the_packed_step():
  """CONTEXT frames keep their form: before the PACKED_STEP, in record
  order, each matching a record (request and tags); the worker hands each
  request its prefix. A CONTEXT that matches no record, or comes out of
  order, refuses the message (BAD_SEQUENCE), nothing drawn."""
  caps = h.caps(features=Feature.PACKED_REPLY | Feature.PACKED_STEP
                | Feature.CONTEXT, max_context=8)
  got = []

  def draw(props):
    got.extend((p.request, None if p.context is None else
                p.context.tolist()) for p in props)
    return _draw(props)
  pair = session_pair.SessionPair(caps, secret=h.SECRET, proposer=draw,
                                  wants_context=True)
  assert pair.open()
  for rid in RIDS:
    pair.verifier.add_request(rid, [rid + 1, 5], seed=rid)
  step = pair.begin(RIDS, 2)
  assert _kinds(step) == [Kind.CONTEXT, Kind.CONTEXT, Kind.PACKED_STEP]
  frames = h.frames(step)
  commit = codec.encode(Kind.COMMIT, session=pair.verifier.session,
                        generation=0, round_id=1, body={"request": 0},
                        send=pair.tagger("session_to_worker"))
  for bad in ([frames[1], frames[0], frames[2]],     # out of order
              [frames[0], frames[0], frames[2]],     # twice for one record
              [frames[0], frames[1], frames[2], frames[0]],    # after it
              [frames[0], commit]):                  # with another kind
    assert pair.to_worker(h.join(bad)) == []
  assert pair.worker.counters.errors(Code.BAD_SEQUENCE) == 4
  assert not got
  (answer,) = pair.to_worker(step)
  assert got == [(0, [1, 5]), (1, [2, 5])]
  assert not _outcome(pair, answer).codes.any()
  assert pair.worker.counters.total_errors() == 4
