"""The committed-prefix digest both sides keep: a hash chain over tokens."""

import hashlib

import numpy as np
from numpy.typing import ArrayLike


def extend(digest: bytes, tokens: ArrayLike) -> bytes:
  """Digest of a prefix after appending `tokens` to the prefix of `digest`."""
  h = hashlib.blake2b(bytes(digest), digest_size=32)
  h.update(np.asarray(tokens, "<i4").tobytes())
  return h.digest()


def of(tokens: ArrayLike) -> bytes:
  """Digest of a whole prefix (a prompt)."""
  return extend(b"", tokens)
