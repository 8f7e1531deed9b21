"""Greedy rows: the drafted tokens alone, no q (the v1 greedy mode).

A greedy session verifies point mass (accept while the draft is the
target's argmax), so there is nothing to validate but the tokens' range,
and a row that claims q entries is refused (SAMPLED_ON_GREEDY).
"""

from __future__ import annotations   # JAX's types, without importing JAX

import typing

import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax.wire import layouts
from dyadic_jax.wire.qformats import base
from dyadic_jax.wire.refusals import Code

if typing.TYPE_CHECKING:
  import jax

  from dyadic_jax import rowops


class TokenFormat(base.QFormat):
  """Token ids only."""
  name = "greedy"     # the session's mode: its only format
  representation = layouts.Representation.TOKEN
  mode = layouts.Mode.GREEDY
  entry_bytes = 0
  has_values = False

  def width(self, vocab: int, support: int, shards: int = 1) -> int:
    del vocab, support, shards
    return 0

  def put(self, rows: base.Rows, ids: ArrayLike, counts: ArrayLike) -> None:
    del ids, counts
    rows.n[:] = 0

  def propose(self, logits: jax.Array, draw: jax.Array | None, width: int,
              executor: rowops.Executor) -> base.Proposed:
    del draw, width, executor   # point mass: the argmax, nothing to draw
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    token = jnp.argmax(logits).astype(jnp.int32)
    return token, jnp.int32(0), None, None, jnp.int32(0)

  def validate(self, rows: base.Rows, *, vocab: int,
               draws: ArrayLike | None = None,
               device: bool = False) -> base.Verdict:
    del draws, device   # no q: no audit (greedy tokens are argmaxes)
    rows = base.checked_rows("TokenFormat.validate", rows)
    tokens, n = np.asarray(rows.tokens), np.asarray(rows.n)
    codes = np.where((tokens < 0) | (tokens >= vocab),
                     np.int32(Code.TOKEN_OUT_OF_RANGE), np.int32(0))
    codes = np.where(n != 0, np.int32(Code.SAMPLED_ON_GREEDY), codes)
    return base.Verdict(None, codes.astype(np.int32))

  def to_q(self, counts: typing.Optional[base.Counts],
           rows: base.Rows) -> base.Q:
    del counts, rows
    return None


FORMAT = TokenFormat()
