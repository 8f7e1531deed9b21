"""Encode and decode wire v3 frames and messages, bounds first.

A message (one ZeroMQ message part) is a sequence of frames back to back;
`split` cuts it into frames by their `length` fields, refusing more frames
or bytes than the receiver's local bounds allow before anything else is
read. `decode` then reads one frame in this order, stopping at the first
failure (docs/wire.md, "Decoding order"):

  1. header size, magic, version, kind, declared length = frame size;
  2. the tag (`auth.check`): nothing of an unauthenticated frame's body is
     read;
  3. the body size of the kind; for a REPLY its representation, depth,
     width, declared mass and payload size against the session's `Bounds`,
     then views of its rows (no copy). The rows' values are validated by
     their q format (`qformats`), by the caller, before any use
     (`decode(..., validate_rows=True)` does it here, for tests and fuzz);
     for a PACKED frame (a session that negotiated it: `Bounds.packed`)
     the same checks once for the whole batch, then a view of its record
     table and of its [R, D, ...] rows; for a PACKED_STEP frame (a session
     that negotiated it: `Bounds.packed_step`) its record count and size,
     then each record as a STEP's body (`Step`); for a CONTEXT frame (a
     session that negotiated it: `Bounds.max_context`) its token count,
     its size and every token in [0, V), then a view of the tokens.

Fields are read with `struct` (no numpy record per frame): the hot path
reads a header in about a microsecond.
"""

import struct
import typing

import numpy as np

from dyadic_jax.wire import auth, layouts, qformats
from dyadic_jax.wire.layouts import (FIXED_BYTES, HEADER_BYTES, Kind, Mode,
                                     Representation)
from dyadic_jax.wire.refusals import Code, ProtocolError

_LENGTH = struct.Struct("<I")
_LENGTH_OFFSET = 8
_FIXED_KINDS = frozenset(k for k in Kind if k not in (
    Kind.REPLY, Kind.PACKED, Kind.CONTEXT, Kind.PACKED_STEP))
# The per-frame answer of a batch: refused on a PACKED session, as PACKED is
# on a per-frame one (UNKNOWN_KIND: a form the session did not negotiate).
_PER_FRAME = frozenset((Kind.REPLY, Kind.COMPLETION))
_RECORD_BYTES = layouts.PACKED_RECORD.itemsize
_KINDS = {int(k): k for k in Kind}
_REPRESENTATIONS = {int(r): r for r in Representation}
_MAX_FIXED = max(FIXED_BYTES[k] for k in _FIXED_KINDS)
_PACKED_BODY = layouts.BODY_STRUCTS[Kind.PACKED]
_PACKED_KIND = int(Kind.PACKED)
_STEP_KIND, _PACKED_STEP_KIND = int(Kind.STEP), int(Kind.PACKED_STEP)
# A STEP body's type (made at import from its layout: no static type).
_STEP_BODY: typing.Any = layouts.BODY_TYPES[Kind.STEP]
_STEP_RECORD = layouts.STEP_RECORD_STRUCT
_STEP_RECORD_BYTES = layouts.STEP_RECORD.itemsize
_HEADER, _HEADER_STRUCT = layouts.Header, layouts.HEADER_STRUCT
_MAGIC, _VERSION = layouts.MAGIC, layouts.WIRE_VERSION
_NO_TAG = bytes(layouts.TAG_BYTES)    # a frame's tag before it is sealed


