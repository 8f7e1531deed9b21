"""The bridge over real ZeroMQ sockets: one test per rejection class.

Each test makes the worker (or the network) commit one defect, runs one
round of two requests, and checks the four things the issue asks for: the
error code, its counter (and no other), the discard of the whole proposal
with a target-only token from the committed prefix and a new generation,
and no other state change (the other request of the batch, when the defect
is confined to one request's rows, is verified as usual).
"""

import time

import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax import wire
from dyadic_jax.bridge import staging
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import Kind, Representation
from tests import bridge_harness as h

SPARSE = h.caps()
DENSE = h.caps(Representation.DENSE)


def _check(verifier, results, code, failed, before):
  """The round failed exactly for `failed` with `code`; all else is intact."""
  errors = verifier.counters.snapshot()["errors"]
  # A refusal is counted once where it was found: per request for a
  # timeout, per message for a framing defect, per row otherwise.
  assert errors == {code.name: len(failed) if code == Code.TIMEOUT else 1}, (
      errors)
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
      assert not res.fallback and res.code is None
      assert 1 <= len(res.committed) <= h.DEPTH + 1
      assert req.generation == old_gen
  assert all(s.state == staging.SlotState.FREE for s in verifier.pool.slots)
  assert verifier.counters.events("fallbacks") == len(failed)


def _round(worker, verifier, tamper):
  verifier.round([0, 1])              # a clean round first: warm, in sync
  verifier.counters = bridge.Counters("verifier")
  before = {r: (list(q.tokens), q.generation)
            for r, q in verifier.requests.items()}
  worker.tamper = tamper
  return verifier.round([0, 1]), before


def _rows(frames):
  """Indexes of the REPLY rows of request 0 and of its COMPLETION."""
  kinds = [codec.peek(f)[0] for f in frames]
  done = kinds.index(Kind.COMPLETION)
  return list(range(done)), done


def _edit_row(c, fn):
  """Tamper: rewrite request 0's row 1 with fn(values, ids, at) -> kwargs,
  where `at` is the index of the sampled token in the row."""
  def tamper(frames):
    frames = list(frames)
    body, values, ids, _ = h.reply_rows(frames[1], c.bounds)
    token = body["token"]
    at = token if ids is None else int(np.searchsorted(ids, token))
    frames[1] = h.rewrite_reply(frames[1], c.bounds, **fn(values, ids, at))
    return h.reframe(frames)
  return tamper


def _set_bytes(index, offset, data, reseal=True):
  def tamper(frames):
    frames = list(frames)
    buf = bytearray(frames[index])
    buf[offset:offset + len(data)] = data
    frames[index] = h.reseal(bytes(buf)) if reseal else bytes(buf)
    return frames
  return tamper


# Row defects: confined to request 0 (its rows are framed correctly, so the
# exchange is attributable; request 1 is verified as usual).
def _row_cases():
  t, f32 = 2.0 ** -24, np.float32

  def nan(v, i, at):
    v[0] = np.nan
    return {"values": v}

  def negative(v, i, at):
    v[0], v[1] = -v[0], v[1] + 2 * v[0]
    return {"values": v}

  def non_dyadic(v, i, at):
    v[0] = f32(v[0] + t / 2 if v[0] < 0.5 else v[0] - t / 4)
    return {"values": v}

  def wrong_mass(v, i, at):
    v[0] = f32(v[0] + t)
    return {"values": v}

  def id_out_of_range(v, i, at):
    i[-1] = h.V
    return {"values": v, "ids": i}

  def duplicate_id(v, i, at):
    i[1] = i[0]
    return {"values": v, "ids": i}

  def unsorted(v, i, at):
    return {"values": v[::-1].copy(), "ids": i[::-1].copy()}

  def token_out_of_range(v, i, at):
    return {"values": v, "token": h.V}

  def zero_q(v, i, at):
    # The token's mass moves to a neighbour: still dyadic, still 2^24.
    other = (at + 1) % len(v)
    v[other], v[at] = v[other] + v[at], 0.0
    return {"values": v, "ids": i}

  def missing_q(v, i, at):
    return {"values": np.zeros(0, np.float32), "ids": np.zeros(0, np.int32)}

  def dense_short(v, i, at):
    return {"values": v[:-1].copy()}

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
      Code.LENGTH_MISMATCH: (DENSE, dense_short),
      "dense " + Code.NON_DYADIC.name: (DENSE, non_dyadic),
      "dense " + Code.NEGATIVE.name: (DENSE, negative),
      "dense " + Code.ZERO_Q_AT_TOKEN.name: (DENSE, zero_q),
  }


