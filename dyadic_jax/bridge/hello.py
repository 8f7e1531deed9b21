"""HELLO: what each side is, and the bounds every buffer is sized from.

Each side builds its own `Capabilities` from local configuration; they are
checked against local limits when built (vocab <= MAX_VOCAB, depth <= 255,
...). A peer's HELLO is compared with them field by field on the raw body
(`mismatches`): nothing is computed from a peer-chosen number (no id-map
hash of a peer's vocabulary, no allocation of its sizes), and a session
opens only when every field is equal (no auto-upgrade, no fallback to a
default, nothing enabled by an environment variable). Slots are sized from
the local capabilities after agreement.

The one exception is `features` (`layouts.Feature`): optional forms of
the same protocol, not identities. The verifier offers its own; the
worker answers with the part of the offer it also has (`agree`), and the
verifier accepts an answer only within its offer. The session uses what
the answer holds (the PACKED reply: `Feature.PACKED_REPLY`; the
committed prefix in CONTEXT frames: `Feature.CONTEXT`, which a worker
accepts only when its session is made with `wants_context`; the PACKED
reply's AES-256-GMAC tag: `Feature.GMAC`, `wire.auth`; a batch's STEPs
in one PACKED_STEP frame: `Feature.PACKED_STEP`; answers of 1..D
rows drawn under a sequential stopping rule: `Feature.ADAPTIVE_DEPTH`,
offered only by capabilities that name it, never by default, and accepted
by a worker only when its proposer runs such a rule).

`max_context` is no HELLO field: a local bound, the same default on both
sides (a verifier never sends a longer CONTEXT; a worker refuses one).
"""

import dataclasses
import functools
import hashlib

import numpy as np

from dyadic_jax.constants import DEFAULT_VOCAB, MAX_VOCAB, SEMANTIC_ID
from dyadic_jax.wire import auth, codec, layouts, qformats
from dyadic_jax.wire.layouts import Feature, Kind, Mode, Representation

RNG_ABI = 1      # dyadic_jax.rng: seed -> generation -> round -> position ...
PRECISION = 1    # float32 q on the 2^-24 grid
VERIFIER_ID = "standard-speculative-v1"
MAX_DEPTH = 255
MAX_SLOTS = 16
MAX_REQUESTS = 1024
MAX_SHARDS = 64
# The features this build offers and accepts (HELLO `features`).
FEATURES = (Feature.PACKED_REPLY | Feature.CONTEXT | Feature.GMAC
            | Feature.PACKED_STEP | Feature.ADAPTIVE_DEPTH)
# What a side offers and accepts unless told otherwise: adaptive depth is
# a session's choice (both sides' capabilities name it), never a default.
DEFAULT_FEATURES = FEATURES & ~Feature.ADAPTIVE_DEPTH
# Tokens of one CONTEXT frame: the default bound, and the most a side
# accepts as its bound (one frame is 4 bytes a token).
MAX_CONTEXT = 4096
MAX_CONTEXT_BOUND = 1 << 20
# Positions are folded into RNG keys and held in int64 by the proposer: a
# STEP whose anchor + depth exceeds this is refused (ABSURD_LENGTH).
MAX_POSITION = 1 << 62
# Capabilities that never travel in the HELLO.
_LOCAL = frozenset({"max_context"})
_TEXT = ("draft_id", "target_id", "id_map_hash", "semantic_id",
         "verifier_id")


