"""The committed-prefix digest both sides keep: a hash chain over tokens."""

import hashlib
import struct

import numpy as np
from numpy.typing import ArrayLike


def extend(digest: bytes, tokens: ArrayLike) -> bytes:
  """Digest of a prefix after appending `tokens` to the prefix of `digest`
  (the tokens as little-endian int32: a round's few committed tokens, a
  list or tuple, packed by one struct call; anything else by numpy)."""
  h = hashlib.blake2b(bytes(digest), digest_size=32)
  if isinstance(tokens, (list, tuple)):
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
  else:
    h.update(np.asarray(tokens, "<i4").tobytes())
  return h.digest()


def of(tokens: ArrayLike) -> bytes:
  """Digest of a whole prefix (a prompt)."""
  return extend(b"", tokens)
