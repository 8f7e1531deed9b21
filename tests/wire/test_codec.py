"""Wire v3 frames and messages: round trips, every framing refusal, tags.

No test here reads a clock: the bit-flip test bounds the memory a decode
may allocate (tracemalloc), which does not depend on the machine's load.
"""

import itertools
import pathlib
import tracemalloc

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from dyadic_jax import wire
from dyadic_jax.wire import auth, codec, layouts
from dyadic_jax.wire.layouts import FIXED_BYTES, Kind, Representation
from tests import wire_edits

C = wire.Code
M = 1 << 24
SPARSE = codec.Bounds(vocab=16, depth=3, width=4,
                      representation=Representation.SPARSE, max_requests=2)
DENSE = SPARSE._replace(width=16, representation=Representation.DENSE)
GREEDY = SPARSE._replace(width=0, representation=Representation.TOKEN)
KEY = auth.Blake3Tag(bytes(range(32)))
OTHER = auth.Blake3Tag(bytes(range(1, 33)))


def _reply(bounds=SPARSE, depth=2, tagger=KEY, session=7):
  buf = bytearray(bounds.reply_bytes(depth))
  frame, rows = codec.begin_reply(buf, bounds=bounds, session=session,
                                  generation=3, round_id=11, request=1,
                                  depth=depth)
  rows.tokens[:] = [2, 5][:depth] + [2] * max(0, depth - 2)
  if rows.values is not None:
    rows.n[:] = bounds.width
    rows.values[:] = 0
    if rows.ids is not None:
      rows.ids[:] = np.arange(bounds.width) * 3 % bounds.vocab
      rows.ids.sort(axis=1)
      rows.values[:, :2] = 0.5
      rows.tokens[:] = rows.ids[:, 0]
    else:
      rows.values[:, [2, 5]] = 0.5
  if tagger is not None:
    auth.seal(frame, tagger)
  return bytes(buf)


def _set(buf, offset, value, nbytes, tagger=KEY):
  return wire_edits.set_field(buf, offset, value, nbytes, tagger)


@pytest.mark.parametrize("kind", [k for k in Kind
                                  if k not in (Kind.REPLY, Kind.PACKED,
                                                Kind.CONTEXT,
                                                Kind.PACKED_STEP)])
def test_fixed_frames_round_trip(kind):
  dtype = layouts.BODIES[kind]
  body = {name: i + 1 for i, name in enumerate(dtype.names)
          if dtype.fields[name][0].kind in "ui"}
  frame = codec.encode(kind, session=2 ** 40, generation=9, round_id=4,
                       body=body, send=KEY)
  assert len(frame) == FIXED_BYTES[kind]
  got = codec.decode(frame, SPARSE, KEY)
  assert got.header.session == 2 ** 40 and got.tag == (9, 4)
  assert {n: getattr(got.body, n) for n in body} == body


@pytest.mark.parametrize("bounds", [SPARSE, DENSE, GREEDY],
                         ids=["sparse", "dense", "greedy"])
def test_reply_round_trips(bounds):
  frame = _reply(bounds)
  got = codec.decode(frame, bounds, KEY, validate_rows=True)
  assert got.body.depth == 2 and got.body.width == bounds.width
  assert len(frame) == bounds.reply_bytes(2)
  if bounds.representation != Representation.TOKEN:
    assert got.counts.sum(axis=-1).tolist() == [M, M]
    # Payload arrays are views of the received bytes, not copies.
    assert got.rows.values.base is not None


def test_hello_carries_identities():
  frame = codec.encode(Kind.HELLO, session=1, generation=0, round_id=0, body={
      "mode": 2, "vocab": 129280, "semantic_id": b"dyadic24-standard-v1",
      "nonce": bytes(range(32))}, send=KEY)
  got = codec.decode(frame, codec.HELLO_BOUNDS, KEY)
  assert got.body.semantic_id.rstrip(b"\0") == b"dyadic24-standard-v1"
  assert got.body.vocab == 129280 and got.body.nonce == bytes(range(32))