class Bounds(typing.NamedTuple):
  """What a session negotiated (HELLO); checked before any allocation.

  width: entries per q row (V dense, k sparse, 0 greedy). packed: the
  session answers batches with PACKED frames (HELLO agreed on it).
  max_context: the most tokens of a CONTEXT frame; 0: the session did not
  agree on CONTEXT frames (one is refused, UNKNOWN_KIND). packed_step: the
  session's STEP messages carry one PACKED_STEP frame (HELLO agreed on it;
  a STEP frame is then refused, UNKNOWN_KIND, and the other way round).
  """
  vocab: int
  depth: int
  width: int
  representation: int = Representation.SPARSE
  max_requests: int = 1
  packed: bool = False
  max_context: int = 0
  packed_step: bool = False

  @property
  def mode(self) -> Mode:
    return Mode(self.format.mode)

  @property
  def format(self) -> qformats.QFormat:
    fmt = qformats.get(self.representation)
    assert fmt is not None, self.representation   # HELLO negotiated it
    return fmt

  def reply_bytes(self, depth: int | None = None) -> int:
    """Exact size of a REPLY frame of `depth` rows (default: the bound)."""
    depth = self.depth if depth is None else depth
    return FIXED_BYTES[Kind.REPLY] + self.format.payload_bytes(depth,
                                                               self.width)

  def packed_bytes(self, requests: int, depth: int) -> int:
    """Exact size of a PACKED frame of `requests` records of `depth` rows."""
    return (FIXED_BYTES[Kind.PACKED] + _RECORD_BYTES * requests
            + self.format.payload_bytes(requests * depth, self.width))

  def packed_step_bytes(self, requests: int) -> int:
    """Exact size of a PACKED_STEP frame of `requests` records."""
    return FIXED_BYTES[Kind.PACKED_STEP] + _STEP_RECORD_BYTES * requests

  @property
  def max_frame(self) -> int:
    context = self.context_bytes(self.max_context) if self.max_context else 0
    steps = (self.packed_step_bytes(self.max_requests) if self.packed_step
             else 0)
    if self.packed:
      return max(self.packed_bytes(self.max_requests, self.depth),
                 _MAX_FIXED, context, steps)
    return max(self.reply_bytes(), _MAX_FIXED, context, steps)

  @property
  def max_reply_message(self) -> int:
    """Largest worker -> verifier message: R (REPLY + COMPLETION); a
    PACKED frame of R requests is smaller (one header, 32-byte records)."""
    return self.max_requests * (self.reply_bytes()
                                + FIXED_BYTES[Kind.COMPLETION])

  def context_bytes(self, count: int) -> int:
    """Exact size of a CONTEXT frame of `count` tokens."""
    return FIXED_BYTES[Kind.CONTEXT] + 4 * count

  @property
  def max_request_message(self) -> int:
    """Largest verifier -> worker message: R fixed frames (or one HELLO);
    with CONTEXT frames, R (CONTEXT of max_context tokens + STEP). A
    PACKED_STEP frame of R records (56 + 72 R bytes) is smaller than R
    STEP frames (120 R), so the bound holds for either form."""
    fixed = max(FIXED_BYTES[k] for k in (Kind.STEP, Kind.COMMIT, Kind.RESET))
    if self.max_context:
      fixed = max(fixed, FIXED_BYTES[Kind.STEP] + self.context_bytes(
          self.max_context))
    return max(FIXED_BYTES[Kind.HELLO], self.max_requests * fixed)

  @property
  def max_request_frames(self) -> int:
    """Most frames of a verifier -> worker message: a STEP per request,
    and a CONTEXT before each with CONTEXT frames (a PACKED_STEP message:
    one frame, after at most R CONTEXTs)."""
    return self.max_requests * (2 if self.max_context else 1)


# Fixed-size frames only (HELLO, RESET, ...): what a side reads before any
# session exists. A REPLY is refused under them (width and depth 0).
HELLO_BOUNDS = Bounds(vocab=1, depth=0, width=0,
                      representation=Representation.TOKEN)


class Step(typing.NamedTuple):
  """One request's STEP: a STEP frame's body and tag, or a PACKED_STEP
  record's fields as a STEP body (slot and reserved zero; depth and policy
  the frame's) and its tag. A worker acts on either alike."""
  body: layouts.Body                   # layouts.BODY_TYPES[Kind.STEP]
  tag: tuple[int, int]


