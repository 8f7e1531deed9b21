"""The one table from the core's row `Status` to the wire's `Code`.

`dyadic_jax.qrows` validates q rows and reports a `Status` per row; the wire
reports the same verdict as a `Code` (its rejection class). Names are
shared where the meaning is the same; the wire folds NAN and INF into
NON_FINITE and calls nonzero dense padding ID_OUT_OF_RANGE (an id the
vocabulary does not have).
"""

import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax.constants import Status
from dyadic_jax.wire.refusals import Code

CODE_OF_STATUS = {
    Status.OK: 0,
    Status.NAN: Code.NON_FINITE,
    Status.INF: Code.NON_FINITE,
    Status.NEGATIVE: Code.NEGATIVE,
    Status.NON_DYADIC: Code.NON_DYADIC,
    Status.TOKEN_OUT_OF_RANGE: Code.TOKEN_OUT_OF_RANGE,
    Status.WRONG_MASS: Code.WRONG_MASS,
    Status.PADDING_NONZERO: Code.ID_OUT_OF_RANGE,
    Status.ZERO_Q_AT_TOKEN: Code.ZERO_Q_AT_TOKEN,
    Status.MISSING_Q: Code.MISSING_Q,
    Status.ID_OUT_OF_RANGE: Code.ID_OUT_OF_RANGE,
    Status.DUPLICATE_ID: Code.DUPLICATE_ID,
    Status.UNSORTED_IDS: Code.UNSORTED_IDS,
}

# Status value -> Code value, for a whole array of statuses at once. A
# status with no row meaning (a weights-only status) maps to WRONG_MASS: a
# row kernel never reports one, and a refusal must never read as OK.
_TABLE = np.full(max(int(s) for s in Status) + 1, int(Code.WRONG_MASS),
                 np.int32)
for _status, _code in CODE_OF_STATUS.items():
  _TABLE[int(_status)] = int(_code)


def codes(statuses: ArrayLike) -> np.ndarray:
  """int32 Code values (0 = OK) of an array of row statuses."""
  return _TABLE[np.asarray(statuses, np.int64)]
