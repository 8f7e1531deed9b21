"""Byte edits of encoded frames, for the tests that forge defects."""

from dyadic_jax.wire import codec, layouts


def reseal(buf):
  """Recomputes the CRC, as if the defect came before checksumming."""
  buf = bytearray(buf)
  crc = codec.checksum(memoryview(buf)[layouts.CRC_COVERS_FROM:])
  buf[layouts.CRC_OFFSET:layouts.CRC_OFFSET + 4] = crc.to_bytes(4, "little")
  return bytes(buf)


def set_field(buf, offset, value, nbytes, reseal_crc=True):
  """Writes a little-endian integer at `offset` (and reseals by default)."""
  buf = bytearray(buf)
  buf[offset:offset + nbytes] = int(value).to_bytes(nbytes, "little",
                                                    signed=value < 0)
  return reseal(buf) if reseal_crc else bytes(buf)