class Frame(typing.NamedTuple):
  """A decoded frame: header and body fields, and a REPLY's rows (views)."""
  header: layouts.Header
  body: layouts.Body                   # layouts.BODY_TYPES[kind]
  raw: memoryview                      # the frame's bytes
  rows: qformats.Rows | None = None    # REPLY and PACKED ([R, D, ...])
  counts: typing.Optional[qformats.Counts] = None  # validate_rows=True only
  records: np.ndarray | None = None    # PACKED only: PACKED_RECORD[R]
  tokens: np.ndarray | None = None     # CONTEXT only: int32[n] (a view)
  steps: tuple[Step, ...] | None = None  # PACKED_STEP only: per record

  @property
  def kind(self) -> Kind:
    return Kind(self.header.kind)

  @property
  def tag(self) -> tuple[int, int]:
    return (self.header.generation, self.header.round)


def split(message: layouts.Buffer, *, max_frames: int,
          max_bytes: int) -> list[memoryview]:
  """The frames of one message (memoryviews), sizes checked first.

  Refuses a message of more than `max_bytes` bytes (ABSURD_LENGTH), an
  empty one (TRUNCATED), a frame whose declared length is below the header
  size (UNEXPECTED_SIZE) or beyond the message (TRUNCATED), and more than
  `max_frames` frames (ABSURD_LENGTH), without reading any frame body.
  """
  buf = memoryview(message).cast("B")
  size = len(buf)
  if size > max_bytes:
    raise ProtocolError(Code.ABSURD_LENGTH, f"message of {size} bytes, bound "
                        f"{max_bytes}")
  if size == 0:
    raise ProtocolError(Code.TRUNCATED, "empty message")
  frames: list[memoryview] = []
  offset = 0
  while offset < size:
    if size - offset < HEADER_BYTES:
      raise ProtocolError(Code.TRUNCATED, f"{size - offset} bytes after "
                          f"frame {len(frames)}")
    if len(frames) == max_frames:
      raise ProtocolError(Code.ABSURD_LENGTH, f"more than {max_frames} frames")
    (length,) = _LENGTH.unpack_from(buf, offset + _LENGTH_OFFSET)
    if length < HEADER_BYTES:
      raise ProtocolError(Code.UNEXPECTED_SIZE, f"declared length {length}")
    if length > size - offset:
      raise ProtocolError(Code.TRUNCATED, f"frame of {length} bytes, "
                          f"{size - offset} left")
    frames.append(buf[offset:offset + length])
    offset += length
  return frames


def header(frame: memoryview) -> layouts.Header:
  """The header of one frame (memoryview): magic, version, kind, length."""
  if len(frame) < HEADER_BYTES:
    raise ProtocolError(Code.TRUNCATED, f"{len(frame)} bytes, header needs "
                        f"{HEADER_BYTES}")
  h = _HEADER._make(_HEADER_STRUCT.unpack_from(frame))
  if h.magic != _MAGIC:
    raise ProtocolError(Code.BAD_MAGIC, repr(h.magic))
  if h.version != _VERSION:
    raise ProtocolError(Code.UNSUPPORTED_VERSION, str(h.version))
  if h.kind not in _KINDS:
    raise ProtocolError(Code.UNKNOWN_KIND, str(h.kind))
  if h.length != len(frame):
    code = Code.TRUNCATED if h.length > len(frame) else Code.UNEXPECTED_SIZE
    raise ProtocolError(code, f"{len(frame)} bytes, header says {h.length}")
  return h


