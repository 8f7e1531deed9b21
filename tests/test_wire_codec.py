"""Wire v2 frames: round trips, every framing refusal, bit flips, fuzz."""

import itertools
import pathlib
import tracemalloc

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from dyadic_jax import wire
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.layouts import Kind
from tests import wire_edits

C = wire.Code
M = 1 << 24
BOUNDS = codec.Bounds(vocab=16, max_support=4, max_depth=5)
IDS = np.array([2, 5], np.int32)
VALUES = np.array([0.5, 0.5], np.float32)


def _reply(**overrides):
  kw = dict(session=7, generation=3, round_id=11,
            body={"position": 1, "token": 5, "mass": M}, values=VALUES,
            ids=IDS)
  kw.update(overrides)
  return codec.encode(Kind.REPLY, **kw)


_reseal = wire_edits.reseal


def _set(buf, offset, value, nbytes, reseal=True):
  return wire_edits.set_field(buf, offset, value, nbytes, reseal)


@pytest.mark.parametrize("kind", [k for k in Kind if k != Kind.REPLY])
def test_fixed_frames_round_trip(kind):
  dtype = layouts.BODIES[kind]
  body = {name: i + 1 for i, name in enumerate(dtype.names)
          if dtype.fields[name][0].kind in "ui"}
  frame = codec.encode(kind, session=2 ** 40, generation=9, round_id=4,
                       body=body)
  assert len(frame) == layouts.frame_bytes(kind)
  got = codec.decode(frame, BOUNDS)
  assert int(got.header["session"]) == 2 ** 40
  assert (int(got.header["generation"]), int(got.header["round"])) == (9, 4)
  assert {n: int(got.body[n]) for n in body} == body


