"""Encode and decode wire v2 frames through numpy views, bounds first.

`decode` reads nothing beyond what the header and the negotiated `Bounds`
allow, in this order: header size, magic, version, kind, declared length
against the bounds and the buffer, CRC32C, then the body and (REPLY) the q
row, which `validate_q_row` checks before anything can use it. Payload
arrays are views into the received buffer (no per-element Python loop, no
copy); encode writes the row's bytes once into the frame.
"""

import functools
import typing

import crc32c
import numpy as np

from dyadic_jax.wire import layouts
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import (CRC_COVERS_FROM, HEADER, Kind,
                                     Representation)
from dyadic_jax.wire.validate import validate_q_row


class Bounds(typing.NamedTuple):
  """What a session negotiated (HELLO); checked before any allocation.

  greedy: a v1 session: REPLY rows carry the token alone (TOKEN), and any
  row with q is refused as SAMPLED_ON_GREEDY; on a sampled (v2) session a
  TOKEN row is refused as MISSING_Q (never sampled ids without their q).
  """
  vocab: int
  max_support: int        # largest sparse n (== vocab when dense rows)
  max_depth: int
  versions: tuple = (layouts.WIRE_VERSION,)
  greedy: bool = False

  @property
  def max_frame(self):
    return _max_frame(self.vocab, self.max_support)


@functools.lru_cache(maxsize=64)
def _max_frame(vocab, max_support):
  # Read on every decode: computed once per session's bounds.
  return max(layouts.frame_bytes(Kind.REPLY, vocab),
             layouts.frame_bytes(Kind.REPLY, max_support,
                                 Representation.SPARSE),
             max(layouts.frame_bytes(k) for k in Kind if k != Kind.REPLY))


class Frame(typing.NamedTuple):
  """A decoded frame: header and body as numpy records, and the q row."""
  header: np.void
  body: np.void
  values: np.ndarray | None = None   # float32 q (REPLY only)
  ids: np.ndarray | None = None      # int32 ids (sparse REPLY only)
  counts: np.ndarray | None = None   # validated int32 counts (REPLY only)


def checksum(buf):
  """CRC32C (Castagnoli) of a bytes-like object."""
  return crc32c.crc32c(buf)


_POLY = 0x82F63B78       # CRC32C, reflected
_COMBINE_FROM = 1 << 16  # smaller frames are cheaper to read than to combine


def _mulmod(a, b):
  """a * b modulo the CRC32C polynomial over GF(2), reflected bits."""
  m, p = 1 << 31, 0
  while True:
    if a & m:
      p ^= b
      if not a & (m - 1):
        return p
    m >>= 1
    b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]         # x^(2^n) mod P, n = 0..63
