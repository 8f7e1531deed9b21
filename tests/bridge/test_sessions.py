"""The bridge over real ZeroMQ sockets: one test per rejection class.

Each test makes the worker (or the network) commit one defect, runs one
round of two requests, and checks what the issue asks for: the error code,
its counter (and no other), the discard of the whole proposal with a
target-only token from the committed prefix and a new generation, and no
other state change (the other request of the batch, when the defect is
confined to one request's answer, is verified as usual).

Defects of an honest but buggy worker are resealed with its session key
(they authenticate, and are refused for what they say). Bytes that do not
authenticate (a flipped bit, a peer without the key) are dropped and
counted without being attributed to any request: the exchange then times
out (TIMEOUT for both requests).
"""

import time

import numpy as np
import pytest

from dyadic_jax import bridge
from dyadic_jax.wire import codec
from dyadic_jax.wire.layouts import (FIXED_BYTES, Feature, Kind, Mode,
                                     Representation)
from dyadic_jax.wire.refusals import Code, ProtocolError
from tests import bridge_harness as h

SPARSE = h.caps()
DENSE = h.caps(Representation.DENSE)
M = 1 << 24


def _check(verifier, results, code, failed, before, extra=None):
  """The round failed exactly for `failed` with `code`; all else is intact.

  extra: further error counts expected (e.g. the code that made a message
  unusable, before its exchange timed out).
  """
  errors = verifier.counters.snapshot()["errors"]
  want = {code.name: len(failed) if code == Code.TIMEOUT else 1}
  for name, n in (extra or {}).items():
    want[name] = want.get(name, 0) + n
  assert errors == want, errors
  for res in results:
    req = verifier.requests[res.rid]
    old_tokens, old_gen = before[res.rid]
    assert req.tokens[:len(old_tokens)] == old_tokens   # nothing rewritten
    assert req.tokens[len(old_tokens):] == list(res.committed)
    if res.rid in failed:
      assert res.fallback and res.code == code and res.accepted == 0
      assert len(res.committed) == 1                    # target-only token
      assert req.generation == old_gen + 1 and req.round == 0
    else:
      assert not res.fallback and res.code is None, res
      assert 1 <= len(res.committed) <= h.DEPTH + 1
      assert req.generation == old_gen
  assert verifier.session.exchange is None
  assert verifier.counters.events("fallbacks") == len(failed)


def _round(worker, verifier, tamper, warp_on=()):
  """A clean round, then one with the worker's answer tampered; counters
  are fresh for the second. warp_on: codes whose refusal times the
  exchange out at once (h.WarpOnReject), where nothing else will come."""
  verifier.round([0, 1])              # a clean round first: warm, in sync
  verifier.session.counters = (
      h.WarpOnReject("verifier", verifier.clock, warp_on) if warp_on
      else bridge.Counters("verifier"))
  before = {r: (list(q.tokens), q.generation)
            for r, q in verifier.requests.items()}
  worker.tamper = tamper
  return verifier.round([0, 1]), before


def _edit_rows(c, fn):
  """Tamper: rewrite request 0's rows with fn(rows, at) -> fields, where
  `at` is the index of the drafted token of row 1 in its row."""
  def tamper(messages, tagger):
    frames = h.frames(messages[-1])
    _, rows = h.reply_rows(frames[0], c)
    token = int(rows.tokens[1])
    at = token if rows.ids is None else int(np.searchsorted(
        rows.ids[1, :rows.n[1]], token))
    frames[0] = h.rewrite_reply(frames[0], c, tagger, **fn(rows, at))
    return [h.join(h.reframe(frames, tagger))]
  return tamper


