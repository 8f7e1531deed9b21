"""Validation of one q row as it arrives: dyadic, canonical, complete.

numpy only, no Python loop over entries; every check reads the row once
with a vectorized comparison. The order of the checks is part of the
contract (the first failing class is the one reported), so that a row with
several defects always gets the same code.
"""

import numpy as np

from dyadic_jax.constants import LOG2_M, M
from dyadic_jax.wire.errors import Code, ProtocolError

_SCALE = np.float32(1 << LOG2_M)


def _check_token(token, vocab_size):
  if isinstance(token, (bool, np.bool_)) or not isinstance(
      token, (int, np.integer)):
    raise ProtocolError(Code.TOKEN_OUT_OF_RANGE, f"token {token!r} is not an "
                        "integer")
  if not 0 <= int(token) < vocab_size:
    raise ProtocolError(Code.TOKEN_OUT_OF_RANGE,
                        f"token {int(token)} not in [0, {vocab_size})")
  return int(token)


def _check_ids(ids, n_values, vocab_size):
  if ids.dtype != np.int32 or ids.ndim != 1:
    raise ProtocolError(Code.WRONG_DTYPE, f"ids must be int32[k], got "
                        f"{ids.dtype}{list(ids.shape)}")
  if len(ids) != n_values:
    raise ProtocolError(Code.LENGTH_MISMATCH, f"{len(ids)} ids for "
                        f"{n_values} values")
  if len(ids) > vocab_size:
    raise ProtocolError(Code.ABSURD_LENGTH, f"{len(ids)} ids for a "
                        f"vocabulary of {vocab_size}")
  if np.any(ids < 0) or np.any(ids >= vocab_size):
    raise ProtocolError(Code.ID_OUT_OF_RANGE, f"ids outside [0, {vocab_size})")
  step = np.diff(ids)
  if np.any(step <= 0):
    # Any duplicate is reported as such, sorted or not.
    if len(np.unique(ids)) != len(ids):
      raise ProtocolError(Code.DUPLICATE_ID, "a sparse id appears twice")
    raise ProtocolError(Code.UNSORTED_IDS, "ids not strictly ascending")


def validate_q_row(values, ids, *, vocab_size, token):
  """Validates one received q row and returns its int32 counts.

  Args:
    values: float32[n] q values: the whole row (dense, n == vocab_size) or
      the values at `ids` (sparse).
    ids: int32[n] strictly ascending global ids of a sparse row, or None for
      a dense row.
    vocab_size: V.
    token: the token sampled from this row.

  Returns:
    int32 counts c = q * 2^24, length vocab_size (dense) or len(ids).

  Raises:
    ProtocolError, with the first failing class in this order:
    TOKEN_OUT_OF_RANGE; MISSING_Q (no values, or an empty sparse row);
    WRONG_DTYPE; LENGTH_MISMATCH; ABSURD_LENGTH; ID_OUT_OF_RANGE; DUPLICATE_ID (even with
    zero q); UNSORTED_IDS; NON_FINITE; NEGATIVE; WRONG_MASS (a value above
    1); NON_DYADIC (q * 2^24 not an integer); WRONG_MASS (a uint64 count sum
    other than 2^24); ZERO_Q_AT_TOKEN (zero q at the token, or the token absent from a
    sparse support). -0.0 is accepted as zero. Nothing is renormalized.
  """
  vocab_size = int(vocab_size)
  token = _check_token(token, vocab_size)
  if values is None:
    raise ProtocolError(Code.MISSING_Q, f"no q for sampled token {token}")
  values = np.asarray(values)
  if values.dtype != np.float32 or values.ndim != 1:
    raise ProtocolError(Code.WRONG_DTYPE, f"values must be float32[n], got "
                        f"{values.dtype}{list(values.shape)}")
  if ids is None:
    if len(values) != vocab_size:
      raise ProtocolError(Code.LENGTH_MISMATCH, f"dense row of {len(values)} "
                          f"values for a vocabulary of {vocab_size}")
  else:
    ids = np.asarray(ids)
    if len(values) == 0 and ids.size == 0:
      raise ProtocolError(Code.MISSING_Q, "empty sparse row")
    _check_ids(ids, len(values), vocab_size)

  if not np.all(np.isfinite(values)):
    raise ProtocolError(Code.NON_FINITE, "NaN or inf in q")
  if np.any(values < 0):
    raise ProtocolError(Code.NEGATIVE, "negative q")
  if np.any(values > 1):  # before scaling, which could overflow
    raise ProtocolError(Code.WRONG_MASS, "a q value above 1")
  scaled = values * _SCALE  # exact: scaling by a power of two
  if np.any(np.floor(scaled) != scaled):
    raise ProtocolError(Code.NON_DYADIC, "q * 2^24 is not an integer")
  counts = scaled.astype(np.int32)
  total = int(counts.sum(dtype=np.uint64))
  if total != M:
    raise ProtocolError(Code.WRONG_MASS, f"counts sum to {total}, not 2^24")

  if ids is None:
    at_token = counts[token]
  else:
    pos = int(np.searchsorted(ids, token))
    at_token = counts[pos] if pos < len(ids) and ids[pos] == token else 0
  if at_token == 0:
    raise ProtocolError(Code.ZERO_Q_AT_TOKEN, f"q = 0 at token {token}")
  return counts
