"""What a worker draws with: the `Proposer` protocol and its capabilities.

A proposer is any callable of the `Proposer` signature; what it can do
beyond one draw a call is declared, never probed: a `DraftProposer`
(`proposer.draft_proposer`'s result, or one a deployment makes for its
own draft) names its batched draw (`many`, `batched`), its handle
eviction (`forget`) and its stopping rule (`admission`), and `declared`
gives any other proposer the record that declares none.

No JAX here: the worker driver imports it (the proposer is JAX's).
"""

import typing

import numpy as np

from dyadic_jax import admission as admission_lib
from dyadic_jax.bridge.effects import Call
from dyadic_jax.wire import qformats

__all__ = ["DraftProposer", "Proposer", "declared"]


class Proposer(typing.Protocol):
  """What the worker draws with: `draft_proposer`'s, or any callable of
  this signature (a model-specific draft)."""

  def __call__(self, seed: int, generation: int, round_id: int, anchor: int,
               last_token: int, depth: int,
               out: qformats.Rows | None = None, *,
               request: int | None = None,
               context: np.ndarray | None = None) -> qformats.Rows:
    """One request's proposal for one round: tokens int32[D] (x_1..x_D),
    n int32[D] (V dense, the live entries sparse, 0 greedy), ids
    int32[D, k] of sparse rows (ascending, padding -1) or None, values
    float32[D, w] q rows or None (greedy)."""
    ...



class DraftProposer(typing.NamedTuple):
  """A `Proposer` (call it as one) with its optional capabilities declared
  (`draft_proposer`'s result; `declared` makes one of any proposer):
  `many(calls, depth)`, the proposals of a batch of requests (`Call`s) in
  one draft call where the draft offers a slab, and `forget(request)`,
  which drops a request's handle (a slab has `max_requests` slots, one
  slab per round in flight). admission: the stopping rule a call without
  `out` drafts under (None: fixed depth); a worker with one asks its
  session for `Feature.ADAPTIVE_DEPTH`. wants_context: the draft drafts
  from the committed prefix (its `wants_context`, e.g. the transformer
  pair's): a `Worker` of it asks for CONTEXT frames."""
  propose: Proposer
  many: typing.Callable[[typing.Sequence[Call], int], list[qformats.Rows]]
  forget: typing.Callable[[int], None]
  batched: bool = False    # `many` is one draft call (else one per call)
  admission: admission_lib.AdaptiveDepth | None = None
  wants_context: bool = False

  def __call__(self, seed: int, generation: int, round_id: int, anchor: int,
               last_token: int, depth: int,
               out: qformats.Rows | None = None, *,
               request: int | None = None,
               context: np.ndarray | None = None) -> qformats.Rows:
    return self.propose(seed, generation, round_id, anchor, last_token,
                        depth, out=out, request=request, context=context)


def declared(propose: Proposer | DraftProposer) -> DraftProposer:
  """`propose` with its capabilities declared: a `DraftProposer` as it is;
  any other `Proposer` (a model-specific callable) with none: `many` one
  draw a call (not `batched`), fixed depth, no handles to forget."""
  if isinstance(propose, DraftProposer):
    return propose

  def many(calls: typing.Sequence[Call], depth: int) -> list[qformats.Rows]:
    return [propose(c.seed, c.generation, c.round, c.anchor, c.last_token,
                    depth, request=c.request, context=c.context)
            for c in calls]

  return DraftProposer(propose, many, lambda request: None)