def decode(frame: layouts.Buffer, bounds: Bounds,
           recv: auth.Tagger | None = None,
           *, validate_rows: bool = False) -> Frame:
  """Decodes one frame; raises ProtocolError on any defect.

  bounds: the session's `Bounds` (HELLO_BOUNDS before a session).
  recv: the `auth.Tagger` the frame must verify with (None: not checked;
    tests and tools only). A frame that fails it is AUTH_FAILED and nothing
    after the header is read.
  validate_rows: validate a REPLY's rows with its q format (numpy) and
    raise the first refused row's code; `counts` is then set.
  """
  frame = memoryview(frame).cast("B")
  h = header(frame)
  if recv is not None and not auth.check(frame, recv):
    raise ProtocolError(Code.AUTH_FAILED, f"{Kind(h.kind).name} frame")
  kind = _KINDS[h.kind]
  # Plain ints below: an IntEnum compare costs a Python call.
  packed = h.kind == _PACKED_KIND
  if packed != bounds.packed and (packed or h.kind in _PER_FRAME):
    raise ProtocolError(Code.UNKNOWN_KIND, f"{kind.name} frame on a "
                        f"{'packed' if bounds.packed else 'per-frame'} "
                        "session")
  if packed:
    return _packed(h, frame, bounds, validate_rows)
  steps = h.kind == _PACKED_STEP_KIND
  if steps != bounds.packed_step and (steps or h.kind == _STEP_KIND):
    raise ProtocolError(Code.UNKNOWN_KIND, f"{kind.name} frame on a "
                        f"{'packed' if bounds.packed_step else 'per-frame'} "
                        "STEP session")
  if steps:
    return _packed_step(h, frame, bounds)
  spec = _FIXED.get(h.kind)
  if spec is not None:
    if h.length != spec.length:
      raise ProtocolError(Code.UNEXPECTED_SIZE, f"{kind.name} of {h.length} "
                          "bytes")
    return Frame(h, spec.body._make(spec.body_struct.unpack_from(
        frame, HEADER_BYTES)), frame)
  if kind == Kind.CONTEXT:
    return _context(h, frame, bounds)
  fixed = FIXED_BYTES[kind]
  if h.length < fixed:
    raise ProtocolError(Code.TRUNCATED, "REPLY body cut short")
  body = _body(kind, frame)
  fmt = _reply_format(body, bounds)
  if not 1 <= body.depth <= bounds.depth:
    raise ProtocolError(Code.ABSURD_LENGTH, f"REPLY of {body.depth} rows, "
                        f"bound {bounds.depth}")
  _check_width(body.width, bounds)
  if h.length != fixed + fmt.payload_bytes(body.depth, body.width):
    raise ProtocolError(Code.UNEXPECTED_SIZE, f"REPLY of {body.depth} x "
                        f"{body.width} in {h.length} bytes")
  if body.mass != fmt.mass:
    raise ProtocolError(Code.WRONG_MASS, f"declared mass {body.mass}")
  rows = fmt.rows(frame, fixed, body.depth, body.width)
  counts = None
  if validate_rows:
    verdict = fmt.validate(rows, vocab=bounds.vocab)
    bad = np.flatnonzero(verdict.codes)
    if bad.size:
      raise ProtocolError(int(verdict.codes[bad[0]]), f"row {bad[0]}")
    counts = verdict.counts
  return Frame(h, body, frame, rows, counts)


def _check_width(width: int, bounds: Bounds) -> None:
  """Rows must be the session's width: wider ones are absurd, narrower
  ones a size mismatch."""
  if width != bounds.width:
    code = (Code.ABSURD_LENGTH if width > bounds.width
            else Code.UNEXPECTED_SIZE)
    raise ProtocolError(code, f"rows of {width} entries, session "
                        f"{bounds.width}")


