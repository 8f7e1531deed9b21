"""Writes the wire v3 seed corpus: one frame per rejection class of `decode`.

Run from the repository root (it rewrites tests/fuzz_corpus/wire/):

    python -m tests.fuzz_corpus.make_wire_corpus [DIR]

Every frame is built with the codec plus byte edits, sealed (or resealed
after an edit) with the corpus key `KEY`, and the script asserts that
decoding each one (`decode(frame, bounds, KEY, validate_rows=True)`) gives
exactly the intended outcome before it writes anything. A file is named by
that outcome:

    [PREFIX.]CODE[.variant].bin    decode raises ProtocolError(CODE)
    [PREFIX.]valid_WHAT.bin        decode accepts the frame

under `BOUNDS` (a sampled sparse session), `DENSE_BOUNDS` (the `dense.`
prefix), `GREEDY_BOUNDS` (`greedy.`), the sparse and dense bounds of a
session that agreed on PACKED replies (`packed.`, `packed_dense.`),
those of a session that agreed on CONTEXT frames (`context.`), or those
of a session that agreed on PACKED_STEP frames (`packed_step.`).
tests/system/test_fuzz_wire.py checks the
names and that the checked-in files equal what this script writes; the
fuzz harness (tests/fuzz_wire.py) decodes under the same bounds and key.

Codes that `decode` can never raise get no file:

  IDENTITY_MISMATCH, STALE_GENERATION, DUPLICATE_ROUND, TIMEOUT,
  STATE_MISMATCH, UNKNOWN_SESSION, SESSION_EXHAUSTED, BAD_SEQUENCE,
  CHECKSUM_MISMATCH, BAD_STATUS: session-level; the bridge raises them by
    comparing frames with the session's state or with each other (HELLO
    identities, generations, answered rounds, the watchdog, anchors, open
    sessions, the seals a session's GMAC key has made, the expected next
    frame, a COMPLETION and its REPLY, status values).
    `decode` sees one frame and the negotiated `Bounds`, nothing else.
  SAMPLING_MISMATCH: needs the round's PROPOSAL draws (the verifier's).
  PROPOSER_FAILED: the worker's own refusal, never a decode.
  WRONG_DTYPE: `decode` makes the row's arrays itself, as "<f4" / "<i4"
    views, which are exactly float32 / int32 on a little-endian host.
"""

import pathlib
import sys

import numpy as np

from dyadic_jax.wire import auth, codec
from dyadic_jax.wire.layouts import HEADER_BYTES, Kind, Representation
from dyadic_jax.wire.refusals import Code, ProtocolError
from tests import wire_edits

M = 1 << 24
# Small, so that a dense REPLY is 64 + 24 + 3 x 4 x 64 = 856 bytes and the
# fuzzer reaches the row checks quickly; k < V keeps the formats apart.
BOUNDS = codec.Bounds(vocab=64, depth=3, width=8,
                      representation=Representation.SPARSE, max_requests=2)
DENSE_BOUNDS = BOUNDS._replace(width=64, representation=Representation.DENSE)
GREEDY_BOUNDS = BOUNDS._replace(width=0, representation=Representation.TOKEN)
PACKED_BOUNDS = BOUNDS._replace(packed=True)
PACKED_DENSE_BOUNDS = DENSE_BOUNDS._replace(packed=True)
CONTEXT_BOUNDS = BOUNDS._replace(max_context=8)
PACKED_STEP_BOUNDS = BOUNDS._replace(packed_step=True)
KEY = auth.Blake3Tag(bytes(range(100, 132)))

NEVER_FROM_DECODE = {
    Code.IDENTITY_MISMATCH: "session-level (HELLO identities), the bridge",
    Code.STALE_GENERATION: "session-level (generation), the bridge",
    Code.DUPLICATE_ROUND: "session-level (answered rounds), the bridge",
    Code.TIMEOUT: "session-level (watchdog), the bridge",
    Code.STATE_MISMATCH: "session-level (anchor, digests), the bridge",
    Code.UNKNOWN_SESSION: "session-level (open sessions), the bridge",
    Code.SESSION_EXHAUSTED: "session-level (the GMAC key's seal count)",
    Code.BAD_SEQUENCE: "session-level (expected frame), the bridge",
    Code.CHECKSUM_MISMATCH: "session-level (COMPLETION vs REPLY)",
    Code.BAD_STATUS: "session-level (status and reason values)",
    Code.SAMPLING_MISMATCH: "the verifier's audit (PROPOSAL draws)",
    Code.PROPOSER_FAILED: "the worker's own refusal",
    Code.WRONG_DTYPE: "decode's own views are float32 / int32",
}