def _row_cases():
  t = np.float32(2.0 ** -24)

  def nan(r, at):
    r.values[1, 0] = np.nan
    return {"values": r.values}

  def negative(r, at):
    r.values[1, 0], r.values[1, 1] = -r.values[1, 0], r.values[1, 1] + (
        2 * r.values[1, 0])
    return {"values": r.values}

  def non_dyadic(r, at):
    v = r.values[1, 0]
    r.values[1, 0] = np.float32(v + t / 2 if v < 0.5 else v - t / 4)
    return {"values": r.values}

  def wrong_mass(r, at):
    r.values[1, at] = np.float32(r.values[1, at] + t)
    return {"values": r.values}

  def id_out_of_range(r, at):
    r.ids[1, r.n[1] - 1] = h.V
    return {"ids": r.ids}

  def duplicate_id(r, at):
    r.ids[1, 1] = r.ids[1, 0]
    return {"ids": r.ids}

  def unsorted(r, at):
    k = r.n[1]
    r.ids[1, :k] = r.ids[1, :k][::-1]
    r.values[1, :k] = r.values[1, :k][::-1]
    return {"ids": r.ids, "values": r.values}

  def token_out_of_range(r, at):
    r.tokens[1] = h.V
    return {"tokens": r.tokens}

  def zero_q(r, at):
    # The token's mass moves to a neighbour: still dyadic, still 2^24.
    other = (at + 1) % (r.values.shape[1] if r.ids is None else r.n[1])
    r.values[1, other] += r.values[1, at]
    r.values[1, at] = 0
    return {"values": r.values}

  def missing_q(r, at):
    r.n[1] = 0
    return {"n": r.n}

  def dense_short(r, at):
    r.n[1] = h.V - 1
    return {"n": r.n}

  def subnormal(bits):
    def edit(r, at):
      other = (at + 1) % r.values.shape[1]
      r.values[1].view(np.uint32)[other] = bits
      return {"values": r.values}
    return edit

  def not_drawn(r, at):
    # A valid row whose token is another supported one: only the sampling
    # audit can tell that the token was not drawn from this q.
    live = r.values[1] > 0 if r.ids is None else np.arange(
        r.ids.shape[1]) < r.n[1]
    choices = np.flatnonzero(live)
    if r.ids is not None:
      choices = r.ids[1, choices]
    others = [int(x) for x in choices if x != r.tokens[1]]
    r.tokens[1] = others[0]
    return {"tokens": r.tokens}

  return {
      Code.NON_FINITE: (SPARSE, nan), Code.NEGATIVE: (SPARSE, negative),
      Code.NON_DYADIC: (SPARSE, non_dyadic),
      Code.WRONG_MASS: (SPARSE, wrong_mass),
      Code.ID_OUT_OF_RANGE: (SPARSE, id_out_of_range),
      Code.DUPLICATE_ID: (SPARSE, duplicate_id),
      Code.UNSORTED_IDS: (SPARSE, unsorted),
      Code.TOKEN_OUT_OF_RANGE: (SPARSE, token_out_of_range),
      Code.ZERO_Q_AT_TOKEN: (SPARSE, zero_q),
      Code.MISSING_Q: (SPARSE, missing_q),
      Code.SAMPLING_MISMATCH: (SPARSE, not_drawn),
      Code.LENGTH_MISMATCH: (DENSE, dense_short),
      "dense " + Code.NON_DYADIC.name: (DENSE, non_dyadic),
      "dense " + Code.NEGATIVE.name: (DENSE, negative),
      "dense " + Code.ZERO_Q_AT_TOKEN.name: (DENSE, zero_q),
      "dense " + Code.SAMPLING_MISMATCH.name: (DENSE, not_drawn),
      # Subnormals, judged on bit patterns (XLA CPU flushes them to zero
      # in float compares: the dense fast path once accepted these).
      "dense subnormal 0x1 " + Code.NON_DYADIC.name: (DENSE, subnormal(1)),
      "dense subnormal 0x7fffff " + Code.NON_DYADIC.name: (
          DENSE, subnormal(0x7FFFFF)),
      "dense negative subnormal " + Code.NEGATIVE.name: (
          DENSE, subnormal(0x80000001)),
  }


_ROWS = _row_cases()


def _code(name):
  return Code[name.split()[-1]] if isinstance(name, str) else name


@pytest.mark.parametrize("name", list(_ROWS),
                         ids=lambda n: getattr(n, "name", n))