def _packed(h: layouts.Header, frame: memoryview, bounds: Bounds,
            validate_rows: bool) -> Frame:
  """A PACKED frame: REPLY's checks once for the batch (docs/wire.md)."""
  fixed = FIXED_BYTES[Kind.PACKED]
  if h.length < fixed:
    raise ProtocolError(Code.TRUNCATED, "PACKED body cut short")
  body = _body(Kind.PACKED, frame)
  fmt = _reply_format(body, bounds)
  if not 1 <= body.requests <= bounds.max_requests:
    raise ProtocolError(Code.ABSURD_LENGTH, f"PACKED of {body.requests} "
                        f"records, bound {bounds.max_requests}")
  # Depth 0: every record refused, no rows.
  if body.depth > bounds.depth:
    raise ProtocolError(Code.ABSURD_LENGTH, f"PACKED of {body.depth} rows "
                        f"a request, bound {bounds.depth}")
  _check_width(body.width, bounds)
  r, d = body.requests, body.depth
  if h.length != bounds.packed_bytes(r, d):
    raise ProtocolError(Code.UNEXPECTED_SIZE, f"PACKED of {r} x {d} x "
                        f"{body.width} in {h.length} bytes")
  if body.mass != fmt.mass:
    raise ProtocolError(Code.WRONG_MASS, f"declared mass {body.mass}")
  records = np.frombuffer(frame, layouts.PACKED_RECORD, r, fixed)
  rows = _batch_rows(fmt, frame, fixed + _RECORD_BYTES * r, r, d,
                     body.width)
  counts = None
  if validate_rows:
    ok = records["status"] == 0
    verdict = fmt.validate(select(rows, ok), vocab=bounds.vocab)
    # A record's rows are its first `depth` (fewer than the frame's on a
    # session that agreed on ADAPTIVE_DEPTH); the rest are no one's.
    live = np.arange(d) < records["depth"][ok][:, None]
    bad = np.argwhere(np.where(live, verdict.codes, 0))
    if bad.size:
      raise ProtocolError(int(verdict.codes[tuple(bad[0])]),
                          f"record row {bad[0]}")
    counts = verdict.counts
  return Frame(h, body, frame, rows, counts, records)


def _packed_step(h: layouts.Header, frame: memoryview,
                 bounds: Bounds) -> Frame:
  """A PACKED_STEP frame: its record count and size, then each record
  read as a STEP body (its fields' values are the worker's to judge, per
  record, as a STEP frame's)."""
  fixed = FIXED_BYTES[Kind.PACKED_STEP]
  if h.length < fixed:
    raise ProtocolError(Code.TRUNCATED, "PACKED_STEP body cut short")
  body = _body(Kind.PACKED_STEP, frame)
  r = body.requests
  if not 1 <= r <= bounds.max_requests:
    raise ProtocolError(Code.ABSURD_LENGTH, f"PACKED_STEP of {r} records, "
                        f"bound {bounds.max_requests}")
  if h.length != bounds.packed_step_bytes(r):
    raise ProtocolError(Code.UNEXPECTED_SIZE, f"PACKED_STEP of {r} records "
                        f"in {h.length} bytes")
  depth, policy, make = body.depth, body.policy, _STEP_BODY
  steps = tuple(
      Step(make(0, rid, depth, policy, last, 0, seed, anchor, version,
                digest), (generation, round_id))
      for rid, _, last, generation, round_id, seed, anchor, version, digest
      in _STEP_RECORD.iter_unpack(frame[fixed:]))
  return Frame(h, body, frame, steps=steps)


def _context(h: layouts.Header, frame: memoryview,
             bounds: Bounds) -> Frame:
  """A CONTEXT frame: count and size, then every token in [0, V)."""
  if not bounds.max_context:
    raise ProtocolError(Code.UNKNOWN_KIND, "CONTEXT frame on a session "
                        "without it")
  fixed = FIXED_BYTES[Kind.CONTEXT]
  if h.length < fixed:
    raise ProtocolError(Code.TRUNCATED, "CONTEXT body cut short")
  body = _body(Kind.CONTEXT, frame)
  if not 1 <= body.count <= bounds.max_context:
    raise ProtocolError(Code.ABSURD_LENGTH, f"CONTEXT of {body.count} "
                        f"tokens, bound {bounds.max_context}")
  if h.length != bounds.context_bytes(body.count):
    raise ProtocolError(Code.UNEXPECTED_SIZE, f"CONTEXT of {body.count} "
                        f"tokens in {h.length} bytes")
  tokens = np.frombuffer(frame, "<i4", body.count, fixed)
  if int(tokens.min()) < 0 or int(tokens.max()) >= bounds.vocab:
    raise ProtocolError(Code.TOKEN_OUT_OF_RANGE, f"CONTEXT token not in "
                        f"[0, {bounds.vocab})")
  return Frame(h, body, frame, tokens=tokens)