DIRECTORY = pathlib.Path(__file__).resolve().parent / "wire"
PREFIXES = {"greedy.": GREEDY_BOUNDS, "dense.": DENSE_BOUNDS,
            "packed.": PACKED_BOUNDS, "packed_dense.": PACKED_DENSE_BOUNDS,
            "context.": CONTEXT_BOUNDS, "packed_step.": PACKED_STEP_BOUNDS}
VALID_PREFIX = "valid_"
_BODY = HEADER_BYTES
_SPARSE_IDS = np.array([2, 5, 9, 30, 63], np.int32)
_SPARSE_COUNTS = np.array([1, 3 << 21, 1 << 23, (1 << 20) - 1, 1 << 20])
# The drafted token of the sparse (9), dense and greedy frames: the
# committed corpus was written with these.
_DENSE_TOKEN, _GREEDY_TOKEN = 30, 17


def _seal(buf):
  return wire_edits.reseal(buf, KEY)


def _set(buf, offset, value, nbytes, seal=True):
  return wire_edits.set_field(buf, offset, value, nbytes,
                              KEY if seal else None)


def _reply(bounds=BOUNDS, edit=None, depth=2, token=9):
  """A valid REPLY of `depth` rows drafting `token` (q on the support
  _SPARSE_IDS, laid out by the session's q format), then edit(rows) (and
  resealed)."""
  buf = bytearray(bounds.reply_bytes(depth))
  frame, rows = codec.begin_reply(buf, bounds=bounds, session=0x0123456789AB,
                                  generation=3, round_id=11, request=2,
                                  depth=depth)
  bounds.format.put(rows, np.broadcast_to(_SPARSE_IDS, (depth, 5)),
                    np.broadcast_to(_SPARSE_COUNTS, (depth, 5)))
  rows.tokens[:] = token
  if edit is not None:
    edit(rows)
  del frame
  return _seal(buf)


def _packed(bounds=PACKED_BOUNDS, edit=None, depth=2, token=9, short=None):
  """A valid PACKED frame of two records: request 2 answered with `depth`
  rows as `_reply`'s (or its first `short` only, the rest zeros: a short
  answer of an ADAPTIVE_DEPTH session), request 5 refused
  (PROPOSER_FAILED: zero rows); then edit(rows) (and resealed)."""
  d = depth if short is None else short
  packed = codec.begin_packed(
      bytearray(bounds.packed_bytes(2, depth)), bounds=bounds,
      session=0x0123456789AB, generation=3, round_id=11, requests=2,
      depth=depth)
  packed.records[0] = (2, d, 0, 0, 3, 11, 1000, 7)
  packed.records[1] = (5, 0, int(Code.PROPOSER_FAILED), 0, 3, 11, 1000, 7)
  rows = codec.qformats.Rows(*(None if a is None else a[0, :d]
                               for a in packed.rows))
  bounds.format.put(rows, np.broadcast_to(_SPARSE_IDS, (d, 5)),
                    np.broadcast_to(_SPARSE_COUNTS, (d, 5)))
  rows.tokens[:] = token
  if edit is not None:
    edit(packed.rows)
  return _seal(bytes(packed.frame))


def _context(tokens=(1, 2, 63, 0)):
  """A valid CONTEXT frame of request 2's prefix `tokens`."""
  return codec.encode_context(session=0x0123456789AB, generation=3,
                              round_id=11, request=2, tokens=list(tokens),
                              send=KEY)


def _packed_step(requests=2):
  """A valid PACKED_STEP frame of `requests` records (requests 2, 5, ...;
  the STEP of `_valid`'s per-request fields)."""
  return codec.encode_packed_step(
      session=0x0123456789AB, depth=3, policy=1, send=KEY, records=[
          (2 + 3 * r, 0, 9 + r, 3, 11, 2 ** 63 + 5 + r, 1000 + r, 7,
           bytes([0xa5 + r]) * 32) for r in range(requests)])