def test_row_defect_discards_that_request(name):
  c, edit = _ROWS[name]
  with h.running(c) as (worker, verifier):
    results, before = _round(worker, verifier, _edit_rows(c, edit))
    _check(verifier, results, _code(name), {0}, before)


def test_without_the_audit_a_token_not_drawn_from_q_is_verified():
  # The same forged token, audit off: nothing else can see it.
  c, edit = _ROWS[Code.SAMPLING_MISMATCH]
  with h.running(c, sampling_audit=False) as (worker, verifier):
    results, before = _round(worker, verifier, _edit_rows(c, edit))
    assert not any(r.fallback for r in results)
    assert verifier.counters.snapshot()["errors"] == {}
    del before


def _set_header(offset, data, reseal=True):
  def tamper(messages, tagger):
    frames = h.frames(messages[-1])
    buf = bytearray(frames[0])
    buf[offset:offset + len(data)] = data
    frames[0] = h.reseal(bytes(buf), tagger) if reseal else bytes(buf)
    return [h.join(frames)]
  return tamper


def _message(edit):
  return lambda messages, tagger: [edit(messages[-1])]


# Messages that cannot be read or authenticated: dropped and counted with
# their code; the exchange times out (TIMEOUT for both requests).
_UNREADABLE = {
    Code.BAD_MAGIC: _set_header(0, b"XQ24", reseal=False),
    Code.UNSUPPORTED_VERSION: _set_header(4, (2).to_bytes(2, "little")),
    Code.UNKNOWN_KIND: _set_header(6, (42).to_bytes(2, "little")),
    Code.TRUNCATED: _message(lambda m: m[:-3]),
    Code.UNEXPECTED_SIZE: _set_header(8, (20).to_bytes(4, "little")),
    Code.ABSURD_LENGTH: _message(lambda m: m + m + m),   # 3R frames > 2R
    Code.AUTH_FAILED: _set_header(60, b"\x7f", reseal=False),
    Code.UNKNOWN_SESSION: _set_header(16, b"\x01", reseal=False),
}


@pytest.mark.parametrize("code", list(_UNREADABLE), ids=lambda c: c.name)
def test_unreadable_message_is_counted_and_times_out(code):
  with h.running(SPARSE) as (worker, verifier):
    results, before = _round(worker, verifier, _UNREADABLE[code],
                             warp_on=[code])
    _check(verifier, results, Code.TIMEOUT, {0, 1}, before,
           extra={code.name: 1})


def _completion(field, value):
  def tamper(messages, tagger):
    frames = h.frames(messages[-1])
    i = h.completion_of(frames, 0)
    frames[i] = h.set_field(frames[i], Kind.COMPLETION, field, value, tagger)
    return [h.join(frames)]
  return tamper


def _reply(field, value):
  def tamper(messages, tagger):
    frames = h.frames(messages[-1])
    frames[0] = h.set_field(frames[0], Kind.REPLY, field, value, tagger)
    return [h.join(h.reframe(frames, tagger))]
  return tamper


def _swap_first_two(messages, tagger):
  frames = h.frames(messages[-1])
  frames[0], frames[1] = frames[1], frames[0]   # COMPLETION before its rows
  return [h.join(frames)]


# Answers of an authenticated worker that are wrong for this exchange:
# request 0 falls back with the code; request 1 is verified.
_EXCHANGE = {
    Code.STATE_MISMATCH: _completion("anchor", 999),
    Code.UNEXPECTED_SIZE: _completion("reply_bytes", 1),
    Code.CHECKSUM_MISMATCH: _completion("reply_tag", b"\x01" * 16),
    Code.SAMPLED_ON_GREEDY: _completion("status",
                                       int(Code.SAMPLED_ON_GREEDY)),
    Code.BAD_STATUS: _completion("status", 999),
    Code.WRONG_MASS: _reply("mass", M - 1),
    Code.UNKNOWN_KIND: _reply("representation", 7),
    "REPLY width " + Code.UNEXPECTED_SIZE.name: _reply("width", 3),
    "REPLY depth " + Code.UNEXPECTED_SIZE.name: _reply("depth", 2),
    "COMPLETION depth " + Code.BAD_SEQUENCE.name: _completion("depth", 2),
    "REPLY request " + Code.BAD_SEQUENCE.name: _reply("request", 1),
}


