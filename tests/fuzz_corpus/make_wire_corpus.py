"""Writes the wire v2 seed corpus: one frame per rejection class of `decode`.

Run from the repository root (it rewrites tests/fuzz_corpus/wire/):

    python -m tests.fuzz_corpus.make_wire_corpus [DIR]

Every frame is built with `codec.encode` plus byte edits (the CRC resealed
where an edit must get past the checksum), and the script asserts that
decoding each one gives exactly the intended outcome before it writes
anything. A file is named by that outcome:

    [greedy.]CODE[.variant].bin     decode raises ProtocolError(Code.CODE)
    [greedy.]valid_WHAT.bin         decode accepts the frame

under `BOUNDS` (a sampled v2 session), or `GREEDY_BOUNDS` (a v1 session)
with the `greedy.` prefix. tests/test_wire_fuzz.py checks the names and
that the checked-in files equal what this script writes; the fuzz harness
(tests/fuzz_wire.py) decodes under the same bounds.

Codes that `decode` can never raise get no file:

  IDENTITY_MISMATCH, STALE_GENERATION, DUPLICATE_ROUND, TIMEOUT,
  STATE_MISMATCH, UNKNOWN_SESSION, BAD_SEQUENCE: session-level; the bridge
    raises them by comparing a frame with the session's state (HELLO
    identities, generation, answered rounds, the watchdog, anchors and
    digests, open sessions, the expected next frame). `decode` sees one
    frame and the negotiated `Bounds`, nothing else.
  WRONG_DTYPE: `decode` makes the row's arrays itself, as 1-D "<f4" / "<i4"
    views, which are exactly float32 / int32 on a little-endian host.
"""

import pathlib
import sys

import numpy as np

from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import Kind, Representation
from tests import wire_edits

M = 1 << 24
# Small, so that a dense REPLY is 304 bytes and the fuzzer reaches the row
# checks quickly; max_support < vocab keeps sparse and dense limits apart.
BOUNDS = codec.Bounds(vocab=64, max_support=16, max_depth=5)
GREEDY_BOUNDS = BOUNDS._replace(greedy=True,
                                versions=(layouts.GREEDY_VERSION,))

NEVER_FROM_DECODE = {
    Code.IDENTITY_MISMATCH: "session-level (HELLO identities), the bridge",
    Code.STALE_GENERATION: "session-level (generation), the bridge",
    Code.DUPLICATE_ROUND: "session-level (answered rounds), the bridge",
    Code.TIMEOUT: "session-level (watchdog), the bridge",
    Code.STATE_MISMATCH: "session-level (anchor, digests), the bridge",
    Code.UNKNOWN_SESSION: "session-level (open sessions), the bridge",
    Code.BAD_SEQUENCE: "session-level (expected frame), the bridge",
    Code.WRONG_DTYPE: "decode's own views are float32 / int32",
}

DIRECTORY = pathlib.Path(__file__).resolve().parent / "wire"
GREEDY_PREFIX = "greedy."
VALID_PREFIX = "valid_"

# A dyadic row over a few ids, with uneven counts (not only powers of two).
_DENSE_COUNTS = {0: 1, 3: 3 << 20, 17: 1 << 23, 40: (1 << 22) - 1,
                 63: 1 << 20}
_SPARSE_IDS = np.array([2, 5, 9, 30, 63], np.int32)
_SPARSE_VALUES = np.array([1, 3 << 21, 1 << 23, (1 << 20) - 1, 1 << 20],
                          np.float64) / M


def _dense_values():
  values = np.zeros(BOUNDS.vocab, np.float32)
  for i, c in _DENSE_COUNTS.items():
    values[i] = c / M
  return values


def _encode(kind, version=layouts.WIRE_VERSION, **kw):
  return codec.encode(kind, session=0x0123456789AB, generation=3, round_id=11,
                      version=version, **kw)


def _reply(values=_SPARSE_VALUES, ids=_SPARSE_IDS, *, token=5, position=1,
           version=layouts.WIRE_VERSION, **body):
  body = {"request": 2, "position": position, "token": token, "mass": M,
          **body}
  if values is not None:
    values = np.asarray(values, np.float32)
  return _encode(Kind.REPLY, version, body=body, values=values, ids=ids)


_reseal = wire_edits.reseal