def _rows(**fields):
  def edit(rows):
    for name, (index, value) in fields.items():
      getattr(rows, name)[index] = value
  return edit


def _encode(kind, **body):
  return codec.encode(kind, session=0x0123456789AB, generation=3,
                      round_id=11, body=body, send=KEY)


def _valid():
  hello = {"mode": 2, "precision": 1, "rng_abi": 1, "max_slots": 2,
           "vocab": BOUNDS.vocab, "max_depth": BOUNDS.depth,
           "representation": Representation.SPARSE,
           "max_support": BOUNDS.width, "max_requests": 2,
           "max_reply_bytes": 4096, "nonce": b"\x11" * 32,
           "semantic_id": b"dyadic24-standard-v1",
           "verifier_id": b"verifier", "id_map_hash": b"\x5a" * 32,
           "draft_id": b"draft", "target_id": b"target"}
  step = {"slot": 1, "request": 2, "depth": 3, "policy": 1, "last_token": 9,
          "seed": 2 ** 63 + 5, "anchor": 1000, "context_version": 7,
          "prefix_digest": b"\xa5" * 32}
  completion = {"request": 2, "depth": 2, "reply_bytes": 272,
                "anchor": 1000, "context_version": 7,
                "reply_tag": b"\x77" * 16}
  commit = {"request": 2, "accepted": 3, "next_token": 17,
            "new_position": 1004}
  return {
      "valid_HELLO": _encode(Kind.HELLO, **hello),
      "valid_STEP": _encode(Kind.STEP, **step),
      "valid_REPLY_sparse": _reply(),
      "dense.valid_REPLY_dense": _reply(DENSE_BOUNDS, token=_DENSE_TOKEN),
      "valid_COMPLETION": _encode(Kind.COMPLETION, **completion),
      "valid_COMMIT": _encode(Kind.COMMIT, **commit),
      "valid_RESET": _encode(Kind.RESET, request=0xFFFF, reason=1),
      "greedy.valid_REPLY_token": _reply(GREEDY_BOUNDS, token=_GREEDY_TOKEN),
      "packed.valid_PACKED_sparse": _packed(),
      "packed_dense.valid_PACKED_dense": _packed(PACKED_DENSE_BOUNDS,
                                                 token=_DENSE_TOKEN),
      # Short answers (ADAPTIVE_DEPTH): 1 row of 3, a record's 1 of 2.
      "valid_REPLY_short": _reply(depth=1),
      "packed.valid_PACKED_short": _packed(short=1),
      "packed_dense.valid_PACKED_dense_short": _packed(
          PACKED_DENSE_BOUNDS, token=_DENSE_TOKEN, short=1),
      "packed.valid_STEP": _encode(Kind.STEP, **step),
      "context.valid_CONTEXT": _context(),
      "context.valid_CONTEXT_full": _context(range(56, 64)),
      "context.valid_STEP": _encode(Kind.STEP, **step),
      "packed_step.valid_PACKED_STEP": _packed_step(),
      "packed_step.valid_PACKED_STEP_one": _packed_step(1),
  }


