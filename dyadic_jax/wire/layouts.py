"""Wire v2 byte layouts: fixed little-endian structs, numpy dtypes.

Every frame starts with the same 32-byte header; the kind fixes the body
struct; a REPLY carries one q row after its body. All offsets and sizes
are in docs/wire.md (generated from these dtypes by its test).

    offset  field        type   meaning
    0       magic        4s     b"DQ24"
    4       version      u16    wire version (2; 1 = greedy, never carries q)
    6       kind         u16    Kind
    8       length       u32    total frame bytes, header included
    12      crc          u32    CRC32C of bytes [16, length)
    16      session      u64    session id
    24      generation   u32    generation (reset / reconnect bump it)
    28      round        u32    round id within the generation
"""

import enum

import numpy as np

MAGIC = b"DQ24"
WIRE_VERSION = 2
GREEDY_VERSION = 1
CRC_OFFSET = 12
CRC_COVERS_FROM = 16


class Kind(enum.IntEnum):
  HELLO = 1
  STEP = 2
  REPLY = 3
  COMPLETION = 4
  COMMIT = 5
  RESET = 6


class Representation(enum.IntEnum):
  TOKEN = 0    # v1 greedy: the token alone, no q (never on a sampled session)
  DENSE = 1    # float32 q[V]
  SPARSE = 2   # int32 ids[n], then float32 q[n]


HEADER = np.dtype([
    ("magic", "S4"), ("version", "<u2"), ("kind", "<u2"), ("length", "<u4"),
    ("crc", "<u4"), ("session", "<u8"), ("generation", "<u4"),
    ("round", "<u4")])

ALL_REQUESTS = 0xFFFF  # RESET `request` value: every request of the session

BODIES = {
    Kind.HELLO: np.dtype([
        ("mode", "<u2"),             # WIRE_VERSION (sampled) or GREEDY
        ("precision", "<u2"),        # 1: float32 q on the 2^-24 grid
        ("rng_abi", "<u2"),          # key schedule version (dyadic_jax.rng)
        ("max_slots", "<u2"),
        ("vocab", "<u4"),
        ("max_depth", "<u2"),
        ("representation", "<u2"),   # Representation the worker sends
        ("max_support", "<u4"),      # k for sparse rows, V for dense
        ("max_requests", "<u2"),     # requests per batch slot
        ("reserved", "<u2"),
        ("max_reply_bytes", "<u8"),  # bound on one round's reply bytes
        ("semantic_id", "S32"),      # "dyadic24-standard-v1"
        ("verifier_id", "S32"),
        ("id_map_hash", "S32"),      # hash of the global token id map
        ("draft_id", "S32"),         # draft checkpoint identity
        ("target_id", "S32")]),      # target identity
    Kind.STEP: np.dtype([
        ("slot", "<u2"), ("request", "<u2"), ("depth", "<u2"),
        ("policy", "<u2"),           # proposal temperature/support policy
        ("last_token", "<i4"),       # committed token before the anchor
        ("reserved", "<u4"),
        ("seed", "<u8"),             # request seed of the RNG schedule
        ("anchor", "<u8"),           # absolute position of x_1
        ("context_version", "<u8"),  # target processor/grammar/stop context
        ("prefix_digest", "S32")]),  # digest of the committed prefix
    Kind.REPLY: np.dtype([
        ("request", "<u2"),
        ("position", "u1"),          # i in [0, depth)
        ("representation", "u1"),
        ("count", "<u4"),            # entries: V (dense) or n (sparse)
        ("token", "<i4"),            # the sampled global id
        ("mass", "<u4")]),           # probability checksum: sum of counts
    Kind.COMPLETION: np.dtype([
        ("request", "<u2"), ("depth", "<u2"),
        ("status", "<u2"),           # 0 OK, else the worker's refusal Code
        ("reserved", "<u2"),
        ("replies_crc", "<u4"),      # CRC32C of the D reply frames, in order
        ("reserved2", "<u4"),
        ("reply_bytes", "<u8"),      # exact total bytes of those frames
        ("anchor", "<u8"), ("context_version", "<u8")]),
    Kind.COMMIT: np.dtype([
        ("request", "<u2"), ("accepted", "<u2"),
        ("status", "<u2"),           # 0 verified, else the Code that failed
        ("fallback", "<u2"),         # 1: target-only token, proposal dropped
        ("next_token", "<i4"),       # correction, bonus or target-only id
        ("reserved", "<u4"),
        ("new_position", "<u8")]),
    Kind.RESET: np.dtype([("request", "<u2"), ("reason", "<u2"),
                          ("reserved", "<u4")]),
}


def reply_payload_bytes(representation, count):
  """Bytes after a REPLY body: q values (and ids when sparse)."""
  if representation == Representation.TOKEN:
    return 0
  per = 8 if representation == Representation.SPARSE else 4
  return per * int(count)


def frame_bytes(kind, count=0, representation=Representation.DENSE):
  """Exact size of a frame of `kind` (REPLY: with `count` entries)."""
  size = HEADER.itemsize + BODIES[Kind(kind)].itemsize
  if kind == Kind.REPLY:
    size += reply_payload_bytes(representation, count)
  return size


def describe():
  """Markdown tables of every layout (docs/wire.md embeds this text)."""
  def table(title, dtype, base):
    rows = [f"### {title} ({dtype.itemsize} bytes)", "",
            "| offset | field | type |", "|---:|---|---|"]
    for name in dtype.names:
      sub, offset = dtype.fields[name][:2]
      rows.append(f"| {base + offset} | {name} | {sub.str.lstrip('<|')} |")
    return "\n".join(rows)

  parts = [table("Header", HEADER, 0)]
  for kind, dtype in BODIES.items():
    parts.append(table(f"{kind.name} body", dtype, HEADER.itemsize))
  return "\n\n".join(parts) + "\n"
