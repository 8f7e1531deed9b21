"""Greedy rows: the drafted tokens alone, no q (the v1 greedy mode).

A greedy session verifies point mass (accept while the draft is the
target's argmax), so there is nothing to validate but the tokens' range,
and a row that claims q entries is refused (SAMPLED_ON_GREEDY).
"""

import jax.numpy as jnp
import numpy as np

from dyadic_jax.wire import layouts
from dyadic_jax.wire.errors import Code
from dyadic_jax.wire.qformats import base


class TokenFormat(base.QFormat):
  """Token ids only."""
  name = "greedy"     # the session's mode: its only format
  representation = layouts.Representation.TOKEN
  mode = layouts.Mode.GREEDY
  entry_bytes = 0
  has_values = False

  def width(self, vocab, support, shards=1):
    del vocab, support, shards
    return 0

  def put(self, rows, ids, counts):
    del ids, counts
    rows.n[:] = 0

  def propose(self, logits, draw, width, executor):
    del draw, width, executor   # point mass: the argmax, nothing to draw
    token = jnp.argmax(logits).astype(jnp.int32)
    return token, jnp.int32(0), None, None, jnp.int32(0)

  def validate(self, rows, *, vocab, draws=None, device=False):
    del draws, device   # no q: no audit (greedy tokens are argmaxes)
    tokens, n = np.asarray(rows.tokens), np.asarray(rows.n)
    codes = np.where((tokens < 0) | (tokens >= vocab),
                     np.int32(Code.TOKEN_OUT_OF_RANGE), np.int32(0))
    codes = np.where(n != 0, np.int32(Code.SAMPLED_ON_GREEDY), codes)
    return base.Verdict(None, codes.astype(np.int32))

  def to_q(self, counts, rows):
    del counts, rows
    return None


FORMAT = TokenFormat()
