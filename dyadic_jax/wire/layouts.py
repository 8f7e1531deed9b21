"""Wire v3 byte layouts: fixed little-endian structs.

Every frame starts with the same 48-byte header; the kind fixes the body
struct; a REPLY carries the D rows of one request after its body, laid out
by its q format (`dyadic_jax.wire.qformats`). All offsets and sizes are in
docs/wire.md (generated from these dtypes by `describe`, checked by a test).

    offset  field        type   meaning
    0       magic        4s     b"DQ24"
    4       version      u16    wire version (3)
    6       kind         u16    Kind
    8       length       u32    total frame bytes, header included
    12      reserved     u32    zero (covered by the tag); a GMAC-tagged
                                PACKED frame's sealer counter (wire.auth)
    16      session      u64    session id
    24      generation   u32    generation (reset / reconnect bump it)
    28      round        u32    round id within the generation
    32      tag          16s    keyed BLAKE3 MAC of the frame (or CRC32C)

The tag covers every byte of the frame but itself: bytes [0, 32) and
[48, length) (`dyadic_jax.wire.auth`). A PACKED frame (negotiated in
HELLO, `Feature.PACKED_REPLY`) is a whole batch's answer: its body, R
records, then tokens int32[R, D], n int32[R, D] and the q format's
[R, D, w] arrays, under one tag. A PACKED_STEP frame (`Feature.PACKED_STEP`)
is the same in the other direction, a whole batch's STEP: its body, then R
STEP records, under one tag. A CONTEXT frame (`Feature.CONTEXT`)
is a request's committed prefix: its body, then int32[n] tokens. Version
3 keeps the v2 message set
and semantics; the v1 greedy mode is a HELLO mode (`Mode.GREEDY`), not a
header version.

The numpy dtypes below are the layout's one definition; the `struct`
formats the codec reads and writes with are derived from them.
"""

import enum
import struct
import typing

import numpy as np

MAGIC = b"DQ24"
WIRE_VERSION = 3
TAG_OFFSET = 32
TAG_BYTES = 16
NONCE_BYTES = 32

# What a frame or message arrives as: bytes, a bytearray being built, or a
# memoryview onto a ZeroMQ buffer.
Buffer: typing.TypeAlias = bytes | bytearray | memoryview


class Mode(enum.IntEnum):
  """What a session carries (HELLO `mode`)."""
  GREEDY = 1     # the v1 greedy mode: token ids only, never q
  SAMPLED = 2    # the v2 sampled mode: every drafted token with its q


class Kind(enum.IntEnum):
  HELLO = 1
  STEP = 2
  REPLY = 3
  COMPLETION = 4
  COMMIT = 5
  RESET = 6
  PACKED = 7     # every request's answer in one frame (Feature.PACKED_REPLY)
  CONTEXT = 8    # a request's committed prefix (Feature.CONTEXT)
  PACKED_STEP = 9  # every request's STEP in one frame (Feature.PACKED_STEP)


class Feature(enum.IntFlag):
  """HELLO `features`: optional forms a side offers (the verifier) or
  accepts of that offer (the worker's answer). A session uses what the
  answer holds; 0 is the v3 per-frame protocol."""
  PACKED_REPLY = 1   # the worker answers a batch with one PACKED frame
  CONTEXT = 2        # the verifier sends a request's committed prefix
  GMAC = 4           # PACKED frames tagged with AES-256-GMAC (wire.auth)
  PACKED_STEP = 8    # the verifier sends a batch's STEPs as one frame
  ADAPTIVE_DEPTH = 16  # an answer may carry 1..D rows (a short REPLY)


class Representation(enum.IntEnum):
  TOKEN = 0    # greedy: the tokens alone, no q
  DENSE = 1    # float32 q[D, V]
  SPARSE = 2   # int32 ids[D, k], then float32 q[D, k]


class Reason(enum.IntEnum):
  """RESET `reason`."""
  CANCEL = 1     # the verifier dropped the request's speculative state
  REMOVE = 2     # the verifier removed the request: forget it
  REFUSED = 3    # the worker refused (`code` says why: a `Code`)


class Policy(enum.IntEnum):
  """STEP `policy`: how the worker proposes."""
  GREEDY = 0     # argmax tokens (Mode.GREEDY sessions only)
  SAMPLED = 1    # dyadic q rows and PROPOSAL-key draws