def _batch_rows(fmt: qformats.QFormat, buf: memoryview | bytearray,
                offset: int, requests: int, depth: int,
                width: int) -> qformats.Rows:
  """The q format's row views of R x D rows, shaped [R, D, ...]."""
  flat = fmt.rows(buf, offset, requests * depth, width)
  shape = (requests, depth)
  return qformats.Rows(
      flat.tokens.reshape(shape), flat.n.reshape(shape),
      None if flat.ids is None else flat.ids.reshape(shape + (width,)),
      None if flat.values is None else flat.values.reshape(shape + (width,)))


def select(rows: qformats.Rows,
           index: int | np.ndarray) -> qformats.Rows:
  """The rows of requests `index` of batch rows [R, D, ...]."""
  return qformats.Rows(rows.tokens[index], rows.n[index],
                       None if rows.ids is None else rows.ids[index],
                       None if rows.values is None else rows.values[index])


def _body(kind: Kind, frame: memoryview) -> layouts.Body:
  return layouts.BODY_TYPES[kind]._make(
      layouts.BODY_STRUCTS[kind].unpack_from(frame, HEADER_BYTES))


def _reply_format(body: layouts.Body, bounds: Bounds) -> qformats.QFormat:
  rep = _REPRESENTATIONS.get(body.representation)
  fmt = None if rep is None else qformats.get(rep)
  if rep is None or fmt is None:
    raise ProtocolError(Code.UNKNOWN_KIND, f"representation "
                        f"{body.representation}")
  if rep != bounds.representation:
    if not bounds.format.sampled:
      raise ProtocolError(Code.SAMPLED_ON_GREEDY, "q rows on a greedy "
                          "session")
    if not fmt.sampled:
      raise ProtocolError(Code.MISSING_Q, "tokens without their q")
    raise ProtocolError(Code.UNKNOWN_KIND, f"{rep.name} rows on a "
                        f"{Representation(bounds.representation).name} "
                        "session")
  return fmt


def _write_header(buf: bytearray | memoryview, kind: Kind, length: int,
                  session: int, generation: int, round_id: int) -> None:
  layouts.HEADER_STRUCT.pack_into(
      buf, 0, layouts.MAGIC, layouts.WIRE_VERSION, int(kind), length, 0,
      int(session), int(generation), int(round_id), _NO_TAG)


class _Fixed(typing.NamedTuple):
  """How `encode` writes one fixed-size kind: header and body in one
  struct, the body's fields in order with their defaults (zeros)."""
  kind: int
  length: int
  struct: struct.Struct        # HEADER_STRUCT's fields, then the body's
  defaults: dict[str, typing.Any]
  known: frozenset[str]
  body: typing.Any               # decode's: the body's type and struct
  body_struct: struct.Struct


_FIXED = {int(kind): _Fixed(
    int(kind), FIXED_BYTES[kind],
    struct.Struct(layouts.HEADER_STRUCT.format
                  + layouts.BODY_STRUCTS[kind].format.lstrip("<")),
    {name: b"" if typ is bytes else 0 for name, typ in
     layouts.BODY_TYPES[kind].__annotations__.items()},
    frozenset(layouts.BODY_TYPES[kind]._fields), layouts.BODY_TYPES[kind],
    layouts.BODY_STRUCTS[kind]) for kind in _FIXED_KINDS}
@typing.overload
def encode(kind: int, *, session: int, generation: int, round_id: int,
           body: dict[str, typing.Any] | None = None,
           send: auth.Tagger | None = None, out: None = None) -> bytes:
  ...


@typing.overload
def encode(kind: int, *, session: int, generation: int, round_id: int,
           body: dict[str, typing.Any] | None = None,
           send: auth.Tagger | None = None,
           out: bytearray | memoryview) -> memoryview:
  ...


