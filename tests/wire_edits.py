"""Byte edits of encoded frames, for the tests that forge defects."""

from dyadic_jax.wire import auth


def reseal(buf, tagger):
  """The frame with its tag recomputed by `tagger` (as if the defect came
  before sealing: a buggy peer's own frame)."""
  buf = bytearray(buf)
  auth.seal(buf, tagger)
  return bytes(buf)


def set_field(buf, offset, value, nbytes, tagger=None):
  """Writes a little-endian integer at `offset`; reseals with `tagger`
  when given (None: the old tag stays, and fails)."""
  buf = bytearray(buf)
  buf[offset:offset + nbytes] = int(value).to_bytes(nbytes, "little",
                                                    signed=value < 0)
  return reseal(buf, tagger) if tagger is not None else bytes(buf)
