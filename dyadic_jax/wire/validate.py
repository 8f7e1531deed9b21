"""Validation of one q row as it arrives: dyadic, canonical, complete.

The checks on the values are the core's one kernel per q format
(`dyadic_jax.qrows`, on float32 bit patterns, so no backend's
flush-to-zero can change a verdict); this module adds what only a loose
row needs (types, lengths) and raises the row's `Code` (mapped by
`dyadic_jax.wire.status`). The order of the checks is part of the contract
(the first failing class is reported), so a row with several defects always
gets the same code.
"""

import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax import qrows
from dyadic_jax.wire import status
from dyadic_jax.wire.refusals import Code, ProtocolError


def _check_token(token: object, vocab_size: int) -> int:
  if isinstance(token, (bool, np.bool_)) or not isinstance(
      token, (int, np.integer)):
    raise ProtocolError(Code.TOKEN_OUT_OF_RANGE, f"token {token!r} is not an "
                        "integer")
  if not 0 <= int(token) < vocab_size:
    raise ProtocolError(Code.TOKEN_OUT_OF_RANGE,
                        f"token {int(token)} not in [0, {vocab_size})")
  return int(token)


def _check_ids(ids: np.ndarray, n_values: int, vocab_size: int) -> None:
  if ids.dtype != np.int32 or ids.ndim != 1:
    raise ProtocolError(Code.WRONG_DTYPE, f"ids must be int32[k], got "
                        f"{ids.dtype}{list(ids.shape)}")
  if len(ids) != n_values:
    raise ProtocolError(Code.LENGTH_MISMATCH, f"{len(ids)} ids for "
                        f"{n_values} values")
  if len(ids) > vocab_size:
    raise ProtocolError(Code.ABSURD_LENGTH, f"{len(ids)} ids for a "
                        f"vocabulary of {vocab_size}")


def validate_q_row(values: ArrayLike | None, ids: ArrayLike | None, *,
                   vocab_size: int, token: int) -> np.ndarray:
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
    WRONG_DTYPE; LENGTH_MISMATCH; ABSURD_LENGTH (more ids than V); then the
    kernel's order (`dyadic_jax.qrows`): sparse ID_OUT_OF_RANGE,
    DUPLICATE_ID (even with zero q, sorted or not), UNSORTED_IDS; then
    NON_FINITE (NaN, inf); NEGATIVE (any sign bit on a nonzero magnitude,
    subnormals too); WRONG_MASS (a value above 1); NON_DYADIC (q * 2^24 not
    an integer; every subnormal); WRONG_MASS (the exact count sum is not
    2^24); ZERO_Q_AT_TOKEN (zero q at the token, or the token absent from a
    sparse support). -0.0 is zero. Nothing is renormalized.
  """
  vocab_size = int(vocab_size)
  token = _check_token(token, vocab_size)
  if values is None:
    raise ProtocolError(Code.MISSING_Q, f"no q for sampled token {token}")
  values = np.asarray(values)
  if values.dtype != np.float32 or values.ndim != 1:
    raise ProtocolError(Code.WRONG_DTYPE, f"values must be float32[n], got "
                        f"{values.dtype}{list(values.shape)}")
  bits = np.ascontiguousarray(values).view(np.uint32)[None]
  if ids is None:
    if len(values) != vocab_size:
      raise ProtocolError(Code.LENGTH_MISMATCH, f"dense row of {len(values)} "
                          f"values for a vocabulary of {vocab_size}")
    counts, row_status = qrows.dense(bits, np.array([token], np.int32),
                                     vocab=vocab_size, xp=np)
  else:
    ids = np.asarray(ids)
    if len(values) == 0 and ids.size == 0:
      raise ProtocolError(Code.MISSING_Q, "empty sparse row")
    _check_ids(ids, len(values), vocab_size)
    counts, row_status = qrows.sparse(
        bits, ids[None], np.array([len(ids)], np.int32),
        np.array([token], np.int32), vocab=vocab_size, xp=np)
  code = int(status.codes(row_status)[0])
  if code:
    raise ProtocolError(code, f"q row for token {token}")
  return counts[0]
