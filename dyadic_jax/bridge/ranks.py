"""A multi-rank verifier: the leader's round plans, broadcast to every rank.

Only the leader rank (process 0) talks to the worker. After validation it
builds a `Plan` (per request: the verdict code, the drafted tokens and the
validated q); `plan_broadcast(caps)` is the `share_fn` that sends it to the
other ranks (`jax.experimental.multihost_utils.broadcast_one_to_all`), so
every rank runs the same verification, or falls back for the same
requests: never a partial commit on one rank and a fallback on another.

A broadcast needs the same shapes on every rank: each plan is padded to
`max_requests` x `max_depth` (request id -1 pads), and its true size
travels with it; followers get back exactly the leader's plan.
"""

import typing

import jax
from jax.experimental import multihost_utils
import numpy as np

from dyadic_jax.bridge.effects import Plan
from dyadic_jax.bridge.verifier_session import empty_plan


def broadcast(value: typing.Any, leader: bool) -> typing.Any:
  """The leader's `value` (a pytree of arrays) on every rank, as numpy."""
  with jax.enable_x64(True):   # int64 stays int64: no silent int32 cast
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(
        value, is_source=leader))


def allgather(value: typing.Any) -> typing.Any:
  """Every rank's `value` (a pytree of arrays), stacked in rank order."""
  with jax.enable_x64(True):
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(value))


def pad(plan, caps, counts=True):
  """(size int64[2], plan padded to max_requests x max_depth); without
  `counts` the q rows stay behind ([R, D, 0])."""
  r, d = plan.draft.shape
  big = empty_plan(caps, [-1] * caps.max_requests,
                   [(0, 0)] * caps.max_requests, [0] * caps.max_requests,
                   caps.max_depth)
  if not counts:
    big = big._replace(counts=big.counts[..., :0])
  big.rids[:r] = plan.rids
  big.tags[:r] = plan.tags
  big.codes[:r] = plan.codes
  big.draft[:r, :d] = plan.draft
  big.n[:r, :d] = plan.n
  if big.ids.shape[-1]:
    big.ids[:r, :d] = plan.ids
  if big.counts.shape[-1]:
    big.counts[:r, :d] = np.asarray(plan.counts)
  return np.array([r, d], np.int64), big._replace(stop=np.asarray(
      plan.stop, np.int32))


def unpad(size, plan):
  r, d = (int(x) for x in size)
  return Plan(plan.rids[:r], plan.tags[:r], plan.codes[:r],
              plan.draft[:r, :d], plan.ids[:r, :d], plan.counts[:r, :d],
              plan.n[:r, :d], plan.stop)


def plan_broadcast(caps: typing.Any, *, counts: bool = True
                   ) -> typing.Callable[[Plan | None], Plan]:
  """A `share_fn` for `Verifier`: rank 0's plan, on every rank.

  On the leader it takes the round's plan; on a follower its argument is
  ignored (None) and it returns the leader's next plan. counts=False: the
  plan travels without its q (rank links: every rank already holds the
  checked counts of its own block, `rank_links`); its counts are then
  [R, D, 0].
  """
  def share(plan):
    leader = jax.process_index() == 0
    if plan is None:
      plan = empty_plan(caps, [-1], [(0, 0)], [0], caps.max_depth)
    size, padded = broadcast(pad(plan, caps, counts), leader)
    return unpad(size, Plan(*padded))
  return share
