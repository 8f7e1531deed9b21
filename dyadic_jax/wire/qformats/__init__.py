"""q formats: one object per wire representation of q rows, in one table.

    dense   float32 q[D, V]                        (Representation.DENSE)
    sparse  int32 ids[D, k] + float32 q[D, k]      (Representation.SPARSE)
    greedy  the drafted tokens alone, greedy mode  (Representation.TOKEN)

Each is a `base.QFormat` (layout, validation, staging, conversion to
DenseQ/SparseQ, HELLO's width, the worker's row, warm-up q, size
estimate); the rest of the library asks a session's format and never
branches on which one it is. A new representation: a `Representation`
value in `dyadic_jax/wire/layouts.py`, a module here, and its line in
`FORMATS`.
"""

from dyadic_jax.wire.layouts import Mode
from dyadic_jax.wire.qformats import dense, sparse, token
from dyadic_jax.wire.qformats.base import (Q, Counts, Proposed, QFormat,
                                           Rows, Verdict, aligned_empty)

FORMATS: dict[int, QFormat] = {
    f.representation: f for f in (dense.FORMAT, sparse.FORMAT, token.FORMAT)}
BY_NAME: dict[str, QFormat] = {f.name: f for f in FORMATS.values()}


def get(representation: int) -> QFormat | None:
  """The QFormat of a Representation value, or None if there is none."""
  return FORMATS.get(representation)


def negotiated(mode: int, representation: int) -> QFormat:
  """The QFormat of a session of `mode` asking for `representation`.

  A greedy session has one format whatever it asks (the tokens alone); a
  sampled one the format of `representation`, if that format carries q.
  Raises ValueError otherwise.
  """
  if Mode(mode) == Mode.GREEDY:
    return token.FORMAT
  fmt = FORMATS.get(representation)
  if fmt is None or fmt.mode != Mode(mode):
    raise ValueError(f"representation {representation} on a sampled "
                     "session")
  return fmt


__all__ = ["BY_NAME", "Counts", "FORMATS", "Proposed", "Q", "QFormat", "Rows",
           "Verdict", "aligned_empty", "get", "negotiated"]
