"""Constants of the dyadic24 numerical contract and the row status codes.

Everything here is plain Python: importing it never touches a JAX backend.
"""

import enum

# Total ticket mass of a dyadic categorical q: q(v) = c_v / M.
M = 1 << 24
LOG2_M = 24

SEMANTIC_ID = "dyadic24-standard-v1"

DEFAULT_VOCAB = 129280

# Target probabilities are rounded onto a 2^-TARGET_BITS grid before any
# verification decision (docs/numerics.md section 6). 38 keeps P_v * M <=
# 2^62 and c_v * T < 2^63 (T < 2^39), so every verification product fits
# int64.
TARGET_BITS = 38

# The exact normalizer splits each exp() term into two 32-bit fixed-point
# limbs held as float64 integers; with V <= 2^21 every partial sum of a limb
# stays below 2^53, so float64 adds them exactly in any order.
NORMALIZER_BITS = 32
# The largest vocabulary: the target distribution P / T stays within total
# variation 2^-20 of the exact softmax for V <= 2^18 (2^-22 from the float32
# exp plus V 2^-39 from the 2^-38 grid; docs/numerics.md section 6). 2^18 =
# 262,144 covers every tokenizer in use (the largest, 256,000).
MAX_VOCAB = 1 << 18


class Status(enum.IntEnum):
  """Per-row outcome of a core op; every failure class has its own code.

  A row whose status is not OK carries all-zero outputs (zero weights, zero
  counts, token -1) so that nothing downstream can mistake it for a valid q.
  Names are shared with the wire's `Code` where the meaning is the same
  (the wire folds NAN and INF into NON_FINITE). The second name of 7, 8
  and 9 is the old spelling, kept as an alias (same member).
  """
  OK = 0
  NAN = 1                # a NaN in logits, bias, weights or q
  INF = 2                # +inf logit/bias, or an infinite weight or q value
  NEGATIVE = 3           # a negative weight or q value (subnormals too)
  ZERO_MASS = 4          # every logit -inf / every weight zero
  INCONSISTENT_MASS = 5  # weights do not sum to 1 within one ticket
  BAD_TEMPERATURE = 6    # temperature not finite and positive (or subnormal)
  NON_DYADIC = 7         # q * M is not an integer (q not on the 2^-24 grid)
  NON_INTEGER = 7        # alias of NON_DYADIC
  TOKEN_OUT_OF_RANGE = 8  # a sampled/drafted token id outside [0, V)
  OUT_OF_RANGE = 8       # alias of TOKEN_OUT_OF_RANGE
  WRONG_MASS = 9         # counts do not sum to exactly M, or a q above 1
  WRONG_SUM = 9          # alias of WRONG_MASS
  PADDING_NONZERO = 10   # non-zero mass beyond the vocabulary
  ZERO_Q_AT_TOKEN = 11   # q = 0 at the sampled token (or absent from sparse q)
  MISSING_Q = 12         # no q entries (sparse n outside [1, k])
  ID_OUT_OF_RANGE = 13   # a live sparse id outside [0, V)
  DUPLICATE_ID = 14      # a sparse id twice among the live entries
  UNSORTED_IDS = 15      # live sparse ids not strictly ascending