def identity_map_hash(vocab: int) -> str:
  """Hash of the identity global id map 0..V-1 (a shared tokenizer)."""
  return hashlib.sha256(np.arange(vocab, dtype="<i4").tobytes()).hexdigest(
  )[:32]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
  """One side's HELLO. Equal capabilities on both sides open a session.

  Attributes:
    mode: Mode.SAMPLED (q on the wire) or Mode.GREEDY (the v1 greedy mode:
      token ids only, point-mass verification, never q).
    vocab: V, in [2, MAX_VOCAB].
    max_depth: D, drafted positions per request and round, in [1, 255].
    max_requests: requests per batch slot, in [1, 1024].
    max_slots: batch slots in flight, in [1, 16].
    representation: Representation of the q rows (DENSE or SPARSE; TOKEN
      on a greedy session, whatever is asked). Its `qformats` format
      (`format`) decides the rest.
    max_support: k, the entries of a sparse row (its top-k support), in
      [1, V]; replaced by the format's row width (`QFormat.width`). With
      a format that does not use k (`uses_support` false) it is ignored
      (any value, the default 32 included): dense rows hold
      ceil(V / shards) entries (V on one link), greedy rows 0. So one setting (a --k flag)
      serves every representation, and the attribute always reads the row
      width HELLO carries (`width`). Not refused for dense: the default
      could not be told from a deliberate value.
    draft_id, target_id: checkpoint identities (<= 32 bytes each).
    id_map_hash: hash of the global token id map (default: identity).
    shards, shard: a rank link of a tensor-parallel pair (a `shardable`
      format only: dense q):
      the vocabulary is split into `shards` contiguous blocks of
      ceil(V / shards) ids and this link carries block `shard`
      (`shard_range`); its rows are that block's counts (`width`), the
      last block's ids >= V zero. 1, 0: the whole vocabulary.
    features: the `layouts.Feature`s this side offers (a verifier) or
      accepts (a worker), within this build's (`FEATURES`); default
      `DEFAULT_FEATURES`, all of them but ADAPTIVE_DEPTH (GMAC only
      while a PACKED frame fits in 2^31 - 1 bytes), 0 for
      the v3 per-frame protocol only (a peer from before features: it
      refuses a HELLO offering any, IDENTITY_MISMATCH). A worker's
      CONTEXT also needs its session's `wants_context`, its
      ADAPTIVE_DEPTH its session's `wants_adaptive` (a proposer with an
      `admission` rule).
    max_context: the most tokens of a CONTEXT frame, in [1,
      MAX_CONTEXT_BOUND]: local, not in the HELLO (equal on both sides: a
      verifier sends no CONTEXT for a longer prefix, a worker refuses a
      longer one, ABSURD_LENGTH).
  """
  mode: int = Mode.SAMPLED
  vocab: int = DEFAULT_VOCAB
  max_depth: int = 5
  max_requests: int = 4
  max_slots: int = 2
  representation: int = Representation.SPARSE
  max_support: int = 32
  draft_id: str = "toy-draft"
  target_id: str = "toy-target"
  id_map_hash: str = ""
  semantic_id: str = SEMANTIC_ID
  verifier_id: str = VERIFIER_ID
  rng_abi: int = RNG_ABI
  precision: int = PRECISION
  shards: int = 1
  shard: int = 0
  features: int = DEFAULT_FEATURES
  max_context: int = MAX_CONTEXT

  def __post_init__(self) -> None:
    if self.mode not in tuple(Mode):
      raise ValueError(f"Capabilities: unknown mode {self.mode}")
    if not 2 <= self.vocab <= MAX_VOCAB:
      raise ValueError(f"Capabilities: vocab {self.vocab} not in [2, "
                       f"{MAX_VOCAB}]")
    if not (1 <= self.max_depth <= MAX_DEPTH
            and 1 <= self.max_requests <= MAX_REQUESTS
            and 1 <= self.max_slots <= MAX_SLOTS):
      raise ValueError(f"Capabilities: depth {self.max_depth} not in [1, "
                       f"{MAX_DEPTH}], requests {self.max_requests} not in "
                       f"[1, {MAX_REQUESTS}] or slots {self.max_slots} not in "
                       f"[1, {MAX_SLOTS}]")
    if not (1 <= self.shards <= MAX_SHARDS and 0 <= self.shard < self.shards
            and self.shards <= self.vocab):
      raise ValueError(f"Capabilities: shard {self.shard} of {self.shards} "
                       f"not in [0, shards), shards in [1, {MAX_SHARDS}] "
                       "and <= vocab")
    if int(self.features) & ~int(FEATURES):
      raise ValueError(f"Capabilities: features {self.features} not within "
                       f"{int(FEATURES)}")
    if not 1 <= self.max_context <= MAX_CONTEXT_BOUND:
      raise ValueError(f"Capabilities: max_context {self.max_context} not "
                       f"in [1, {MAX_CONTEXT_BOUND}]")
    set_ = functools.partial(object.__setattr__, self)
    set_("mode", Mode(self.mode))
    set_("features", Feature(int(self.features)))
    try:
      fmt = qformats.negotiated(self.mode, self.representation)
      if self.shards > 1 and not fmt.shardable:
        raise ValueError(f"rank links (shards > 1) split rows by "
                         f"vocabulary block; {fmt.name} rows do not (its q "
                         "keeps the leader's single link)")
      width = fmt.width(self.vocab, self.max_support, self.shards)
    except ValueError as e:
      raise ValueError(f"Capabilities: {e}") from None
    set_("representation", Representation(fmt.representation))
    set_("max_support", width)
    if not self.id_map_hash:
      set_("id_map_hash", identity_map_hash(self.vocab))
    for name in _TEXT:
      if len(getattr(self, name).encode()) > 32:
        raise ValueError(f"Capabilities: {name} longer than 32 bytes")
    if (self.features & Feature.GMAC and self.bounds.packed_bytes(
        self.max_requests, self.max_depth) > auth.GMAC_MAX_FRAME):
      # The AEAD takes at most 2^31 - 1 bytes: such sessions keep BLAKE3.
      set_("features", self.features & ~Feature.GMAC)

  @property
  def greedy(self) -> bool:
    return self.mode == Mode.GREEDY

  @property
  def width(self) -> int:
    """Entries per q row (`QFormat.width`): V (dense; its block on a rank
    link), k (sparse) or 0 (greedy)."""
    return self.max_support

  @property
  def shard_range(self) -> tuple[int, int]:
    """(lo, hi): the global ids this link's rows carry (hi - lo <= width)."""
    if self.shards == 1:
      return 0, self.vocab
    lo = self.shard * self.width
    return lo, min(self.vocab, lo + self.width)

  def link(self, shard: int) -> "Capabilities":
    """These capabilities on the rank link of `shard`. Links s >= 1 carry
    one REPLY per request and never a batch answer: they offer no
    features (rank 0's link is the leader's session, packed if agreed)."""
    return dataclasses.replace(self, shard=shard,
                               features=self.features if shard == 0 else 0)

  @functools.cached_property
  def bounds(self) -> codec.Bounds:
    # Read for every decoded frame: built once (frozen: it cannot change).
    return codec.Bounds(vocab=self.vocab, depth=self.max_depth,
                        width=self.width, representation=self.representation,
                        max_requests=self.max_requests)

  @property
  def format(self) -> qformats.QFormat:
    return self.bounds.format

  @property
  def max_reply_bytes(self) -> int:
    """Bytes of one batch's reply message: R x (REPLY + COMPLETION)."""
    return self.bounds.max_reply_message

  def body(self, nonce: bytes = b"") -> dict[str, int | bytes]:
    """The HELLO body fields (a dict for `codec.encode`)."""
    values = {f.name: getattr(self, f.name)
              for f in dataclasses.fields(self) if f.name not in _LOCAL}
    fields: dict[str, int | bytes] = {
        k: (v.encode() if isinstance(v, str) else int(v))
        for k, v in values.items()}
    fields["max_reply_bytes"] = self.max_reply_bytes
    fields["shard_lo"], fields["shard_hi"] = self.shard_range
    fields["nonce"] = bytes(nonce)
    return fields

  @functools.cached_property
  def _expected(self) -> layouts.Body:
    body = codec.decode(hello_frame(self, 0, bytes(32)),
                        codec.HELLO_BOUNDS).body
    return body._replace(nonce=b"", features=0)