def _set(buf, offset, value, nbytes, reseal=True):
  return wire_edits.set_field(buf, offset, value, nbytes, reseal)


# Offsets of the fields the edits below touch (docs/wire.md, "Layouts").
_VERSION, _KIND, _LENGTH = 4, 6, 8
_POSITION, _REPRESENTATION, _COUNT = 34, 35, 36


def _valid():
  hello = {"mode": layouts.WIRE_VERSION, "precision": 1, "rng_abi": 1,
           "max_slots": 4, "vocab": BOUNDS.vocab,
           "max_depth": BOUNDS.max_depth,
           "representation": Representation.SPARSE,
           "max_support": BOUNDS.max_support, "max_requests": 2,
           "max_reply_bytes": 4096, "semantic_id": b"dyadic24-standard-v1",
           "verifier_id": b"verifier", "id_map_hash": b"\x5a" * 32,
           "draft_id": b"draft", "target_id": b"target"}
  step = {"slot": 1, "request": 2, "depth": 4, "policy": 1, "last_token": 9,
          "seed": 2 ** 63 + 5, "anchor": 1000, "context_version": 7,
          "prefix_digest": b"\xa5" * 32}
  completion = {"request": 2, "depth": 4, "replies_crc": 0xDEADBEEF,
                "reply_bytes": 4 * 88, "anchor": 1000, "context_version": 7}
  commit = {"request": 2, "accepted": 3, "next_token": 17,
            "new_position": 1004}
  return {
      "valid_HELLO": _encode(Kind.HELLO, body=hello),
      "valid_STEP": _encode(Kind.STEP, body=step),
      "valid_REPLY_dense": _reply(_dense_values(), None, token=17),
      "valid_REPLY_sparse": _reply(),
      "valid_COMPLETION": _encode(Kind.COMPLETION, body=completion),
      "valid_COMMIT": _encode(Kind.COMMIT, body=commit),
      "valid_RESET": _encode(Kind.RESET, body={"request": 0xFFFF,
                                               "reason": 1}),
      GREEDY_PREFIX + "valid_REPLY_token": _reply(
          None, None, token=17, version=layouts.GREEDY_VERSION),
  }


