"""q formats: one object per wire representation of q rows, in one table.

    dense   float32 q[D, V]                        (Representation.DENSE)
    sparse  int32 ids[D, k] + float32 q[D, k]      (Representation.SPARSE)
    token   the drafted tokens alone, greedy mode  (Representation.TOKEN)

Each is a `base.QFormat` (layout, validation, staging, conversion to
DenseQ/SparseQ). A new representation: a `Representation` value in
`dyadic_jax/wire/layouts.py`, a module here, and its line in `FORMATS`.
"""

from dyadic_jax.wire.qformats import dense, sparse, token
from dyadic_jax.wire.qformats.base import QFormat, Rows, Verdict, aligned_empty

FORMATS = {f.representation: f for f in (dense.FORMAT, sparse.FORMAT,
                                         token.FORMAT)}


def get(representation):
  """The QFormat of a Representation value, or None if there is none."""
  return FORMATS.get(representation)


__all__ = ["FORMATS", "QFormat", "Rows", "Verdict", "aligned_empty", "get"]