HEADER = np.dtype([
    ("magic", "S4"), ("version", "<u2"), ("kind", "<u2"), ("length", "<u4"),
    ("reserved", "<u4"), ("session", "<u8"), ("generation", "<u4"),
    ("round", "<u4"), ("tag", "S16")])

ALL_REQUESTS = 0xFFFF  # RESET `request` value: every request of the session

BODIES = {
    Kind.HELLO: np.dtype([
        ("mode", "<u2"),             # Mode
        ("precision", "<u2"),        # 1: float32 q on the 2^-24 grid
        ("rng_abi", "<u2"),          # key schedule version (dyadic_jax.rng)
        ("max_slots", "<u2"),
        ("vocab", "<u4"),
        ("max_depth", "<u2"),
        ("representation", "<u2"),   # Representation the worker sends
        ("max_support", "<u4"),      # k for sparse rows, V dense, 0 greedy
        ("max_requests", "<u2"),     # requests per batch slot
        ("shards", "<u2"),           # vocabulary shards of q (rank links)
        ("max_reply_bytes", "<u8"),  # bound on one round's reply message
        ("nonce", "S32"),            # fresh per HELLO (session key input)
        ("semantic_id", "S32"),      # "dyadic24-standard-v1"
        ("verifier_id", "S32"),
        ("id_map_hash", "S32"),      # hash of the global token id map
        ("draft_id", "S32"),         # draft checkpoint identity
        ("target_id", "S32"),        # target identity
        ("shard", "<u2"),            # this link's shard, in [0, shards)
        ("features", "<u2"),         # Feature bits (not compared: agreed)
        ("shard_lo", "<u4"),         # its global ids [shard_lo, shard_hi)
        ("shard_hi", "<u4")]),
    Kind.STEP: np.dtype([
        ("slot", "<u2"), ("request", "<u2"), ("depth", "<u2"),
        ("policy", "<u2"),           # Policy
        ("last_token", "<i4"),       # committed token before the anchor
        ("reserved", "<u4"),
        ("seed", "<u8"),             # request seed of the RNG schedule
        ("anchor", "<u8"),           # absolute position of x_1
        ("context_version", "<u8"),  # target processor/grammar/stop context
        ("prefix_digest", "S32")]),  # digest of the committed prefix
    Kind.REPLY: np.dtype([
        ("request", "<u2"),
        ("depth", "<u2"),            # rows D
        ("representation", "<u2"),
        ("reserved", "<u2"),
        ("width", "<u4"),            # entries per row: V, k or 0
        ("mass", "<u4")]),           # probability checksum: 2^24 (0 greedy)
    Kind.COMPLETION: np.dtype([
        ("request", "<u2"), ("depth", "<u2"),
        ("status", "<u2"),           # 0 OK, else the worker's refusal Code
        ("reserved", "<u2"),
        ("reply_bytes", "<u8"),      # exact size of the REPLY frame (0: none)
        ("anchor", "<u8"), ("context_version", "<u8"),
        ("reply_tag", "S16")]),      # the REPLY frame's tag
    Kind.COMMIT: np.dtype([
        ("request", "<u2"), ("accepted", "<u2"),
        ("status", "<u2"),           # 0 verified, else the Code that failed
        ("fallback", "<u2"),         # 1: target-only token, proposal dropped
        ("next_token", "<i4"),       # correction, bonus or target-only id
        ("reserved", "<u4"),
        ("new_position", "<u8")]),
    Kind.RESET: np.dtype([("request", "<u2"), ("reason", "<u2"),
                          ("code", "<u2"), ("reserved", "<u2")]),
    # Then `requests` PACKED_RECORDs and the rows of all of them.
    Kind.PACKED: np.dtype([
        ("requests", "<u2"),         # records R
        ("depth", "<u2"),            # rows D of every answered request
        ("representation", "<u2"),
        ("reserved", "<u2"),
        ("width", "<u4"),            # entries per row: V, k or 0
        ("mass", "<u4")]),           # 2^24 (0 greedy), as a REPLY's
    # Then int32[count] tokens: the request's committed prefix, prompt
    # first (a STEP message, before that request's STEP, same tags).
    Kind.CONTEXT: np.dtype([
        ("request", "<u2"),
        ("reserved", "<u2"),
        ("count", "<u4")]),          # tokens n, in [1, max_context]
    # Then `requests` STEP_RECORDs: a batch's STEPs (verifier -> worker).
    Kind.PACKED_STEP: np.dtype([
        ("requests", "<u2"),         # records R
        ("depth", "<u2"),            # rows D asked of every request
        ("policy", "<u2"),           # Policy
        ("reserved", "<u2")]),
}