def _refused():
  """name -> frame; the name's first part is the Code decode must raise."""
  good = _reply()
  commit = _encode(Kind.COMMIT, request=1)
  nan, inf = np.float32(np.nan), np.float32(np.inf)
  t = 2.0 ** -24
  return {
      # Framing, in decode's order.
      "TRUNCATED": good[:20],
      "BAD_MAGIC": b"XQ24" + good[4:],
      "UNSUPPORTED_VERSION": _set(good, 4, 2, 2),
      "UNKNOWN_KIND": _set(good, 6, 99, 2),
      "TRUNCATED.frame": good[:-1],
      "UNEXPECTED_SIZE": good + b"\0",
      "AUTH_FAILED": good[:-1] + bytes([good[-1] ^ 1]),
      "AUTH_FAILED.header": _set(good, 28, 12, 4, seal=False),
      "UNEXPECTED_SIZE.fixed_kind": _set(commit + bytes(8), 8,
                                         len(commit) + 8, 4),
      "TRUNCATED.reply_body": _set(good[:60], 8, 60, 4),
      # The REPLY body.
      "UNKNOWN_KIND.representation": _set(good, _BODY + 4, 7, 2),
      "UNKNOWN_KIND.dense_on_sparse": _set(good, _BODY + 4, 1, 2),
      "MISSING_Q.token_row": _set(good, _BODY + 4, 0, 2),
      "ABSURD_LENGTH.depth": _set(good, _BODY + 2, 4, 2),
      "ABSURD_LENGTH.width": _set(good, _BODY + 8, 9, 4),
      "UNEXPECTED_SIZE.width": _set(good, _BODY + 8, 7, 4),
      "UNEXPECTED_SIZE.depth": _set(good, _BODY + 2, 1, 2),
      "WRONG_MASS.declared": _set(good, _BODY + 12, M - 1, 4),
      # The q rows (qrows), in its order.
      "TOKEN_OUT_OF_RANGE": _reply(edit=_rows(tokens=(1, 64))),
      "TOKEN_OUT_OF_RANGE.negative": _reply(edit=_rows(tokens=(0, -1))),
      "MISSING_Q": _reply(edit=_rows(n=(1, 0))),
      "MISSING_Q.above_k": _reply(edit=_rows(n=(1, 9))),
      "ID_OUT_OF_RANGE": _reply(edit=_rows(ids=((1, 4), 64))),
      "ID_OUT_OF_RANGE.negative": _reply(edit=_rows(ids=((1, 0), -1))),
      "DUPLICATE_ID": _reply(edit=_rows(ids=((1, 1), 2))),
      "UNSORTED_IDS": _reply(edit=_rows(ids=((1, 1), 1))),
      "NON_FINITE": _reply(edit=_rows(values=((1, 0), nan))),
      "NON_FINITE.inf": _reply(edit=_rows(values=((0, 2), inf))),
      "NEGATIVE": _reply(edit=_rows(values=((1, 0), -t))),
      "NEGATIVE.subnormal": _reply(edit=lambda r: r.values[1].view(
          np.uint32).__setitem__(0, 0x80000001)),
      "WRONG_MASS": _reply(edit=_rows(values=((1, 0), 2.0))),
      "NON_DYADIC": _reply(edit=_rows(values=((1, 0), 2.0 ** -25))),
      "NON_DYADIC.subnormal": _reply(edit=lambda r: r.values[1].view(
          np.uint32).__setitem__(0, 1)),
      "WRONG_MASS.sum": _reply(edit=_rows(values=((1, 0), 2 * t))),
      "ZERO_Q_AT_TOKEN.absent": _reply(edit=_rows(tokens=(1, 3))),
      "ZERO_Q_AT_TOKEN.zero_at_id": _reply(edit=lambda r: (
          r.values[1].__setitem__(1, r.values[1, 1] + r.values[1, 2]),
          r.values[1].__setitem__(2, 0))),
      "dense.ZERO_Q_AT_TOKEN": _reply(DENSE_BOUNDS, token=_DENSE_TOKEN,
                                      edit=_rows(tokens=(1, 4))),
      "dense.LENGTH_MISMATCH": _reply(DENSE_BOUNDS, token=_DENSE_TOKEN,
                                      edit=_rows(n=(0, 63))),
      "dense.NON_FINITE": _reply(DENSE_BOUNDS, token=_DENSE_TOKEN,
                                 edit=_rows(values=((0, 0), np.nan))),
      # PACKED: the form must be the session's, then REPLY's checks once.
      "UNKNOWN_KIND.packed_on_frames": _packed(),
      "packed.UNKNOWN_KIND.reply_on_packed": good,
      "packed.UNKNOWN_KIND.completion_on_packed": _encode(
          Kind.COMPLETION, request=2),
      "packed.TRUNCATED.packed_body": _set(_packed()[:60], 8, 60, 4),
      "packed.UNKNOWN_KIND.representation": _set(_packed(), _BODY + 4, 7,
                                                 2),
      "packed.ABSURD_LENGTH.requests": _set(_packed(), _BODY, 3, 2),
      "packed.ABSURD_LENGTH.no_requests": _set(_packed(), _BODY, 0, 2),
      "packed.ABSURD_LENGTH.depth": _set(_packed(), _BODY + 2, 4, 2),
      "packed.ABSURD_LENGTH.width": _set(_packed(), _BODY + 8, 9, 4),
      "packed.UNEXPECTED_SIZE.depth": _set(_packed(), _BODY + 2, 1, 2),
      "packed.UNEXPECTED_SIZE.extra": _set(_packed() + bytes(4), 8,
                                           len(_packed()) + 4, 4),
      "packed.WRONG_MASS.declared": _set(_packed(), _BODY + 12, M - 1, 4),
      "packed.ZERO_Q_AT_TOKEN": _packed(edit=lambda r: r.tokens.__setitem__(
          (0, 1), 3)),
      "packed_dense.NON_FINITE": _packed(
          PACKED_DENSE_BOUNDS, token=_DENSE_TOKEN,
          edit=lambda r: r.values.__setitem__((0, 0, 0), np.nan)),
      # CONTEXT: the session's form, then its count, size and tokens.
      "UNKNOWN_KIND.context_on_plain": _context(),
      "context.TRUNCATED.context_body": _set(_context()[:52], 8, 52, 4),
      "context.ABSURD_LENGTH.context_count": _set(_context(), _BODY + 4, 9,
                                                  4),
      "context.ABSURD_LENGTH.no_tokens": _set(_context(), _BODY + 4, 0, 4),
      "context.UNEXPECTED_SIZE.context_count": _set(_context(), _BODY + 4,
                                                    3, 4),
      "context.TOKEN_OUT_OF_RANGE.context": _context((1, 64)),
      "context.TOKEN_OUT_OF_RANGE.context_negative": _context((-1, 2)),
      # PACKED_STEP: the session's form, then its record count and size.
      "UNKNOWN_KIND.packed_step_on_frames": _packed_step(),
      "packed_step.UNKNOWN_KIND.step_on_packed_step": _encode(
          Kind.STEP, request=2),
      "packed_step.TRUNCATED.packed_step_body": _set(_packed_step()[:52], 8,
                                                     52, 4),
      "packed_step.ABSURD_LENGTH.step_records": _set(_packed_step(), _BODY,
                                                     3, 2),
      "packed_step.ABSURD_LENGTH.no_step_records": _set(_packed_step(),
                                                        _BODY, 0, 2),
      "packed_step.UNEXPECTED_SIZE.step_records": _set(_packed_step(),
                                                       _BODY, 1, 2),
      "packed_step.UNEXPECTED_SIZE.step_record_cut": _set(
          _packed_step()[:-8], 8, len(_packed_step()) - 8, 4),
      "packed_step.AUTH_FAILED.step_record": _set(_packed_step(), 60, 1, 4,
                                                  seal=False),
      # A greedy session: the tokens alone, never a q row.
      "greedy.SAMPLED_ON_GREEDY": good,
      "greedy.SAMPLED_ON_GREEDY.n": _reply(GREEDY_BOUNDS, token=_GREEDY_TOKEN,
                                           edit=_rows(n=(0, 1))),
      "greedy.TOKEN_OUT_OF_RANGE": _reply(GREEDY_BOUNDS, token=_GREEDY_TOKEN,
                                          edit=_rows(tokens=(0, 64))),
  }


def frames():
  """The corpus: file name -> frame bytes."""
  corpus = {**_valid(), **_refused()}
  return {f"{name}.bin": frame for name, frame in corpus.items()}


def outcome(name):
  """(bounds, expected Code or None for a valid frame) of a file name."""
  stem = name.removesuffix(".bin")
  bounds = BOUNDS
  for prefix, b in PREFIXES.items():
    if stem.startswith(prefix):
      bounds, stem = b, stem.removeprefix(prefix)
  head = stem.split(".")[0]
  return bounds, None if head.startswith(VALID_PREFIX) else Code[head]


def decode_outcome(name, frame):
  """The Code decode raises for `frame` under `name`'s bounds, or None."""
  bounds, _ = outcome(name)
  try:
    codec.decode(frame, bounds, KEY, validate_rows=True)
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