@pytest.mark.parametrize("name", list(_EXCHANGE),
                         ids=lambda n: getattr(n, "name", n))
def test_exchange_defect_discards_that_request(name):
  with h.running(SPARSE) as (worker, verifier):
    results, before = _round(worker, verifier, _EXCHANGE[name])
    _check(verifier, results, _code(name), {0}, before)


def test_answers_out_of_order_fail_the_batch():
  # A COMPLETION ahead of its rows: the rows have no COMPLETION; nothing
  # of the message can be attributed, every request falls back.
  with h.running(SPARSE) as (worker, verifier):
    results, before = _round(worker, verifier, _swap_first_two)
    errors = verifier.counters.snapshot()["errors"]
    assert set(errors) == {"BAD_SEQUENCE"}, errors
    assert all(r.fallback and r.code == Code.BAD_SEQUENCE for r in results)
    del before


def test_timeout_discards_the_batch_and_late_reply_is_stale():
  with h.running(SPARSE) as (worker, verifier):
    held = []

    def hold(messages, tagger):
      held.extend(messages)
      verifier.clock.warp()       # nothing will come: the deadline passes
      return None
    results, before = _round(worker, verifier, hold)
    _check(verifier, results, Code.TIMEOUT, {0, 1}, before)
    # The late reply arrives now: refused by generation, nothing applied.
    verifier.session.counters = bridge.Counters("verifier")
    worker.tamper = lambda messages, tagger: held + messages
    results = verifier.round([0, 1])
    assert not any(r.fallback for r in results)
    assert verifier.counters.errors(Code.STALE_GENERATION) == 2


def test_duplicate_reply_counted_and_ignored():
  with h.running(SPARSE) as (worker, verifier):
    results, _ = _round(worker, verifier, lambda m, t: m + m)
    assert not any(r.fallback for r in results)
    verifier.round([0, 1])    # the second copy is read here at the latest
    assert verifier.counters.errors(Code.DUPLICATE_ROUND) == 2
    assert verifier.counters.events("fallbacks") == 0


# The STEP message's forms: a STEP frame per request, or one PACKED_STEP
# frame (HELLO feature PACKED_STEP).
STEP_FORMS = {"frames": 0, "packed_step": Feature.PACKED_STEP}


@pytest.mark.parametrize("form", sorted(STEP_FORMS))
def test_retry_serves_the_identical_cached_reply(form):
  c = h.caps(features=STEP_FORMS[form])
  worker = h.Tampering(c, h.proposer_for(c))
  vs = bridge.VerifierSession(c, secret=h.SECRET)
  for send in worker.handle(vs.hello().message):
    vs.receive(send.message)
  assert vs.is_open
  vs.add_request(0, [3], seed=9)
  step = vs.begin([0], 2, now=0.0)[0].message
  first = [bytes(s.message) for s in worker.handle(step)]
  again = [bytes(s.message) for s in worker.handle(step)]
  assert first == again and worker.counters.events("retries_served") == 1
  assert worker.counters.events("proposals") == 1   # drawn once


def test_hello_mismatch_refused_before_allocation():
  with h.running(SPARSE) as (worker, _):
    other = h.caps(draft_id="another-draft")
    verifier = bridge.Verifier(other, worker.address, target_fn=None,
                               secret=h.SECRET, timeout_s=h.GENEROUS_S)
    with pytest.raises(ProtocolError) as e:
      verifier.open()
    assert e.value.code == Code.IDENTITY_MISMATCH
    assert verifier.session.slots is None       # nothing allocated
    assert verifier.counters.errors(Code.IDENTITY_MISMATCH) == 1
    assert worker.counters.errors(Code.IDENTITY_MISMATCH) == 1
    verifier.close()


