"""A multi-rank verifier: the leader's round plans, broadcast to every rank.

Only the leader rank (process 0) talks to the worker. After validation it
builds a `Plan` (per request: the verdict code, the drafted tokens and the
validated q); `PlanBroadcast(caps)` is the `Verifier`'s plan sharer that
sends it to the other ranks
(`jax.experimental.multihost_utils.broadcast_one_to_all`), so
every rank runs the same verification, or falls back for the same
requests: never a partial commit on one rank and a fallback on another.

A broadcast needs the same shapes on every rank: each plan is padded to
`max_requests` x `max_depth` (request id -1 pads), and its true size
travels with it; followers get back exactly the leader's plan.

`initialize` joins a process to its ranks (`jax.distributed`, one CPU
device each, gloo collectives): the verifier's and a TP worker's ranks
start the same way.
"""

import typing

import jax
from jax.experimental import multihost_utils
import numpy as np

from dyadic_jax.bridge import hello
from dyadic_jax.bridge.effects import Plan
from dyadic_jax.bridge.verifier_session import empty_plan
from dyadic_jax.wire import qformats


def initialize(coordinator: str, count: int, rank: int, *,
               timeout_s: int = 120) -> None:
  """Joins this process as rank `rank` of `count` (`jax.distributed`):
  one CPU device per rank, collectives over gloo.

  coordinator: where rank 0's coordinator service listens, and only there:
  `unix:PATH` (what the pipeline gives: a socket in its 0700 run folder,
  reachable by its user alone) or host:port (jax's own default would
  listen on every interface). The service has no authentication: a
  process that connects as an existing task aborts every rank
  (docs/security.md, "The ranks' fabric"). Call it before anything starts
  JAX's backend (the CPU device count and the collectives are read then).
  Returns once every rank joined, or raises after `timeout_s` seconds.
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", 1)
  # Its SIGTERM handler records a "preemption" and lets the process run
  # on: a stopped run must stop (experiments/interrupt.py).
  jax.config.update("jax_enable_preemption_service", False)
  jax.distributed.initialize(coordinator, num_processes=count,
                             process_id=rank,
                             initialization_timeout=timeout_s,
                             coordinator_bind_address=coordinator)


def broadcast(value: typing.Any, leader: bool) -> typing.Any:
  """The leader's `value` (a pytree of arrays) on every rank, as numpy."""
  with jax.enable_x64(True):   # int64 stays int64: no silent int32 cast
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(
        value, is_source=leader))


def allgather(value: typing.Any) -> typing.Any:
  """Every rank's `value` (a pytree of arrays), stacked in rank order."""
  with jax.enable_x64(True):
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(value))


def pad(plan: Plan, caps: hello.Capabilities,
        counts: bool = True) -> tuple[np.ndarray, Plan]:
  """(size int64[2], plan padded to max_requests x max_depth, numpy);
  without `counts` (or a format without q) the q stays behind (None)."""
  r, d = plan.rows.tokens.shape
  big = empty_plan(caps, [-1] * caps.max_requests,
                   [(0, 0)] * caps.max_requests, [0] * caps.max_requests,
                   caps.max_depth)
  big.rids[:r] = plan.rids
  big.tags[:r] = plan.tags
  big.codes[:r] = plan.codes
  big.lengths[:r] = plan.lengths
  for name in ("tokens", "n", "ids"):
    a = getattr(big.rows, name)
    if a is not None:
      a[:r, :d] = getattr(plan.rows, name)
  q = None
  if counts and caps.format.has_values:
    q = np.zeros(big.rows.tokens.shape + (caps.width,), np.int32)
    if plan.counts is not None:
      q[:r, :d] = np.asarray(plan.counts)
  return np.array([r, d], np.int64), big._replace(
      counts=q, stop=np.asarray(plan.stop, np.int32), key=int(plan.key))


def unpad(size: np.ndarray, plan: Plan) -> Plan:
  """The leader's plan from its padded broadcast; its counts (numpy here)
  become a JAX array on this process's device, as a validator's are."""
  r, d = (int(x) for x in size)
  ids = plan.rows.ids
  rows = qformats.Rows(plan.rows.tokens[:r, :d], plan.rows.n[:r, :d],
                       None if ids is None else ids[:r, :d])
  counts = plan.counts
  if counts is not None:
    counts = jax.device_put(counts[:r, :d], jax.local_devices()[0])
  return Plan(plan.rids[:r], plan.tags[:r], plan.codes[:r], rows, counts,
              plan.stop, plan.lengths[:r], int(plan.key))


class PlanBroadcast:
  """The plan sharer of a multi-rank `Verifier`: rank 0's plan, on every
  rank (`jax.experimental.multihost_utils`)."""

  def __init__(self, caps: hello.Capabilities, *, counts: bool = True):
    """counts=False: the plan travels without its q (rank links: every
    rank already holds the checked counts, `rank_links`): the leader keeps
    its own, a follower gets None."""
    self.caps = caps
    self.counts = counts

  def share(self, plan: Plan | None) -> Plan:
    """On the leader: its round's plan, sent. On a follower (None): the
    leader's next plan."""
    leader = jax.process_index() == 0
    mine = plan
    if plan is None:
      plan = empty_plan(self.caps, [-1], [(0, 0)], [0], self.caps.max_depth)
    size, padded = broadcast(pad(plan, self.caps, self.counts), leader)
    out = unpad(size, padded)
    if leader and mine is not None:
      out = out._replace(counts=mine.counts)   # no copy of its own q
    return out

  def stop(self) -> None:
    """Leader: tells the follower ranks that there are no more rounds."""
    r = self.caps.max_requests
    plan = empty_plan(self.caps, [0] * r, [(0, 0)] * r, [0] * r,
                      self.caps.max_depth)
    self.share(plan._replace(stop=np.ones((), np.int32)))


def plan_broadcast(caps: hello.Capabilities, *,
                   counts: bool = True) -> PlanBroadcast:
  """The `PlanBroadcast` of `caps` (see there)."""
  return PlanBroadcast(caps, counts=counts)