def encode(kind: int, *, session: int, generation: int, round_id: int,
           body: dict[str, typing.Any] | None = None,
           send: auth.Tagger | None = None,
           out: bytearray | memoryview | None = None) -> bytes | memoryview:
  """One fixed-size frame (not REPLY, PACKED, CONTEXT, PACKED_STEP),
  sealed with `send`.

  body: dict of body fields (missing ones are zero). send: the
  `auth.Tagger` that seals it (None: tag left zero, tests only). out: a
  writable buffer to write into (its start); returns bytes without it.
  """
  spec = _FIXED.get(kind)
  if spec is None:
    kind = Kind(kind)         # ValueError for a value that is no kind
    maker = {Kind.CONTEXT: "encode_context",
             Kind.PACKED_STEP: "encode_packed_step"}.get(
                 kind, f"begin_{kind.name.lower()}")
    raise ValueError(f"encode: a {kind.name} is built with {maker}")
  length = spec.length
  buf: bytearray | memoryview = (
      bytearray(length) if out is None else memoryview(out).cast("B")[:length])
  if len(buf) < length:
    raise ValueError(f"encode: out holds {len(buf)} bytes, need {length}")
  fields = spec.defaults
  if body:
    if not spec.known.issuperset(body):
      raise ValueError(f"encode: {Kind(spec.kind).name} has no fields "
                       f"{sorted(body.keys() - spec.known)}")
    fields = {**fields, **body}     # the layout's order; zeros for the rest
  spec.struct.pack_into(buf, 0, layouts.MAGIC, layouts.WIRE_VERSION,
                        spec.kind, length, 0, int(session), int(generation),
                        int(round_id), _NO_TAG, *fields.values())
  if send is not None:
    auth.seal(buf, send)
  return bytes(buf) if out is None else memoryview(buf)


def begin_reply(out: bytearray | memoryview, *, bounds: Bounds, session: int,
                generation: int, round_id: int, request: int,
                depth: int) -> tuple[memoryview, qformats.Rows]:
  """Lays out a REPLY frame at the start of `out`; returns (frame, rows).

  The header and body are written; `rows` are writable views of the
  payload (tokens, n, ids, values) for the proposer to fill in place.
  Seal the frame with `auth.seal(frame, tagger)` once the rows are in.
  """
  fmt = bounds.format
  length = bounds.reply_bytes(depth)
  buf = _frame_space(out, length, "begin_reply")
  _write_header(buf, Kind.REPLY, length, session, generation, round_id)
  layouts.BODY_STRUCTS[Kind.REPLY].pack_into(
      buf, HEADER_BYTES, int(request), int(depth), int(fmt.representation),
      0, int(bounds.width), fmt.mass)
  return buf, fmt.rows(buf, FIXED_BYTES[Kind.REPLY], depth, bounds.width)


def encode_context(*, session: int, generation: int, round_id: int,
                   request: int, tokens: typing.Sequence[int] | np.ndarray,
                   send: auth.Tagger | None = None) -> bytes:
  """A CONTEXT frame of request `request`'s committed prefix `tokens`
  (tagged like its STEP: `generation`, `round_id`), sealed with `send`."""
  values = np.asarray(tokens, "<i4")
  length = FIXED_BYTES[Kind.CONTEXT] + values.nbytes
  buf = bytearray(length)
  _write_header(buf, Kind.CONTEXT, length, session, generation, round_id)
  layouts.BODY_STRUCTS[Kind.CONTEXT].pack_into(
      buf, HEADER_BYTES, int(request), 0, len(values))
  buf[FIXED_BYTES[Kind.CONTEXT]:] = values.tobytes()
  if send is not None:
    auth.seal(buf, send)
  return bytes(buf)