@pytest.mark.parametrize("field,value", [
    ("vocab", 32), ("max_depth", 4), ("target_id", "t2"),
    ("semantic_id", "dyadic24-other"), ("rng_abi", 2), ("precision", 2),
    ("representation", Representation.DENSE), ("mode", Mode.GREEDY),
    ("max_slots", 3), ("max_requests", 3), ("max_support", 8)])
def test_hello_mismatch_names_every_field(field, value):
  from dyadic_jax.bridge import hello  # pylint: disable=g-import-not-at-top
  theirs = codec.decode(hello.hello_frame(h.caps(**{field: value}), 1,
                                          bytes(32)),
                        codec.HELLO_BOUNDS).body
  differ = hello.mismatches(SPARSE, theirs)
  assert any(d.startswith(field) for d in differ), differ
  assert not hello.mismatches(SPARSE, codec.decode(
      hello.hello_frame(h.caps(), 2, bytes(32)), codec.HELLO_BOUNDS).body)


def test_greedy_session_never_carries_q():
  c = h.caps(mode=Mode.GREEDY)
  with h.running(c) as (worker, verifier):
    results = verifier.round([0, 1])
    assert not any(r.fallback for r in results)
    answer = [a for a in worker.answers if a][-1]
    for frame in h.frames(answer[-1]):
      if codec.peek(frame)[0] == Kind.REPLY:
        assert len(frame) == FIXED_BYTES[Kind.REPLY] + 8 * h.DEPTH
    # A q row on a greedy session is refused by the decoder.
    sampled = h.caps()
    with pytest.raises(ProtocolError) as e:
      codec.decode(_sampled_reply(sampled), c.bounds)
    assert e.value.code == Code.SAMPLED_ON_GREEDY


def _sampled_reply(c):
  buf = bytearray(c.bounds.reply_bytes(h.DEPTH))
  frame, rows = codec.begin_reply(buf, bounds=c.bounds, session=1,
                                  generation=0, round_id=1, request=0,
                                  depth=h.DEPTH)
  rows.n[:] = 1
  del frame
  return bytes(buf)


@pytest.mark.parametrize("form", sorted(STEP_FORMS))
def test_sampled_step_on_greedy_worker_refused(form):
  c = h.caps(mode=Mode.GREEDY, features=STEP_FORMS[form])
  worker = h.Tampering(c, h.proposer_for(c))
  vs = bridge.VerifierSession(c, secret=h.SECRET)
  for send in worker.handle(vs.hello().message):
    vs.receive(send.message)
  vs.add_request(0, [3], seed=9)
  step = bytearray(vs.begin([0], 2, now=0.0)[0].message)
  kind = Kind.PACKED_STEP if STEP_FORMS[form] else Kind.STEP
  assert codec.peek(step)[0] == kind
  step = h.set_field(step, kind, "policy", 1,
                     vs.keys.send)        # a sampled STEP, authenticated
  out = worker.handle(step)
  done = codec.decode(h.frames(out[-1].message)[-1], c.bounds)
  assert done.body.status == Code.SAMPLED_ON_GREEDY
  assert worker.counters.errors(Code.SAMPLED_ON_GREEDY) == 1


def test_each_step_form_commits_the_same_tokens():
  """Rounds through the drivers (the real proposer and verification) with
  a STEP frame per request and with one PACKED_STEP frame, each with
  per-frame and PACKED answers: the same committed tokens, no refusal."""
  committed = {}
  for form, bits in STEP_FORMS.items():
    for answers in (0, Feature.PACKED_REPLY):
      c = h.caps(features=bits | answers)
      with h.running(c) as (worker, verifier):
        for _ in range(3):
          verifier.round([0, 1])
        assert verifier.session.bounds.packed_step == bool(bits)
        assert verifier.counters.snapshot()["errors"] == {}
        assert worker.counters.snapshot()["errors"] == {}
        committed[form, answers] = {r: q.tokens for r, q in
                                    verifier.requests.items()}
  first, *others = committed.values()
  assert all(o == first for o in others), committed