def mismatches(mine: Capabilities, body: layouts.Body) -> list[str]:
  """The fields of a received HELLO body that differ from `mine`
  (`features` apart: see `agree`).

  Plain comparisons of fixed-size fields: nothing proportional to a
  peer-chosen value is computed or allocated. Empty: the sides agree.
  """
  theirs = body._replace(nonce=b"", features=0)
  want = mine._expected
  return [f"{name}: {getattr(want, name)!r} != {getattr(theirs, name)!r}"
          for name in want._fields if getattr(want, name) != getattr(
              theirs, name)]


def agree(mine: Capabilities, offered: int) -> Feature:
  """The features a worker answers an offer with: those of the offer it
  has too (bits it does not know are ignored, never an error)."""
  return Feature(int(mine.features) & int(offered))


def hello_frame(caps: Capabilities, session: int, nonce: bytes,
                send: auth.Tagger | None = None,
                features: int | None = None) -> bytes:
  """A HELLO frame of `caps` for `session` with `nonce`, sealed by `send`.
  features: what it says (default: `caps.features`, the verifier's offer;
  a worker's answer says what it agreed to)."""
  body = caps.body(nonce)
  if features is not None:
    body["features"] = int(features)
  return codec.encode(Kind.HELLO, session=session, generation=0, round_id=0,
                      body=body, send=send)