def encode_packed_step(*, session: int, depth: int, policy: int,
                       records: typing.Sequence[tuple],
                       send: auth.Tagger | None = None) -> bytes:
  """A PACKED_STEP frame of a batch's STEPs, sealed with `send`.

  records: per request, in order, the `layouts.STEP_RECORD` fields
  (request, reserved, last_token, generation, round, seed, anchor,
  context_version, prefix_digest); the header carries the first one's tag
  (generation, round). depth, policy: every request's.
  """
  r = len(records)
  if r < 1:
    raise ValueError("encode_packed_step: no records")
  fixed = FIXED_BYTES[Kind.PACKED_STEP]
  length = fixed + _STEP_RECORD_BYTES * r
  buf = bytearray(length)
  first = records[0]
  _write_header(buf, Kind.PACKED_STEP, length, session, first[3], first[4])
  layouts.BODY_STRUCTS[Kind.PACKED_STEP].pack_into(
      buf, HEADER_BYTES, r, int(depth), int(policy), 0)
  pack, offset = _STEP_RECORD.pack_into, fixed
  for record in records:
    pack(buf, offset, *record)
    offset += _STEP_RECORD_BYTES
  if send is not None:
    auth.seal(buf, send)
  return bytes(buf)


def _frame_space(out: bytearray | memoryview, length: int,
                 caller: str) -> memoryview:
  """The first `length` bytes of `out` as a byte view (ValueError naming
  `caller` if `out` is shorter)."""
  buf = memoryview(out).cast("B")
  if len(buf) < length:
    raise ValueError(f"{caller}: out holds {len(buf)} bytes, need {length}")
  return buf[:length]


class Packed(typing.NamedTuple):
  """A PACKED frame being built (`begin_packed`): the frame, its record
  table (a writable PACKED_RECORD[R] view) and its rows [R, D, ...]."""
  frame: memoryview
  records: np.ndarray
  rows: qformats.Rows


def packed_layout(out: bytearray | memoryview, *, bounds: Bounds,
                  requests: int, depth: int) -> Packed:
  """Views of a PACKED frame of `requests` records of `depth` rows at the
  start of `out` (nothing is written): the frame, its records and rows.

  A sender that answers batches of the same shape from the same buffer
  keeps these views and writes only what changes (`write_packed`).
  """
  length = bounds.packed_bytes(requests, depth)
  buf = _frame_space(out, length, "packed_layout")
  fixed = FIXED_BYTES[Kind.PACKED]
  records = np.frombuffer(buf, layouts.PACKED_RECORD, requests, fixed)
  rows = _batch_rows(bounds.format, buf, fixed + _RECORD_BYTES * requests,
                     requests, depth, bounds.width)
  return Packed(buf, records, rows)


def write_packed(packed: Packed, *, bounds: Bounds, session: int,
                 generation: int, round_id: int) -> None:
  """Writes the header (tag `generation`, `round_id`: the first record's)
  and body of a laid-out PACKED frame (`packed_layout`)."""
  fmt = bounds.format
  requests, depth = packed.rows.tokens.shape
  _write_header(packed.frame, Kind.PACKED, len(packed.frame), session,
                generation, round_id)
  _PACKED_BODY.pack_into(packed.frame, HEADER_BYTES, int(requests),
                         int(depth), int(fmt.representation), 0,
                         int(bounds.width), fmt.mass)


def begin_packed(out: bytearray | memoryview, *, bounds: Bounds,
                 session: int, generation: int, round_id: int,
                 requests: int, depth: int) -> Packed:
  """Lays out a PACKED frame of `requests` records at the start of `out`.

  The header (with the first record's tag: `generation`, `round_id`) and
  body are written; fill the records and rows in place, then seal the
  frame with `auth.seal(frame, tagger)`.
  """
  packed = packed_layout(out, bounds=bounds, requests=requests, depth=depth)
  write_packed(packed, bounds=bounds, session=session,
               generation=generation, round_id=round_id)
  return packed


def peek(frame: layouts.Buffer) -> tuple[int, int, int, int] | None:
  """(kind, session, generation, round) of a frame, unchecked, or None.

  For routing and records only (tools, the test proxy); nothing read here
  may be used before `decode` accepts the frame.
  """
  buf = memoryview(frame).cast("B")
  if len(buf) < HEADER_BYTES:
    return None
  h = layouts.HEADER_STRUCT.unpack_from(buf)
  return h[2], h[5], h[6], h[7]