for _ in range(63):
  _X2N.append(_mulmod(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=256)
def _x8n(n):
  """x^(8 n) mod P: shifts a CRC over n zero bytes."""
  p, k = 1 << 31, 3
  while n:
    if n & 1:
      p = _mulmod(_X2N[k & 63], p)
    n, k = n >> 1, k + 1
  return p


def crc_combine(crc_a, crc_b, len_b):
  """CRC32C of A + B from crc(A), crc(B) and len(B), without reading B."""
  return _mulmod(_x8n(len_b), crc_a) ^ crc_b


def frame_crc(frame, crc=0):
  """crc32c.crc32c(frame, crc) of a frame whose header CRC is known good.

  For a frame just encoded, or one `decode` accepted: the header's CRC
  covers bytes [16, length), so only the first 16 bytes are read and the
  rest is combined in (large frames; small ones are read, which is faster).
  """
  n = len(frame)
  if n < _COMBINE_FROM:
    return crc32c.crc32c(frame, crc)
  head = crc32c.crc32c(memoryview(frame)[:CRC_COVERS_FROM], crc)
  stored = int.from_bytes(memoryview(frame)[12:16], "little")
  return crc_combine(head, stored, n - CRC_COVERS_FROM)


def encode(kind, *, session, generation, round_id, body=None, values=None,
           ids=None, version=layouts.WIRE_VERSION, out=None):
  """One frame. body: dict of body fields; REPLY: values (+ ids), or neither
  for a v1 TOKEN row.

  Returns bytes, or, with `out` (a writable buffer of at least the frame's
  size, e.g. a preallocated staging buffer), a memoryview of the frame
  written at its start: the payload is copied exactly once.
  """
  kind = Kind(kind)
  body_dtype = layouts.BODIES[kind]
  payload = []
  fields = dict(body or {})
  if kind == Kind.REPLY:
    if values is None:
      representation = Representation.TOKEN
    else:
      values = np.ascontiguousarray(values, np.float32)
      representation = (Representation.DENSE if ids is None
                        else Representation.SPARSE)
      if ids is not None:
        payload.append(np.ascontiguousarray(ids, np.int32))
      payload.append(values)
    fields.setdefault("representation", representation)
    fields.setdefault("count", 0 if values is None else len(values))
  length = HEADER.itemsize + body_dtype.itemsize + sum(p.nbytes for p in
                                                      payload)
  if out is None:
    buf = bytearray(length)
  else:
    buf = memoryview(out).cast("B")
    if len(buf) < length:
      raise ValueError(f"encode: out holds {len(buf)} bytes, frame needs "
                       f"{length}")
    buf = buf[:length]
  header = np.frombuffer(buf, HEADER, count=1)
  header["magic"], header["version"], header["kind"] = (layouts.MAGIC,
                                                        version, kind)
  header["length"], header["session"] = length, session
  header["generation"], header["round"] = generation, round_id
  rec = np.frombuffer(buf, body_dtype, count=1, offset=HEADER.itemsize)
  for name, value in fields.items():
    rec[name] = value
  offset = HEADER.itemsize + body_dtype.itemsize
  for p in payload:
    np.frombuffer(buf, np.uint8, p.nbytes, offset)[:] = p.reshape(-1).view(
        np.uint8)
    offset += p.nbytes
  header["crc"] = checksum(memoryview(buf)[CRC_COVERS_FROM:])
  return bytes(buf) if out is None else buf


def _header(buf, bounds):
  if len(buf) < HEADER.itemsize:
    raise ProtocolError(Code.TRUNCATED, f"{len(buf)} bytes, header needs "
                        f"{HEADER.itemsize}")
  header = np.frombuffer(buf, HEADER, count=1)[0]
  if header["magic"] != layouts.MAGIC:
    raise ProtocolError(Code.BAD_MAGIC, repr(bytes(header["magic"])))
  if int(header["version"]) not in bounds.versions:
    raise ProtocolError(Code.UNSUPPORTED_VERSION, str(int(header["version"])))
  try:
    kind = Kind(int(header["kind"]))
  except ValueError:
    raise ProtocolError(Code.UNKNOWN_KIND, str(int(header["kind"]))) from None
  length = int(header["length"])
  if length > bounds.max_frame:
    raise ProtocolError(Code.ABSURD_LENGTH, f"declared {length} bytes, bound "
                        f"{bounds.max_frame}")
  if len(buf) < length:
    raise ProtocolError(Code.TRUNCATED, f"{len(buf)} of {length} bytes")
  if len(buf) != length:
    raise ProtocolError(Code.UNEXPECTED_SIZE, f"{len(buf)} bytes, header "
                        f"says {length}")
  if checksum(memoryview(buf)[CRC_COVERS_FROM:]) != int(header["crc"]):
    raise ProtocolError(Code.CHECKSUM_MISMATCH, "CRC32C")
  return header, kind, length


def peek(buf):
  """(kind, session, generation, round) of a frame, unchecked, or None.

  For routing only (which exchange a frame claims to belong to); nothing
  read here may be used before `decode` accepts the frame.
  """
  buf = memoryview(buf).cast("B")
  if len(buf) < HEADER.itemsize:
    return None
  h = np.frombuffer(buf, HEADER, count=1)[0]
  return (int(h["kind"]), int(h["session"]), int(h["generation"]),
          int(h["round"]))


def decode(buf, bounds, *, validate_rows=True):
  """Decodes and validates one frame; raises ProtocolError on any defect.

  A REPLY's q row is validated (`validate_q_row`) against the session's
  vocabulary and the frame's token; its declared mass must be 2^24. With
  validate_rows=False the row's framing is checked but not its values:
  `counts` is None and the caller must validate the row (the bridge does
  it for a whole dense batch at once) before any use.
  """
  buf = memoryview(buf).cast("B")
  header, kind, length = _header(buf, bounds)
  body_dtype = layouts.BODIES[kind]
  start = HEADER.itemsize
  if kind != Kind.REPLY and length != start + body_dtype.itemsize:
    raise ProtocolError(Code.UNEXPECTED_SIZE, f"{kind.name} of {length} "
                        "bytes")
  if length < start + body_dtype.itemsize:
    raise ProtocolError(Code.TRUNCATED, f"{kind.name} body cut short")
  body = np.frombuffer(buf, body_dtype, count=1, offset=start)[0]
  if kind != Kind.REPLY:
    return Frame(header, body)
  return _reply(buf, header, body, start + body_dtype.itemsize, length,
                bounds, validate_rows)


def _reply(buf, header, body, offset, length, bounds, validate_rows):
  try:
    representation = Representation(int(body["representation"]))
  except ValueError:
    raise ProtocolError(Code.UNKNOWN_KIND, "representation "
                        f"{int(body['representation'])}") from None
  if bounds.greedy != (representation == Representation.TOKEN):
    if bounds.greedy:
      raise ProtocolError(Code.SAMPLED_ON_GREEDY, "a q row on a v1 session")
    raise ProtocolError(Code.MISSING_Q, "a token without its q")
  if int(body["position"]) >= bounds.max_depth:
    raise ProtocolError(Code.ABSURD_LENGTH, f"position "
                        f"{int(body['position'])} of depth {bounds.max_depth}")
  if representation == Representation.TOKEN:
    token = int(body["token"])
    if int(body["count"]) or length != offset:
      raise ProtocolError(Code.UNEXPECTED_SIZE, "v1 row with a payload")
    if not 0 <= token < bounds.vocab:
      raise ProtocolError(Code.TOKEN_OUT_OF_RANGE, str(token))
    return Frame(header, body)
  count = int(body["count"])
  limit = bounds.vocab if representation == Representation.DENSE else (
      bounds.max_support)
  if count > limit:
    raise ProtocolError(Code.ABSURD_LENGTH, f"{count} entries, bound {limit}")
  if length != offset + layouts.reply_payload_bytes(representation, count):
    raise ProtocolError(Code.UNEXPECTED_SIZE, f"REPLY of {count} entries in "
                        f"{length} bytes")
  ids = None
  if representation == Representation.SPARSE:
    ids = np.frombuffer(buf, np.dtype("<i4"), count=count, offset=offset)
    offset += 4 * count
  values = np.frombuffer(buf, np.dtype("<f4"), count=count, offset=offset)
  if int(body["mass"]) != 1 << 24:
    raise ProtocolError(Code.WRONG_MASS, f"declared mass {int(body['mass'])}")
  if not validate_rows:
    return Frame(header, body, values, ids)
  counts = validate_q_row(values, ids, vocab_size=bounds.vocab,
                          token=int(body["token"]))
  return Frame(header, body, values, ids, counts)