def _framing_cases():
  good = _reply()
  fixed = codec.encode(Kind.COMMIT, session=7, generation=1, round_id=1,
                       send=KEY)
  body = layouts.HEADER_BYTES
  return {
      "truncated_header": (good[:20], C.TRUNCATED),
      "bad_magic": (b"XQ24" + good[4:], C.BAD_MAGIC),
      "v2_frame": (_set(good, 4, 2, 2), C.UNSUPPORTED_VERSION),
      "unknown_kind": (_set(good, 6, 99, 2), C.UNKNOWN_KIND),
      "longer_than_the_bytes": (_set(good, 8, len(good) + 4, 4), C.TRUNCATED),
      "shorter_than_the_bytes": (_set(good, 8, len(good) - 4, 4),
                                 C.UNEXPECTED_SIZE),
      "flipped_bit": (good[:-1] + bytes([good[-1] ^ 1]), C.AUTH_FAILED),
      "other_key": (_reply(tagger=OTHER), C.AUTH_FAILED),
      "fixed_frame_wrong_size": (
          _set(fixed + b"\0" * 8, 8, len(fixed) + 8, 4), C.UNEXPECTED_SIZE),
      "unknown_representation": (_set(good, body + 4, 7, 2), C.UNKNOWN_KIND),
      "dense_on_sparse": (_set(good, body + 4, 1, 2), C.UNKNOWN_KIND),
      "tokens_on_sampled": (_set(good, body + 4, 0, 2), C.MISSING_Q),
      "depth_beyond_bound": (_set(good, body + 2, 4, 2), C.ABSURD_LENGTH),
      "depth_zero": (_set(good, body + 2, 0, 2), C.ABSURD_LENGTH),
      "depth_vs_size": (_set(good, body + 2, 3, 2), C.UNEXPECTED_SIZE),
      "width_above": (_set(good, body + 8, 5, 4), C.ABSURD_LENGTH),
      "width_below": (_set(good, body + 8, 3, 4), C.UNEXPECTED_SIZE),
      "declared_mass": (_set(good, body + 12, M - 1, 4), C.WRONG_MASS),
  }


_CASES = _framing_cases()


@pytest.mark.parametrize("name", sorted(_CASES))
def test_every_framing_refusal(name):
  frame, code = _CASES[name]
  with pytest.raises(wire.ProtocolError) as info:
    codec.decode(frame, SPARSE, KEY)
  assert info.value.code == code, info.value


def test_q_rows_on_a_greedy_session_are_refused():
  with pytest.raises(wire.ProtocolError) as info:
    codec.decode(_reply(), GREEDY, KEY)
  assert info.value.code == C.SAMPLED_ON_GREEDY


@pytest.mark.parametrize("message,code", [
    (b"", C.TRUNCATED),
    (b"DQ24" + b"\0" * 20, C.TRUNCATED),
    (_set(_reply(), 8, 10, 4, None), C.UNEXPECTED_SIZE),
    (_reply() * 3, C.ABSURD_LENGTH),          # 3 frames, bound 2
    (_reply() + _reply()[:50], C.TRUNCATED),
])
def test_split_refuses_before_reading_any_body(message, code):
  with pytest.raises(wire.ProtocolError) as info:
    codec.split(message, max_frames=2, max_bytes=1 << 20)
  assert info.value.code == code


def test_split_refuses_a_message_above_the_byte_bound():
  with pytest.raises(wire.ProtocolError) as info:
    codec.split(_reply() * 2, max_frames=8, max_bytes=len(_reply()) * 2 - 1)
  assert info.value.code == C.ABSURD_LENGTH
  frames = codec.split(_reply() * 2, max_frames=2, max_bytes=1 << 20)
  assert [bytes(f) for f in frames] == [_reply()] * 2


def test_tags_bind_key_direction_and_every_byte():
  session = auth.session_keys(bytes(32), 5, b"v" * 32, b"w" * 32,
                              auth.VERIFIER)
  worker = auth.session_keys(bytes(32), 5, b"v" * 32, b"w" * 32,
                             auth.WORKER)
  other = auth.session_keys(bytes(32), 5, b"v" * 32, b"x" * 32,
                            auth.VERIFIER)
  frame = codec.encode(Kind.STEP, session=5, generation=1, round_id=2,
                       send=session.send, body={"request": 3})
  assert auth.check(frame, worker.recv)          # the worker accepts it
  assert not auth.check(frame, session.recv)     # reflected: refused
  assert not auth.check(frame, other.recv)       # another session: refused
  insecure = auth.hello_keys(None, auth.WORKER)
  assert not insecure.authenticated and not auth.check(frame, insecure.recv)


