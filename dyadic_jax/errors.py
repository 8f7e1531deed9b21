"""The one exception type of the host-side wrappers.

Core ops are pure and report failures as a per-row int32 status; a host-side
caller that wants an exception wraps the op with `checked`.
"""

import functools
from typing import Any, Callable

import numpy as np

from dyadic_jax.constants import Status


class DyadicError(ValueError):
  """A core op refused some rows.

  Attributes:
    op: name of the op that refused.
    status: the `Status` of the first failing row.
    rows: tuple of the failing row indices (multi-indices for batch rank > 1).
    statuses: tuple of the `Status` of each failing row, aligned with `rows`.
  """

  def __init__(self, op: str, status: int, rows: Any, statuses: Any):
    self.op = op
    self.status = Status(status)
    self.rows = tuple(rows)
    self.statuses = tuple(Status(s) for s in statuses)
    shown = ", ".join(
        f"{r}:{s.name}" for r, s in zip(self.rows[:8], self.statuses[:8]))
    more = "" if len(self.rows) <= 8 else f" (+{len(self.rows) - 8} more)"
    super().__init__(
        f"{op}: {len(self.rows)} row(s) refused, first {self.status.name}"
        f" [{shown}{more}]")


def raise_for_status(op: str, status: Any) -> None:
  """Raises `DyadicError` if any entry of `status` is not `Status.OK`.

  `status` may be a scalar (a single-request op such as `verify_chain`):
  its row is then `()`.
  """
  status = np.asarray(status)
  if status.ndim == 0:
    # np.argwhere of a 0-d array is always empty: judge the scalar itself.
    if int(status) != Status.OK:
      raise DyadicError(op, int(status), [()], [int(status)])
    return
  bad = np.argwhere(status != Status.OK)
  if bad.size == 0:
    return
  rows = [tuple(int(i) for i in idx) if status.ndim > 1 else int(idx[0])
          for idx in bad]
  statuses = [int(status[tuple(idx)]) for idx in bad]
  raise DyadicError(op, statuses[0], rows, statuses)


def checked(op: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps an op returning `(..., status)` so that failures raise.

  The wrapped function returns the op's outputs without the status. It pulls
  the status to the host, so use it at host boundaries, not inside `jit`.
  """

  @functools.wraps(op)
  def wrapper(*args, **kwargs):
    *outs, status = op(*args, **kwargs)
    raise_for_status(getattr(op, "__name__", repr(op)), status)
    return outs[0] if len(outs) == 1 else tuple(outs)

  return wrapper