def test_worker_restart_gives_unknown_session_then_recovers():
  with h.running(SPARSE) as (worker, verifier):
    verifier.round([0, 1])
    worker.session.established = None        # as if the process restarted
    verifier.session.counters = bridge.Counters("verifier")
    results = verifier.round([0, 1])
    assert all(r.fallback and r.code == Code.UNKNOWN_SESSION for r in results)
    results = verifier.round([0, 1])        # HELLO again, then verified
    assert not any(r.fallback for r in results)
    assert verifier.counters.events("hellos") == 1


def test_reconnect_invalidates_in_flight_keys():
  with h.running(SPARSE) as (worker, verifier):
    verifier.round([0, 1])
    gens = {r: q.generation for r, q in verifier.requests.items()}
    old = verifier.session.session
    verifier.reconnect()
    assert verifier.session.session != old
    assert all(q.generation == gens[r] + 1 and q.round == 0
               for r, q in verifier.requests.items())
    results = verifier.round([0, 1])
    assert not any(r.fallback for r in results)
    del worker


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "ipc"])
def test_dense_rounds_over_tcp_and_ipc(address, tmp_path):
  if address == "ipc":
    address = f"ipc://{tmp_path}/bridge.sock"
  with h.running(DENSE, address=address) as (worker, verifier):
    for _ in range(3):
      results = verifier.round([0, 1])
      assert not any(r.fallback for r in results)
    assert verifier.counters.snapshot()["errors"] == {}
    # The last COMMIT is in flight: wait for it (a generous deadline).
    deadline = time.monotonic() + h.GENEROUS_S
    while worker.counters.events("commits") < 6:
      assert time.monotonic() < deadline, worker.counters.snapshot()
      time.sleep(0.01)
    # The worker's committed view (from COMMITs) is the verifier's.
    for rid, req in verifier.requests.items():
      view = worker.session.views[rid]
      assert (view.anchor, view.last_token, view.digest) == (
          req.anchor, req.tokens[-1], req.digest)


def test_two_dense_slots_at_the_default_shape():
  from dyadic_jax.bridge import staging  # pylint: disable=g-import-not-at-top
  c = bridge.Capabilities(representation=Representation.DENSE)
  assert sum(s.nbytes for s in staging.slots_for(c)) == 20_684_800


def test_insecure_sessions_use_crc32c_and_refuse_keyed_peers():
  c = SPARSE
  with h.running(c, secret=None) as (worker, verifier):
    results = verifier.round([0, 1])
    assert not any(r.fallback for r in results)
    assert not worker.session.established.keys.authenticated
    keyed = bridge.Verifier(c, worker.address, target_fn=None,
                            secret=h.SECRET, timeout_s=0.2)
    with pytest.raises(ProtocolError) as e:
      keyed.open(attempts=1)    # never answered: it times out, whenever
    assert e.value.code == Code.TIMEOUT
    deadline = time.monotonic() + h.GENEROUS_S   # the worker's count
    while worker.counters.errors(Code.AUTH_FAILED) < 1:
      assert time.monotonic() < deadline, worker.counters.snapshot()
      time.sleep(0.01)
    assert worker.counters.errors(Code.AUTH_FAILED) == 1
    keyed.close()


def test_a_verification_refusal_is_a_counted_fallback():
  """verify_fn returning (0, -1, status) (core's refused chain, e.g. NaN
  target logits) falls back to the target alone with the status's code,
  counted; it never commits -1 or raises."""
  from dyadic_jax.constants import Status  # pylint: disable=g-import-not-at-top

  def refusing(logits, q, draft, keys, anchors):
    del logits, q, keys, anchors
    rows = len(draft)
    return (np.zeros(rows, np.int32), np.full(rows, -1, np.int32),
            np.full(rows, int(Status.NAN), np.int32))
  with h.running(SPARSE, verify_fn=refusing) as (worker, verifier):
    results = verifier.round([0, 1])
    assert all(r.fallback and r.code == Code.NON_FINITE for r in results)
    assert all(0 <= r.committed[0] < h.V for r in results)
    assert verifier.counters.errors(Code.NON_FINITE) == 2
    del worker