@pytest.mark.parametrize("name", list(_row_cases()), ids=lambda n: getattr(n, "name", n))
def test_row_defect_discards_that_request(name):
  c, edit = _row_cases()[name]
  code = Code[name.split()[-1]] if isinstance(name, str) else name
  with h.running(c) as (worker, verifier):
    results, before = _round(worker, verifier, _edit_row(c, edit))
    _check(verifier, results, code, {0}, before)


# Framing defects: the message cannot be trusted, the whole batch falls back.
_FRAMING = {
    Code.BAD_MAGIC: _set_bytes(1, 0, b"XQ24", reseal=False),
    Code.UNSUPPORTED_VERSION: _set_bytes(1, 4, (1).to_bytes(2, "little")),
    Code.UNKNOWN_KIND: _set_bytes(1, 6, (42).to_bytes(2, "little")),
    Code.TRUNCATED: lambda f: [f[0], f[1][:-3]] + list(f[2:]),
    Code.ABSURD_LENGTH: _set_bytes(1, 8, (2 ** 31).to_bytes(4, "little")),
    Code.UNEXPECTED_SIZE: lambda f: [f[0], f[1] + b"\0\0\0\0"] + list(f[2:]),
    Code.CHECKSUM_MISMATCH: _set_bytes(1, 40, b"\x7f", reseal=False),
}


@pytest.mark.parametrize("code", list(_FRAMING), ids=lambda c: c.name)
def test_framing_defect_discards_the_batch(code):
  with h.running(SPARSE) as (worker, verifier):
    results, before = _round(worker, verifier, _FRAMING[code])
    _check(verifier, results, code, {0, 1}, before)


def _completion(field, value):
  def tamper(frames):
    frames = list(frames)
    _, done = _rows(frames)
    buf = bytearray(frames[done])
    body = np.frombuffer(buf, layouts.BODIES[Kind.COMPLETION], 1,
                         layouts.HEADER.itemsize)
    body[field] = value
    frames[done] = h.reseal(bytes(buf))
    return frames
  return tamper


_EXCHANGE = {
    Code.STATE_MISMATCH: _completion("anchor", 999),
    Code.UNEXPECTED_SIZE: _completion("reply_bytes", 1),
    Code.CHECKSUM_MISMATCH: _completion("replies_crc", 1),
    Code.BAD_SEQUENCE: lambda f: [f[1], f[0]] + list(f[2:]),
    Code.SAMPLED_ON_GREEDY: _completion("status", int(Code.SAMPLED_ON_GREEDY)),
}


@pytest.mark.parametrize("code", list(_EXCHANGE), ids=lambda c: c.name)
def test_exchange_defect_discards_that_request(code):
  with h.running(SPARSE) as (worker, verifier):
    results, before = _round(worker, verifier, _EXCHANGE[code])
    _check(verifier, results, code, {0}, before)


def test_timeout_discards_the_batch_and_late_reply_is_stale():
  with h.running(SPARSE, timeout_s=0.3) as (worker, verifier):
    held = []
    def hold(frames):
      held.append(frames)
      return None
    results, before = _round(worker, verifier, hold)
    _check(verifier, results, Code.TIMEOUT, {0, 1}, before)
    # The late reply arrives now: refused by generation, nothing applied.
    verifier.endpoint.socket  # the worker's ROUTER knows the verifier's id
    verifier.counters = bridge.Counters("verifier")
    worker.tamper = lambda frames: frames + held[0]
    results = verifier.round([0, 1])
    assert not any(r.fallback for r in results)
    assert verifier.counters.errors(Code.STALE_GENERATION) == 2


def test_duplicate_reply_counted_and_ignored():
  with h.running(SPARSE) as (worker, verifier):
    results, before = _round(worker, verifier, lambda f: f + f)
    assert not any(r.fallback for r in results)
    # The second copy is read while waiting for nothing more, or next round.
    verifier.round([0, 1])
    assert verifier.counters.errors(Code.DUPLICATE_ROUND) == 2
    assert verifier.counters.events("fallbacks") == 0
    del before


