"""The wire's one exception type and its rejection classes.

Every way a peer's bytes can be refused has its own `Code`; the bridge
counts each refusal by code and discards the whole proposal (docs/wire.md,
"Rejection classes"). Never renumber: codes travel in COMPLETION statuses,
COMMIT statuses and RESET refusals. A code a peer sends that this side does
not know is itself a refusal (BAD_STATUS), never an exception: use
`Code.parse`.
"""

import enum
import typing


class Code(enum.IntEnum):
  """One member per rejection class (the seed's list is the minimum)."""
  # Framing.
  BAD_MAGIC = 1              # the frame does not start with the magic
  UNSUPPORTED_VERSION = 2    # a wire version this side does not speak
  UNKNOWN_KIND = 3           # an unknown message kind or representation
  TRUNCATED = 4              # fewer bytes than the header declares
  ABSURD_LENGTH = 5          # a declared size or count beyond local bounds
  UNEXPECTED_SIZE = 6        # frame size differs from the declared size
  CHECKSUM_MISMATCH = 7      # a COMPLETION does not match its REPLY frame
  # Negotiation and sessions.
  IDENTITY_MISMATCH = 8      # semantic id, vocab, id map, checkpoints, RNG ABI
  SAMPLED_ON_GREEDY = 9      # a sampled request or q row on a greedy session
  STALE_GENERATION = 10      # a generation older than the current one
  DUPLICATE_ROUND = 11       # a round already answered or committed
  TIMEOUT = 12               # q arrived after the watchdog fired
  # One q row (validate_q_row; qrows statuses map here, see `wire.status`).
  MISSING_Q = 13             # no q for a sampled token (empty row)
  WRONG_DTYPE = 14           # values not float32 / ids not int32
  LENGTH_MISMATCH = 15       # dense length != V, or ids/values lengths differ
  NON_FINITE = 16            # NaN or +-inf in q
  NEGATIVE = 17              # a negative q value (negative subnormals too)
  NON_DYADIC = 18            # q * 2^24 is not an integer (subnormals too)
  WRONG_MASS = 19            # counts do not sum to exactly 2^24 (or c > 2^24)
  ID_OUT_OF_RANGE = 20       # a sparse id < 0 or >= V; dense padding nonzero
  DUPLICATE_ID = 21          # a sparse id twice, even with zero q
  UNSORTED_IDS = 22          # sparse ids not strictly ascending
  TOKEN_OUT_OF_RANGE = 23    # the sampled token is not in [0, V)
  ZERO_Q_AT_TOKEN = 24       # the sampled token has q = 0 (or is absent)
  # Exchanges (the bridge).
  STATE_MISMATCH = 25        # anchor, context or prefix digest disagree
  UNKNOWN_SESSION = 26       # a frame for a session this side never opened
  BAD_SEQUENCE = 27          # a frame of the wrong kind, request or position
  # Wire v3.
  AUTH_FAILED = 28           # the frame's MAC (or CRC32C, --insecure) fails
  SAMPLING_MISMATCH = 29     # a token is not what the PROPOSAL key draws
  BAD_STATUS = 30            # a status or reason value this side does not know
  PROPOSER_FAILED = 31       # the worker's proposer refused the STEP
  SESSION_EXHAUSTED = 32     # the session's key sealed 2^32 - 1 GMAC frames

  @classmethod
  def parse(cls, value: typing.SupportsInt | str) -> "Code | None":
    """The Code of a peer-chosen integer, or None when there is none."""
    try:
      return cls(int(value))
    except (ValueError, TypeError, OverflowError):
      return None


class ProtocolError(ValueError):
  """A refused message or row. `.code` is the `Code` of the refusal."""

  def __init__(self, code: int, detail: str = "") -> None:
    self.code = Code(code)
    self.detail = detail
    super().__init__(f"{self.code.name}: {detail}" if detail
                     else self.code.name)
