"""HELLO: what each side is, and the bounds every buffer is sized from.

Both sides send their `Capabilities`; a session opens only when every
field is equal (no auto-upgrade, no fallback to a default, nothing enabled
by an environment variable). Nothing is allocated before that: slots are
sized from the agreed capabilities afterwards.
"""

import dataclasses
import functools
import hashlib

import numpy as np

from dyadic_jax.constants import DEFAULT_VOCAB, SEMANTIC_ID
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import Kind, Representation

RNG_ABI = 1      # dyadic_jax.rng: seed -> generation -> round -> position ...
PRECISION = 1    # float32 q on the 2^-24 grid
VERIFIER_ID = "standard-speculative-v1"


def identity_map_hash(vocab):
  """Hash of the identity global id map 0..V-1 (a shared tokenizer)."""
  return hashlib.sha256(np.arange(vocab, dtype="<i4").tobytes()).hexdigest(
  )[:32]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
  """One side's HELLO. Equal capabilities on both sides open a session.

  Attributes:
    mode: layouts.WIRE_VERSION (sampled, q on the wire) or GREEDY_VERSION
      (v1: token ids only, point-mass verification, never q).
    vocab: V; any V in [2, 2^21].
    max_depth: D, drafted positions per request and round.
    max_requests: requests per batch slot.
    max_slots: batch slots in flight.
    representation: Representation of the q rows (DENSE or SPARSE).
    max_support: k of sparse rows (V when dense).
    draft_id, target_id: checkpoint identities.
    id_map_hash: hash of the global token id map (default: identity).
  """
  mode: int = layouts.WIRE_VERSION
  vocab: int = DEFAULT_VOCAB
  max_depth: int = 5
  max_requests: int = 4
  max_slots: int = 2
  representation: Representation = Representation.SPARSE
  max_support: int = 32
  draft_id: str = "toy-draft"
  target_id: str = "toy-target"
  id_map_hash: str = ""
  semantic_id: str = SEMANTIC_ID
  verifier_id: str = VERIFIER_ID
  rng_abi: int = RNG_ABI
  precision: int = PRECISION

  def __post_init__(self):
    if not self.id_map_hash:
      object.__setattr__(self, "id_map_hash", identity_map_hash(self.vocab))
    if self.representation == Representation.DENSE:
      object.__setattr__(self, "max_support", self.vocab)
    if self.mode == layouts.GREEDY_VERSION:
      object.__setattr__(self, "representation", Representation.TOKEN)
      object.__setattr__(self, "max_support", 0)
    for name in ("draft_id", "target_id", "id_map_hash", "semantic_id",
                 "verifier_id"):
      if len(getattr(self, name).encode()) > 32:
        raise ValueError(f"Capabilities: {name} longer than 32 bytes")
    if self.mode not in (layouts.WIRE_VERSION, layouts.GREEDY_VERSION):
      raise ValueError(f"Capabilities: unknown mode {self.mode}")
    if not 1 <= self.max_depth <= 255 or not 1 <= self.max_requests < (
        layouts.ALL_REQUESTS) or not 1 <= self.max_slots:
      raise ValueError(f"Capabilities: bad bounds {self}")

  @property
  def greedy(self):
    return self.mode == layouts.GREEDY_VERSION

  @property
  def width(self):
    """Entries per q row: V (dense), k (sparse) or 0 (greedy)."""
    return self.max_support

  @functools.cached_property
  def bounds(self):
    # Read for every decoded frame: built once (frozen: it cannot change).
    return codec.Bounds(vocab=self.vocab, max_support=max(self.max_support, 1),
                        max_depth=self.max_depth, versions=(self.mode,),
                        greedy=self.greedy)

  @property
  def max_reply_bytes(self):
    """Bytes of one batch's replies: rows of every request and position."""
    row = layouts.frame_bytes(Kind.REPLY, self.width, self.representation)
    per_request = (self.max_depth * row
                   + layouts.frame_bytes(Kind.COMPLETION))
    return self.max_requests * per_request

  def body(self):
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fields = {k: (v.encode() if isinstance(v, str) else int(v))
              for k, v in fields.items()}
    fields["max_reply_bytes"] = self.max_reply_bytes
    return fields

  @classmethod
  def from_body(cls, body):
    """Capabilities from a decoded HELLO body (raises on a bad field)."""
    get = lambda name: body[name]
    text = lambda name: bytes(get(name)).rstrip(b"\0").decode("ascii",
                                                              "replace")
    try:
      return cls(mode=int(get("mode")), vocab=int(get("vocab")),
                 max_depth=int(get("max_depth")),
                 max_requests=int(get("max_requests")),
                 max_slots=int(get("max_slots")),
                 representation=Representation(int(get("representation"))),
                 max_support=int(get("max_support")),
                 draft_id=text("draft_id"), target_id=text("target_id"),
                 id_map_hash=text("id_map_hash"),
                 semantic_id=text("semantic_id"),
                 verifier_id=text("verifier_id"),
                 rng_abi=int(get("rng_abi")), precision=int(get("precision")))
    except ValueError as e:
      raise ProtocolError(Code.IDENTITY_MISMATCH, str(e)) from None


def hello_frame(caps, session):
  return codec.encode(Kind.HELLO, session=session, generation=0, round_id=0,
                      body=caps.body(), version=caps.mode)


def negotiate(mine, theirs):
  """Raises ProtocolError(IDENTITY_MISMATCH) unless the two sides agree."""
  differ = [f.name for f in dataclasses.fields(mine)
            if getattr(mine, f.name) != getattr(theirs, f.name)]
  if differ:
    raise ProtocolError(Code.IDENTITY_MISMATCH, ", ".join(
        f"{n}: {getattr(mine, n)!r} != {getattr(theirs, n)!r}"
        for n in differ))
  return mine


# The HELLO decoder: any version and the largest bounds, before a session
# knows its own (the body is fixed-size; REPLY frames are refused here).
HELLO_BOUNDS = codec.Bounds(vocab=1, max_support=1, max_depth=1,
                            versions=(layouts.GREEDY_VERSION,
                                      layouts.WIRE_VERSION))


def decode_hello(buf):
  """Capabilities and session id of a HELLO frame; ProtocolError if not."""
  frame = codec.decode(buf, HELLO_BOUNDS)
  if int(frame.header["kind"]) != Kind.HELLO:
    raise ProtocolError(Code.BAD_SEQUENCE, "expected HELLO")
  return Capabilities.from_body(frame.body), int(frame.header["session"])
