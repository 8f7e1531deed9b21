"""The PROPOSAL draws of a round: what the sampling audit checks tokens by.

The worker leader draws x_i from its q row i with the 24-bit draw of the
PROPOSAL key of (seed, generation, round, anchor + i) (the core's
`rng.proposal_draw` of `rng.round_key`, as the proposer calls them). The
verifier knows all four, so it recomputes the draws (`proposal_draws`, one
jitted call per round, made while the worker is drafting: the core's
`rng.proposal_draws` of the requests' round keys) and the q format's audit
checks, on the received counts, that each drafted token is the first index
whose cumulative count exceeds its draw (`qformats.base.audit`). A
mismatch is SAMPLING_MISMATCH: the whole proposal is discarded. This
catches an honest but buggy worker (tokens not drawn from the q it sent);
a worker that holds the key and knows the seed is trusted
(docs/security.md).
"""

import functools

import jax
import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax import rng


@functools.partial(jax.jit, static_argnums=4)
def _draws(seeds: jax.Array, generations: jax.Array, rounds: jax.Array,
           anchors: jax.Array, depth: int) -> jax.Array:
  return rng.proposal_draws(rng.round_keys(seeds, generations, rounds), depth,
                            anchors)


def proposal_draws(seeds: ArrayLike, generations: ArrayLike,
                   rounds: ArrayLike, anchors: ArrayLike, depth: int, *,
                   pad_to: int | None = None) -> np.ndarray:
  """uint32[R, depth] PROPOSAL draws of R requests (numpy in and out).

  seeds uint64[R], generations and rounds [R] (uint32 range), anchors
  int64[R]: exactly the values and dtypes the proposer uses. pad_to: pad
  the batch to this many requests (one compile for every batch size).
  """
  r = np.shape(seeds)[0]
  pad = max(0, (pad_to or r) - r)
  arrays = [np.pad(np.asarray(a, dtype), (0, pad)) for a, dtype in (
      (seeds, np.uint64), (generations, np.uint32), (rounds, np.uint32),
      (anchors, np.int64))]
  arrays[0] = arrays[0].view(np.int64)
  with jax.enable_x64(True):
    out = _draws(*arrays, int(depth))
    return np.asarray(out)[:r]