def test_reply_round_trips_dense_and_sparse():
  got = codec.decode(_reply(), BOUNDS)
  assert got.ids.tolist() == [2, 5] and got.counts.tolist() == [M // 2] * 2
  dense = np.zeros(16, np.float32)
  dense[[2, 5]] = 0.5
  frame = _reply(values=dense, ids=None)
  assert len(frame) == layouts.frame_bytes(Kind.REPLY, 16)
  got = codec.decode(frame, BOUNDS)
  assert got.ids is None and got.counts[5] == M // 2
  # Payload arrays are views of the received bytes, not copies.
  assert got.values.base is not None


def test_hello_carries_identities():
  frame = codec.encode(Kind.HELLO, session=1, generation=0, round_id=0, body={
      "mode": 2, "vocab": 129280, "semantic_id": b"dyadic24-standard-v1"})
  got = codec.decode(frame, BOUNDS)
  assert got.body["semantic_id"] == b"dyadic24-standard-v1"
  assert int(got.body["vocab"]) == 129280


def _framing_cases():
  good = _reply()
  fixed = codec.encode(Kind.COMMIT, session=1, generation=1, round_id=1)
  return {
      "truncated_header": (good[:20], C.TRUNCATED),
      "bad_magic": (b"XQ24" + good[4:], C.BAD_MAGIC),
      "greedy_version": (_set(good, 4, 1, 2), C.UNSUPPORTED_VERSION),
      "unknown_kind": (_set(good, 6, 99, 2), C.UNKNOWN_KIND),
      "absurd_length": (_set(good, 8, 2 ** 31, 4), C.ABSURD_LENGTH),
      "truncated_frame": (good[:-1], C.TRUNCATED),
      "trailing_bytes": (good + b"\0", C.UNEXPECTED_SIZE),
      "checksum": (good[:-1] + bytes([good[-1] ^ 1]), C.CHECKSUM_MISMATCH),
      "fixed_frame_wrong_size": (_set(fixed + b"\0" * 8, 8, len(fixed) + 8,
                                      4), C.UNEXPECTED_SIZE),
      "unknown_representation": (_set(good, 35, 7, 1), C.UNKNOWN_KIND),
      "too_many_entries": (_reply(values=np.full(5, 0.2, np.float32),
                                  ids=np.arange(5, dtype=np.int32)),
                           C.ABSURD_LENGTH),
      "position_beyond_depth": (_set(good, 34, 5, 1), C.ABSURD_LENGTH),
      "count_payload_mismatch": (_set(good, 36, 1, 4), C.UNEXPECTED_SIZE),
      "declared_mass": (_set(good, 44, M - 1, 4), C.WRONG_MASS),
      "row_duplicate_id": (_reply(ids=np.array([5, 5], np.int32)),
                           C.DUPLICATE_ID),
      "row_zero_q_at_token": (_reply(body={"position": 0, "token": 3,
                                           "mass": M}), C.ZERO_Q_AT_TOKEN),
  }


_CASES = _framing_cases()


@pytest.mark.parametrize("name", sorted(_CASES))
def test_every_framing_refusal(name):
  frame, code = _CASES[name]
  with pytest.raises(wire.ProtocolError) as info:
    codec.decode(frame, BOUNDS)
  assert info.value.code == code, info.value


# Bytes a decode may allocate at its peak (numpy views, scalars, the error
# object): about 5 KB measured for the 64-byte REPLY below; an allocation
# sized by a corrupted length or count would be far above it.
_DECODE_PEAK_BOUND = 16 * 1024
# Fields whose value sizes something: version, kind, length (header);
# position, representation, count (REPLY body). A length-dependent read or
# allocation would hide behind a flip of one of these.
_SIZE_FIELDS = [(4, 2), (6, 2), (8, 4), (34, 1), (35, 1), (36, 4)]


def _flips(frame, bits):
  """Every frame with one or two of `bits` flipped, raw and resealed."""
  for i, j in itertools.combinations_with_replacement(bits, 2):
    buf = bytearray(frame)
    buf[i // 8] ^= 1 << (i % 8)
    if j != i:
      buf[j // 8] ^= 1 << (j % 8)
    yield bytes(buf)
    yield _reseal(buf)


def _decode_peak(decode, frame):
  """Peak bytes allocated (Python and numpy) while `decode(frame)` runs."""
  tracemalloc.reset_peak()
  base = tracemalloc.get_traced_memory()[0]
  try:
    decode(frame)
  except wire.ProtocolError:
    pass
  return tracemalloc.get_traced_memory()[1] - base


def test_every_single_and_double_bit_flip_of_header_and_row():
  """All 1- and 2-bit flips of a sparse REPLY (header, body, first row).

  Raw flips must die on a framing check (most on the CRC); resealed flips
  (the CRC recomputed, as if the corruption came before checksumming) reach
  the body and row checks. Each outcome is a ProtocolError or a frame whose
  row validated; no other exception.
  """
  good = _reply()
  outcomes = {"valid": 0, "refused": 0}
  for frame in _flips(good, range(len(good) * 8)):
    try:
      got = codec.decode(frame, BOUNDS)
      assert got.counts.sum(dtype=np.uint64) == M
      outcomes["valid"] += 1
    except wire.ProtocolError:
      outcomes["refused"] += 1
  assert outcomes["refused"] > outcomes["valid"] > 0


def test_a_corrupted_size_never_sizes_an_allocation():
  """A decode's peak allocation stays bounded under every flip of a field
  that sizes something (and every single flip anywhere), whatever the
  flipped value claims; the bound counts bytes, not seconds, so it holds
  on any machine. The same harness catches a decoder that trusts the
  declared count before checking it against the frame.
  """
  good = _reply()
  size_bits = [8 * offset + b for offset, width in _SIZE_FIELDS
               for b in range(8 * width)]
  frames = itertools.chain(_flips(good, size_bits),
                           (f for i in range(len(good) * 8)
                            for f in _flips(good, [i])))

  def trusting_decode(frame):   # the mutant: allocates what the peer says
    count = int.from_bytes(frame[36:40], "little")
    np.empty(min(count, 1 << 24), np.float32)
    return codec.decode(frame, BOUNDS)

  tracemalloc.start()
  try:
    worst = max(_decode_peak(lambda f: codec.decode(f, BOUNDS), f)
                for f in frames)
    mutant = max(_decode_peak(trusting_decode, f)
                 for f in _flips(good, [8 * 36 + b for b in range(32)]))
  finally:
    tracemalloc.stop()
  assert 0 < worst <= _DECODE_PEAK_BOUND, worst
  assert mutant > 100 * _DECODE_PEAK_BOUND, mutant


@hypothesis.given(st.binary(max_size=160))
def test_arbitrary_bytes_decode_or_refuse(data):
  for frame in (data, _reseal(data) if len(data) >= 16 else data):
    try:
      codec.decode(frame, BOUNDS)
    except wire.ProtocolError:
      pass


def test_wire_doc_matches_layouts():
  doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" /
         "wire.md").read_text()
  assert layouts.describe() in doc
  for code in C:
    assert f"| {code.name} | {int(code)} |" in doc