def test_retry_serves_the_identical_cached_reply():
  c = SPARSE
  worker = h.Tampering(c, h.proposer_for(c))
  hello = bridge.hello.hello_frame(c, 5)
  assert worker.handle([hello])
  step = codec.encode(Kind.STEP, session=5, generation=0, round_id=1, body={
      "request": 0, "depth": 2, "policy": 1, "last_token": 3, "seed": 9,
      "anchor": 1, "prefix_digest": b"x"})
  first = [bytes(f) for f in worker.handle([step])]
  again = [bytes(f) for f in worker.handle([step])]
  assert first == again and worker.counters.events("retries_served") == 1
  assert worker.counters.events("proposals") == 1   # drawn once


def test_hello_mismatch_refused_before_allocation():
  with h.running(SPARSE) as (worker, _):
    other = h.caps(draft_id="another-draft")
    verifier = bridge.Verifier(other, _address(worker), target_fn=None,
                               timeout_s=1.0)
    with pytest.raises(ProtocolError) as e:
      verifier.open()
    assert e.value.code == Code.IDENTITY_MISMATCH
    assert verifier.pool is None           # nothing allocated
    assert verifier.counters.errors(Code.IDENTITY_MISMATCH) == 1
    assert worker.counters.errors(Code.IDENTITY_MISMATCH) == 1
    verifier.close()


_ADDRESSES = {}


def _address(worker):
  return _ADDRESSES[id(worker)]


@pytest.fixture(autouse=True)
def _remember_addresses(monkeypatch):
  real = bridge.Endpoint.bind.__func__

  def bind(cls, address):
    endpoint = real(cls, address)
    _ADDRESSES["last"] = endpoint.address
    return endpoint
  monkeypatch.setattr(bridge.Endpoint, "bind", classmethod(bind))
  real_init = h.Tampering.__init__

  def init(self, *a, **k):
    real_init(self, *a, **k)
    _ADDRESSES[id(self)] = _ADDRESSES.get("last")
  monkeypatch.setattr(h.Tampering, "__init__", init)


@pytest.mark.parametrize("field,value", [
    ("vocab", 32), ("max_depth", 4), ("target_id", "t2"),
    ("semantic_id", "dyadic24-other"), ("rng_abi", 2), ("precision", 2),
    ("representation", Representation.DENSE), ("mode", 1)])
def test_negotiate_refuses_every_field(field, value):
  with pytest.raises(ProtocolError) as e:
    bridge.negotiate(SPARSE, h.caps(**{field: value}))
  assert e.value.code == Code.IDENTITY_MISMATCH and field in str(e.value)


def test_greedy_session_never_carries_q():
  c = h.caps(mode=layouts.GREEDY_VERSION)
  with h.running(c) as (worker, verifier):
    results = verifier.round([0, 1])
    assert not any(r.fallback for r in results)
    assert all(len(a) == 2 * (h.DEPTH + 1) for a in worker.answers[1:])
    for frame in worker.answers[-1]:
      if codec.peek(frame)[0] == Kind.REPLY:
        assert len(frame) == layouts.frame_bytes(Kind.REPLY, 0,
                                                 Representation.TOKEN)
    # A q row on a v1 session is refused.
    sampled = h.caps()
    row = codec.encode(Kind.REPLY, session=1, generation=0, round_id=0,
                       body={"token": 1, "mass": dj.M},
                       values=np.array([1.0], np.float32),
                       ids=np.array([1], np.int32), version=1)
    with pytest.raises(ProtocolError) as e:
      codec.decode(row, c.bounds)
    assert e.value.code == Code.SAMPLED_ON_GREEDY
    del sampled


def test_sampled_step_on_greedy_worker_refused():
  c = h.caps(mode=layouts.GREEDY_VERSION)
  worker = h.Tampering(c, h.proposer_for(c))
  worker.handle([bridge.hello.hello_frame(c, 5)])
  step = codec.encode(Kind.STEP, session=5, generation=0, round_id=1,
                      version=1, body={"request": 0, "depth": 2, "policy": 1,
                                       "last_token": 3, "anchor": 1})
  out = worker.handle([step])
  done = codec.decode(out[-1], c.bounds)
  assert int(done.body["status"]) == Code.SAMPLED_ON_GREEDY
  assert worker.counters.errors(Code.SAMPLED_ON_GREEDY) == 1
  assert worker.counters.events("proposals") == 1 and len(out) == 1


def test_worker_restart_gives_unknown_session_then_recovers():
  with h.running(SPARSE) as (worker, verifier):
    verifier.round([0, 1])
    worker.session = None                   # as if the process restarted
    verifier.counters = bridge.Counters("verifier")
    results = verifier.round([0, 1])
    assert all(r.fallback and r.code == Code.UNKNOWN_SESSION for r in results)
    results = verifier.round([0, 1])        # HELLO again, then verified
    assert not any(r.fallback for r in results)
    assert verifier.counters.events("hellos") == 1