# One request's answer in a PACKED frame (a COMPLETION without the REPLY
# binding: one tag covers the whole frame). Its rows are row r of the
# frame's [R, D, ...] arrays, read only when status is 0.
PACKED_RECORD = np.dtype([
    ("request", "<u2"),
    ("depth", "<u2"),                # D if status is 0, else 0
    ("status", "<u2"),               # 0 OK, else the worker's refusal Code
    ("reserved", "<u2"),
    ("generation", "<u4"), ("round", "<u4"),   # the request's STEP tag
    ("anchor", "<u8"), ("context_version", "<u8")])

# One request's STEP in a PACKED_STEP frame: a STEP body's per-request
# fields and its tag (depth and policy are the frame's; one tag covers the
# whole frame).
STEP_RECORD = np.dtype([
    ("request", "<u2"),
    ("reserved", "<u2"),
    ("last_token", "<i4"),           # committed token before the anchor
    ("generation", "<u4"), ("round", "<u4"),   # the request's STEP tag
    ("seed", "<u8"),                 # request seed of the RNG schedule
    ("anchor", "<u8"),               # absolute position of x_1
    ("context_version", "<u8"),
    ("prefix_digest", "S32")])

HEADER_BYTES = HEADER.itemsize
assert HEADER_BYTES == TAG_OFFSET + TAG_BYTES


def _fields(dtype: np.dtype) -> list[tuple[str, np.dtype]]:
  """[(name, numpy dtype)] of a structured dtype."""
  fields = typing.cast(typing.Mapping[str, tuple], dtype.fields)
  return [(name, fields[name][0]) for name in typing.cast(tuple,
                                                          dtype.names)]


def _struct_of(dtype: np.dtype) -> struct.Struct:
  codes = {"u1": "B", "u2": "H", "u4": "I", "u8": "Q", "i4": "i"}
  parts = []
  for _, sub in _fields(dtype):
    if sub.kind == "S":
      parts.append(f"{sub.itemsize}s")
    else:
      parts.append(codes[sub.str.lstrip("<|")])
  fmt = struct.Struct("<" + "".join(parts))
  assert fmt.size == dtype.itemsize, dtype
  return fmt


HEADER_STRUCT = _struct_of(HEADER)
BODY_STRUCTS = {kind: _struct_of(dtype) for kind, dtype in BODIES.items()}
RECORD_STRUCT = _struct_of(PACKED_RECORD)
STEP_RECORD_STRUCT = _struct_of(STEP_RECORD)


class Header(typing.NamedTuple):
  magic: bytes
  version: int
  kind: int
  length: int
  reserved: int
  session: int
  generation: int
  round: int
  tag: bytes


BODY_TYPES = {kind: typing.NamedTuple(  # type: ignore[misc]
    f"{kind.name.title()}Body",
    [(name, bytes if sub.kind == "S" else int)
     for name, sub in _fields(dtype)]) for kind, dtype in BODIES.items()}

# A decoded body: one of BODY_TYPES, made at import from the layouts above,
# so its fields have no static type.
Body: typing.TypeAlias = typing.Any

FIXED_BYTES = {kind: HEADER_BYTES + dtype.itemsize
               for kind, dtype in BODIES.items()}


def describe() -> str:
  """Markdown tables of every layout (docs/wire.md embeds this text)."""
  def table(title: str, dtype: np.dtype, base: int) -> str:
    rows = [f"### {title} ({dtype.itemsize} bytes)", "",
            "| offset | field | type |", "|---:|---|---|"]
    fields = typing.cast(typing.Mapping[str, tuple], dtype.fields)
    for name in typing.cast(tuple, dtype.names):
      sub, offset = fields[name][:2]
      rows.append(f"| {base + offset} | {name} | {sub.str.lstrip('<|')} |")
    return "\n".join(rows)

  parts = [table("Header", HEADER, 0)]
  for kind, dtype in BODIES.items():
    parts.append(table(f"{kind.name} body", dtype, HEADER_BYTES))
  parts.append(table("PACKED record r, at 64 + 32 r: offsets within it",
                     PACKED_RECORD, 0))
  parts.append(table("PACKED_STEP record r, at 56 + 72 r: offsets within it",
                     STEP_RECORD, 0))
  return "\n\n".join(parts) + "\n"