def test_bit_flips_of_a_frame():
  """Bit flips of a sealed sparse REPLY (1 row of 2 entries: 88 bytes).

  Raw flips never authenticate: every single flip, and every double flip
  in the header. Resealed flips (as if the corruption came before sealing:
  a buggy peer) reach the body and row checks: every single flip, and
  every double flip in the header and body; each is a ProtocolError or a
  frame whose rows validate, no other exception, and no decode allocates
  more than a few KB (its reads are views; a read that depended on a
  corrupted length would allocate).
  """
  bounds = SPARSE._replace(width=2)
  good = _reply(bounds, depth=1)
  nbits = len(good) * 8
  head_bits = layouts.HEADER_BYTES * 8
  fixed_bits = FIXED_BYTES[Kind.REPLY] * 8

  def flipped(bits):
    buf = bytearray(good)
    for b in set(bits):
      buf[b // 8] ^= 1 << (b % 8)
    return buf

  singles = [(i,) for i in range(nbits)]
  for bits in singles + list(itertools.combinations(range(head_bits), 2)):
    with pytest.raises(wire.ProtocolError):
      codec.decode(bytes(flipped(bits)), bounds, KEY)
  # Resealing rewrites the tag bytes: flips there are no flips.
  tag = range(layouts.TAG_OFFSET * 8, head_bits)
  covered = [b for b in range(fixed_bits) if b not in tag]
  outcomes = {"valid": 0, "refused": 0}
  peak = 0

  def resealed(bits, measure):
    nonlocal peak
    buf = flipped(bits)
    auth.seal(buf, KEY)
    if measure:
      tracemalloc.reset_peak()
      base = tracemalloc.get_traced_memory()[0]
    try:
      got = codec.decode(bytes(buf), bounds, KEY, validate_rows=True)
      assert got.counts.sum(dtype=np.uint64) == M
      outcomes["valid"] += 1
    except wire.ProtocolError:
      outcomes["refused"] += 1
    if measure:
      peak = max(peak, tracemalloc.get_traced_memory()[1] - base)

  tracemalloc.start()
  try:
    for bits in singles:
      resealed(bits, True)
  finally:
    tracemalloc.stop()
  for bits in itertools.combinations(covered, 2):
    resealed(bits, False)
  assert outcomes["refused"] > outcomes["valid"] > 0
  assert peak < 64 * 1024, peak


# Bytes a decode may allocate at its peak (views, scalars, the error
# object): a few KB; an allocation sized by a corrupted length, depth or
# width would be far above it.
_DECODE_PEAK_BOUND = 16 * 1024
# Fields whose value sizes something: version, kind, length (header);
# depth, representation, width (REPLY body).
_BODY = layouts.HEADER_BYTES
_SIZE_FIELDS = [(4, 2), (6, 2), (8, 4), (_BODY + 2, 2), (_BODY + 4, 2),
                (_BODY + 8, 4)]


def test_a_corrupted_size_never_sizes_an_allocation():
  """A decode's peak allocation stays bounded under every 1- and 2-bit
  flip of a field that sizes something, raw and resealed (a buggy peer's
  authenticated frame), whatever the flipped value claims; the bound
  counts bytes, not seconds, so it holds on any machine. The same harness
  catches a decoder that trusts the declared width before checking it.
  """
  good = _reply()
  size_bits = [8 * offset + b for offset, width in _SIZE_FIELDS
               for b in range(8 * width)]

  def flips(bits):
    for i, j in itertools.combinations_with_replacement(bits, 2):
      buf = bytearray(good)
      buf[i // 8] ^= 1 << (i % 8)
      if j != i:
        buf[j // 8] ^= 1 << (j % 8)
      yield bytes(buf)
      auth.seal(buf, KEY)
      yield bytes(buf)

  def peak(decode, frame):
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
      decode(frame)
    except wire.ProtocolError:
      pass
    return tracemalloc.get_traced_memory()[1] - base

  def trusting_decode(frame):   # the mutant: allocates what the peer says
    width = int.from_bytes(frame[_BODY + 8:_BODY + 12], "little")
    np.empty(min(width, 1 << 24), np.float32)
    return codec.decode(frame, SPARSE, KEY)

  tracemalloc.start()
  try:
    worst = max(peak(lambda f: codec.decode(f, SPARSE, KEY), f)
                for f in flips(size_bits))
    mutant = max(peak(trusting_decode, f) for f in flips(
        [8 * (_BODY + 8) + b for b in range(32)]))
  finally:
    tracemalloc.stop()
  assert 0 < worst <= _DECODE_PEAK_BOUND, worst
  assert mutant > 100 * _DECODE_PEAK_BOUND, mutant


@hypothesis.given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_refuse(data):
  frames = [data]
  if len(data) >= layouts.HEADER_BYTES:
    buf = bytearray(data)
    auth.seal(buf, KEY)
    frames.append(bytes(buf))
  for frame in frames:
    for bounds in (SPARSE, DENSE, GREEDY):
      try:
        codec.decode(frame, bounds, KEY, validate_rows=True)
      except wire.ProtocolError:
        pass
    try:
      codec.split(frame, max_frames=4, max_bytes=1 << 16)
    except wire.ProtocolError:
      pass


def test_wire_doc_matches_layouts():
  doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" /
         "wire.md").read_text()
  assert layouts.describe() in doc
  for code in C:
    assert f"| {code.name} | {int(code)} |" in doc


CTX = SPARSE._replace(max_context=8)


def _context(tokens=(1, 2, 3), tagger=KEY):
  return codec.encode_context(session=7, generation=3, round_id=11,
                              request=1, tokens=list(tokens), send=tagger)


def test_context_round_trips():
  frame = _context()
  assert len(frame) == CTX.context_bytes(3) == FIXED_BYTES[Kind.CONTEXT] + 12
  got = codec.decode(frame, CTX, KEY)
  assert got.kind == Kind.CONTEXT and got.tag == (3, 11)
  assert (got.body.request, got.body.count) == (1, 3)
  assert got.tokens.tolist() == [1, 2, 3]
  with pytest.raises(ValueError, match="encode_context"):
    codec.encode(Kind.CONTEXT, session=7, generation=0, round_id=0)


_COUNT = layouts.HEADER_BYTES + 4    # CONTEXT body: count


_CONTEXT_EDITS = [
    ("no_feature", lambda f: (f, SPARSE), C.UNKNOWN_KIND),
    ("too_many", lambda f: (_set(f, _COUNT, 9, 4), CTX), C.ABSURD_LENGTH),
    ("none", lambda f: (_set(f, _COUNT, 0, 4), CTX), C.ABSURD_LENGTH),
    ("count_vs_size", lambda f: (_set(f, _COUNT, 2, 4), CTX),
     C.UNEXPECTED_SIZE),
    ("token_high", lambda f: (_set(f, 56, 16, 4), CTX),
     C.TOKEN_OUT_OF_RANGE),
    ("token_negative", lambda f: (_set(f, 60, -1 & 0xFFFFFFFF, 4), CTX),
     C.TOKEN_OUT_OF_RANGE),
    ("cut_body", lambda f: (_set(f[:52], 8, 52, 4), CTX), C.TRUNCATED),
    ("bad_tag", lambda f: (_context(tagger=OTHER), CTX), C.AUTH_FAILED),
]


def test_context_bounds_size_the_worker_message():
  assert SPARSE.max_request_frames == 2
  assert CTX.max_request_frames == 4
  assert CTX.max_request_message == 2 * (FIXED_BYTES[Kind.STEP]
                                         + CTX.context_bytes(8))


STEPS = SPARSE._replace(packed_step=True)
# (request, reserved, last_token, generation, round, seed, anchor,
# context_version, prefix_digest): layouts.STEP_RECORD.
_RECORDS = [(1, 0, 5, 3, 11, 2 ** 63 + 1, 40, 7, b"\xa1" * 32),
            (4, 0, 15, 2, 9, 6, 1 << 40, 0, b"\x0b" * 32)]


def _steps(records=tuple(_RECORDS), tagger=KEY, depth=3, policy=1):
  return codec.encode_packed_step(session=7, depth=depth, policy=policy,
                                  records=list(records), send=tagger)


def test_packed_step_round_trips_as_the_step_frames_would():
  """Each record decodes to the body and tag its STEP frame decodes to
  (the frame's depth and policy in every one): what the worker acts on."""
  frame = _steps()
  assert len(frame) == STEPS.packed_step_bytes(2) == 56 + 72 * 2
  got = codec.decode(frame, STEPS, KEY)
  assert got.kind == Kind.PACKED_STEP and got.tag == (3, 11)
  assert (got.body.requests, got.body.depth, got.body.policy) == (2, 3, 1)
  for step, rec in zip(got.steps, _RECORDS, strict=True):
    rid, _, last, gen, rnd, seed, anchor, version, digest = rec
    alone = codec.decode(codec.encode(
        Kind.STEP, session=7, generation=gen, round_id=rnd, send=KEY,
        body={"request": rid, "depth": 3, "policy": 1, "last_token": last,
              "seed": seed, "anchor": anchor, "context_version": version,
              "prefix_digest": digest}), SPARSE, KEY)
    assert step == codec.Step(alone.body, alone.tag)
  with pytest.raises(ValueError, match="encode_packed_step"):
    codec.encode(Kind.PACKED_STEP, session=7, generation=0, round_id=0)
  with pytest.raises(ValueError, match="no records"):
    _steps(records=())


_REQUESTS = layouts.HEADER_BYTES    # PACKED_STEP body: requests


_STEPS_EDITS = [
    ("on_a_per_frame_session", lambda f: (f, SPARSE), C.UNKNOWN_KIND),
    ("step_on_a_packed_session", lambda f: (codec.encode(
        Kind.STEP, session=7, generation=3, round_id=11, send=KEY,
        body={"request": 1, "depth": 3, "policy": 1}), STEPS),
     C.UNKNOWN_KIND),
    ("cut_body", lambda f: (_set(f[:52], 8, 52, 4), STEPS), C.TRUNCATED),
    ("cut_record", lambda f: (f[:-8], STEPS), C.TRUNCATED),
    ("record_missing", lambda f: (_set(f[:-72], 8, len(f) - 72, 4), STEPS),
     C.UNEXPECTED_SIZE),
    ("record_extra", lambda f: (_set(f + f[-72:], 8, len(f) + 72, 4),
                                STEPS), C.UNEXPECTED_SIZE),
    ("count_vs_size", lambda f: (_set(f, _REQUESTS, 1, 2), STEPS),
     C.UNEXPECTED_SIZE),
    ("no_records", lambda f: (_set(f, _REQUESTS, 0, 2), STEPS),
     C.ABSURD_LENGTH),
    ("above_max_requests", lambda f: (_set(f, _REQUESTS, 3, 2), STEPS),
     C.ABSURD_LENGTH),
    ("count_of_65535", lambda f: (_set(f, _REQUESTS, 0xFFFF, 2), STEPS),
     C.ABSURD_LENGTH),
    ("flipped_bit", lambda f: (f[:-1] + bytes([f[-1] ^ 1]), STEPS),
     C.AUTH_FAILED),
    ("other_key", lambda f: (_steps(tagger=OTHER), STEPS), C.AUTH_FAILED),
]


@pytest.mark.parametrize(
    "make,name,edit,code",
    [(_context, *case) for case in _CONTEXT_EDITS]
    + [(_steps, *case) for case in _STEPS_EDITS],
    ids=lambda v: v if isinstance(v, str) else None)
def test_every_context_and_packed_step_refusal(make, name, edit, code):
  """A CONTEXT or PACKED_STEP frame's framing, form and counts: refused
  whole, before a token or record is read. A PACKED_STEP record's values
  (request ids, depth, policy, tokens, tags) are the worker's to judge per
  record (tests/bridge/test_packed.py)."""
  del name
  frame, bounds = edit(make())
  with pytest.raises(wire.ProtocolError) as e:
    codec.decode(frame, bounds, KEY)
  assert e.value.code == code


def test_packed_step_bounds_fit_the_worker_message():
  """A PACKED_STEP of max_requests records fits the worker's message and
  frame bounds of either form (it is smaller than R STEP frames)."""
  for bounds in (STEPS, CTX._replace(packed_step=True)):
    r = bounds.max_requests
    assert bounds.packed_step_bytes(r) < r * FIXED_BYTES[Kind.STEP]
    assert bounds.packed_step_bytes(r) <= bounds.max_request_message
    assert bounds.max_frame >= bounds.packed_step_bytes(r)