def _refused():
  """name -> frame; the name's first part is the Code decode must raise."""
  good = _reply()
  dense = _reply(_dense_values(), None, token=17)
  commit = _encode(Kind.COMMIT, body={"request": 1})
  body_cut = _reseal(_set(good, _LENGTH, 40, 4, reseal=False)[:40])
  v1 = layouts.GREEDY_VERSION
  nan, inf = np.float32(np.nan), np.float32(np.inf)
  return {
      # Framing, in decode's order.
      "TRUNCATED": good[:20],
      "BAD_MAGIC": b"XQ24" + good[4:],
      "UNSUPPORTED_VERSION": _set(good, _VERSION, v1, 2),
      "UNKNOWN_KIND": _set(good, _KIND, 99, 2),
      "ABSURD_LENGTH": _set(good, _LENGTH, 2 ** 31, 4),
      "TRUNCATED.frame": good[:-1],
      "UNEXPECTED_SIZE": good + b"\0",
      "CHECKSUM_MISMATCH": good[:-1] + bytes([good[-1] ^ 1]),
      "UNEXPECTED_SIZE.fixed_kind": _set(commit + bytes(8), _LENGTH,
                                         len(commit) + 8, 4),
      "TRUNCATED.reply_body": body_cut,
      # The REPLY body.
      "UNKNOWN_KIND.representation": _set(good, _REPRESENTATION, 7, 1),
      "MISSING_Q.token_row": _reply(None, None),
      "ABSURD_LENGTH.position": _set(good, _POSITION, BOUNDS.max_depth, 1),
      "ABSURD_LENGTH.count": _reply(np.full(17, 1 / 16), np.arange(17)),
      "UNEXPECTED_SIZE.count": _set(good, _COUNT, 1, 4),
      "WRONG_MASS.declared": _reply(mass=M - 1),
      # The q row (validate_q_row), in its order.
      "TOKEN_OUT_OF_RANGE": _reply(token=BOUNDS.vocab),
      "TOKEN_OUT_OF_RANGE.negative": _reply(token=-1),
      "MISSING_Q": _reply([], []),
      # decode lets a dense row declare fewer than vocab entries; the row
      # check refuses it.
      "LENGTH_MISMATCH": _reply(_dense_values()[:16], None, token=3),
      "ID_OUT_OF_RANGE": _reply([0.5, 0.5], [5, BOUNDS.vocab]),
      "ID_OUT_OF_RANGE.negative": _reply([0.5, 0.5], [-1, 5]),
      "DUPLICATE_ID": _reply([0.5, 0.5, 0.0], [2, 5, 5]),
      "UNSORTED_IDS": _reply([0.5, 0.5], [5, 2]),
      "NON_FINITE": _reply([0.5, nan], [2, 5]),
      "NON_FINITE.inf": _reply(np.where(_dense_values() == 0, 0, inf), None,
                               token=17),
      "NEGATIVE": _reply([1.5, -0.5], [2, 5]),
      "WRONG_MASS": _reply([2.0, 0.5], [2, 5]),
      "NON_DYADIC": _reply([0.5, 0.5 - 2.0 ** -25], [2, 5]),
      "WRONG_MASS.sum": _reply([0.5, 0.25], [2, 5]),
      "ZERO_Q_AT_TOKEN": _reply(_dense_values(), None, token=4),
      "ZERO_Q_AT_TOKEN.absent": _reply(token=3),
      "ZERO_Q_AT_TOKEN.zero_at_id": _reply([1.0, 0.0], [2, 5]),
      "ZERO_Q_AT_TOKEN.negative_zero": _reply([1.0, -0.0], [2, 5]),
      # A v1 (greedy) session: the token alone, never a q row.
      GREEDY_PREFIX + "SAMPLED_ON_GREEDY": _reply(version=v1),
      GREEDY_PREFIX + "SAMPLED_ON_GREEDY.dense": _reply(
          _dense_values(), None, token=17, version=v1),
      GREEDY_PREFIX + "UNEXPECTED_SIZE.token_payload": _set(
          _reply(None, None, version=v1), _COUNT, 1, 4),
      GREEDY_PREFIX + "TOKEN_OUT_OF_RANGE": _reply(
          None, None, token=BOUNDS.vocab, version=v1),
      GREEDY_PREFIX + "UNSUPPORTED_VERSION": dense,
  }


def frames():
  """The corpus: file name -> frame bytes."""
  return {f"{name}.bin": frame
          for name, frame in {**_valid(), **_refused()}.items()}


def outcome(name):
  """(bounds, expected Code or None for a valid frame) of a file name."""
  stem = name.removesuffix(".bin")
  bounds = BOUNDS
  if stem.startswith(GREEDY_PREFIX):
    bounds, stem = GREEDY_BOUNDS, stem.removeprefix(GREEDY_PREFIX)
  head = stem.split(".")[0]
  return bounds, None if head.startswith(VALID_PREFIX) else Code[head]


def decode_outcome(name, frame):
  """The Code decode raises for `frame` under `name`'s bounds, or None."""
  bounds, _ = outcome(name)
  try:
    codec.decode(frame, bounds)
  except ProtocolError as e:
    return e.code
  return None


def check(corpus):
  """Raises AssertionError unless each frame decodes as its name says."""
  for name, frame in sorted(corpus.items()):
    want, got = outcome(name)[1], decode_outcome(name, frame)
    if got != want:
      raise AssertionError(f"{name}: decode gave {got!r}, expected {want!r}")
  codes = {outcome(name)[1] for name in corpus} - {None}
  missing = set(Code) - codes - set(NEVER_FROM_DECODE)
  if missing or codes & set(NEVER_FROM_DECODE):
    raise AssertionError(f"corpus codes {sorted(codes)} vs. decodable "
                         f"{sorted(set(Code) - set(NEVER_FROM_DECODE))}")


def write(directory=DIRECTORY):
  """Checks the corpus, then replaces every *.bin in `directory` with it."""
  corpus = frames()
  check(corpus)
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  for old in directory.glob("*.bin"):
    old.unlink()
  for name, frame in corpus.items():
    (directory / name).write_bytes(frame)
  return corpus


def main(argv):
  directory = pathlib.Path(argv[1]) if len(argv) > 1 else DIRECTORY
  corpus = write(directory)
  print(f"wrote {len(corpus)} frames to {directory}")


if __name__ == "__main__":
  main(sys.argv)