def test_reconnect_invalidates_in_flight_keys():
  with h.running(SPARSE) as (worker, verifier):
    verifier.round([0, 1])
    gens = {r: q.generation for r, q in verifier.requests.items()}
    verifier.reconnect()
    assert all(q.generation == gens[r] + 1 and q.round == 0
               for r, q in verifier.requests.items())
    results = verifier.round([0, 1])
    assert not any(r.fallback for r in results)
    assert len(verifier.used_tags) == 4


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "ipc"])
def test_dense_rounds_over_tcp_and_ipc(address, tmp_path):
  if address == "ipc":
    address = f"ipc://{tmp_path}/bridge.sock"
  with h.running(DENSE, address=address) as (worker, verifier):
    for _ in range(3):
      results = verifier.round([0, 1])
      assert not any(r.fallback for r in results)
    assert verifier.counters.snapshot()["errors"] == {}
    deadline = time.monotonic() + 5
    while worker.counters.events("commits") < 6 and time.monotonic() < (
        deadline):
      time.sleep(0.01)
    # The worker's committed view (from COMMITs) is the verifier's.
    for rid, req in verifier.requests.items():
      view = worker.views[rid]
      assert (view.anchor, view.last_token, view.digest) == (
          req.anchor, req.tokens[-1], req.digest)


def test_dense_rows_agree_with_validate_q_row():
  rng = np.random.default_rng(0)
  v = 16
  rows, tokens, want = [], [], []
  base = np.zeros(v, np.float32)
  base[[1, 4, 9]] = [0.5, 0.25, 0.25]
  t = np.float32(2.0 ** -24)
  edits = [lambda q: q, lambda q: _put(q, 0, np.nan), lambda q: _put(q, 1,
           -0.5), lambda q: _put(q, 0, t / 2), lambda q: _put(q, 0, t),
           lambda q: _put(q, 2, np.inf), lambda q: _put(q, 1, -0.0),
           lambda q: _put(_put(q, 1, 0.0), 0, 0.5), lambda q: _put(q, 1, 2.0)]
  for edit in edits:
    for token in (1, 0, 4, -1, v):
      q = edit(base.copy())
      rows.append(q)
      tokens.append(token)
      try:
        wire.validate_q_row(q, None, vocab_size=v, token=token)
        want.append(True)
      except ProtocolError:
        want.append(False)
  for _ in range(50):  # random valid rows
    c = rng.multinomial(dj.M, rng.dirichlet(np.ones(v)))
    rows.append((c * 2.0 ** -24).astype(np.float32))
    tokens.append(int(np.argmax(c)))
    want.append(True)
  values = staging.aligned_empty((len(rows), v), np.float32)
  values[:] = np.stack(rows)
  counts, ok = staging.dense_rows(values, np.array(tokens, np.int32))
  assert np.asarray(ok).tolist() == want
  for i in np.flatnonzero(want):
    assert np.array_equal(np.asarray(counts[i]), (values[i].astype(np.float64)
                                                  * dj.M).astype(np.int32))


def _put(q, i, x):
  q[i] = x
  return q


def test_slot_pool_watchdog_expires_before_reuse():
  now = [0.0]
  pool = bridge.SlotPool(h.caps(max_slots=1), lambda: now[0])
  slot = pool.acquire({0: (0, 1)}, timeout=1.0)
  with pytest.raises(RuntimeError):
    pool.acquire({0: (0, 2)}, timeout=1.0)     # in use, not yet expired
  now[0] = 1.5
  assert pool.expire() == [{0: (0, 1)}]
  assert slot.state == staging.SlotState.FREE
  with pytest.raises(ProtocolError):
    pool.publish(slot)                         # its exchange is over
  slot = pool.acquire({0: (1, 1)}, timeout=1.0)
  pool.publish(slot)
  pool.hold(slot)
  pool.hold(slot)
  pool.done(slot)
  assert slot.state == staging.SlotState.READY  # one consumer left
  pool.done(slot)
  assert slot.state == staging.SlotState.FREE
  with pytest.raises(ProtocolError) as e:
    pool.preflight(3, 1)
  assert e.value.code == Code.ABSURD_LENGTH


def test_two_dense_slots_at_the_default_shape():
  c = bridge.Capabilities(representation=Representation.DENSE)
  pool = bridge.SlotPool(c, lambda: 0.0)
  assert pool.nbytes == 20_684_800
