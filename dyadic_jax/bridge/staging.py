"""Slots: preallocated host buffers for one batch of q rows each.

A slot is sized once from the negotiated capabilities (after HELLO) by
its q format (`QFormat.staging`) and reused: values float32[R, D, w]
(64-byte aligned, so JAX on CPU reads them without a copy), ids int32[R,
D, w] (sparse), tokens and n int32[R, D]. Two dense slots at V = 129280,
R = 4, D = 5 hold 20,684,800 bytes of q.

`rows(requests, depth)` views the first requests x depth rows as
contiguous arrays (a round of a smaller batch or depth reads nothing
else). Rows are copied in only after their frames authenticated and
framed correctly, and are used only after the whole batch validated
(`VerifierSession.staged`); an exchange past its deadline is over before
its slot can be filled again (the session ends it in `poll`).
"""

import numpy as np

from dyadic_jax.bridge import hello
from dyadic_jax.wire import qformats


class Slot:
  """One batch's staging buffers (flat, viewed per exchange)."""

  def __init__(self, fmt: qformats.QFormat, requests: int, depth: int,
               width: int) -> None:
    self.format = fmt
    self.shape = (requests, depth, width)
    flat = fmt.staging(1, 1, requests * depth * width)
    self._ids = None if flat.ids is None else flat.ids.reshape(-1)
    self._values = None if flat.values is None else flat.values.reshape(-1)
    self._tokens = np.zeros(requests * depth, np.int32)
    self._n = np.zeros(requests * depth, np.int32)
    self._views: dict[tuple[int, int], qformats.Rows] = {}

  def rows(self, requests: int, depth: int) -> qformats.Rows:
    """Rows [requests, depth, ...] over the start of the buffers."""
    views = self._views.get((requests, depth))
    if views is None:
      views = self._views[requests, depth] = self._rows(requests, depth)
    return views

  def _rows(self, requests: int, depth: int) -> qformats.Rows:
    w = self.shape[2]
    rd = requests * depth

    def view(flat: np.ndarray, *trailing: int) -> np.ndarray:
      return flat[:rd * int(np.prod(trailing))].reshape(
          (requests, depth) + trailing)

    return qformats.Rows(view(self._tokens), view(self._n),
                         None if self._ids is None else view(self._ids, w),
                         None if self._values is None
                         else view(self._values, w))

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in (self._values, self._ids) if a is not None)


def slots_for(caps: hello.Capabilities) -> list[Slot]:
  """The `max_slots` slots of a session (sized from its capabilities)."""
  return [Slot(caps.format, caps.max_requests, caps.max_depth, caps.width)
          for _ in range(caps.max_slots)]
