"""The run's verifier: JAX on this rank, the mesh (built once), the toy
target and the bridge `Verifier` with the run's components, compiled.

Every rank builds it the same way and in the same order: the warm-up's
sharded functions are collectives.
"""

import contextlib
import functools
import typing

import jax
import numpy as np

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax import models
from dyadic_jax.bridge import rank_links
from dyadic_jax.bridge import ranks
from experiments import cli
from experiments import pipeline_config
from experiments.pp1 import flags
from experiments.pp1 import stopwatch
import sharding


def setup_jax(coordinator: str) -> None:
  """Joins the verifier's ranks (--verifier_ranks > 1: one CPU device
  each), or checks that this process has --verifier_devices devices (a
  one-line usage error if not)."""
  count = flags.verifier_ranks()
  if count > 1:
    ranks.initialize(coordinator, count, flags.RANK.value)
    return
  devices = flags.DEVICES.value
  if jax.device_count() < devices:
    backend = jax.default_backend()
    cli.usage_error(
        f"--verifier_devices={devices} needs that many devices; "
        f"{backend} has {jax.device_count()}. "
        + ("Give XLA_FLAGS=--xla_force_host_platform_device_count=N a "
           "count >= the flag, or leave XLA_FLAGS without one (the pipeline "
           "then sets it)" if backend == "cpu" else
           f"Pass --verifier_devices={jax.device_count()}, or run the "
           "verifier on emulated CPU devices with JAX_PLATFORMS=cpu"))


def make_mesh() -> jax.sharding.Mesh:
  """The verifier's requests x vocab mesh: every rank's one device
  (--verifier_ranks > 1), or --verifier_devices of this process's split
  into --verifier_requests groups."""
  ranked = flags.verifier_ranks() > 1
  devices = jax.devices() if ranked else jax.devices()[:flags.DEVICES.value]
  groups = flags.REQUEST_GROUPS.value
  return sharding.make_mesh(requests=groups, vocab=len(devices) // groups,
                            devices=devices)


def deadline() -> bridge.AdaptiveDeadline:
  """Each exchange's deadline: --timeout to --timeout_max, following the
  measured round time."""
  return bridge.AdaptiveDeadline(
      flags.TIMEOUT.value, max(flags.TIMEOUT.value, flags.TIMEOUT_MAX.value))


Wrap = typing.Callable[[typing.Callable[..., typing.Any]],
                       typing.Callable[..., typing.Any]]


class TimedTarget(typing.NamedTuple):
  """A `models.TargetModel` whose calls are timed by `wrap`."""
  model: models.TargetModel
  wrap: Wrap

  @property
  def vocab(self) -> int:
    return self.model.vocab

  def init_state(self) -> models.State:
    return self.model.init_state()

  def logits(self, *args: typing.Any) -> typing.Any:
    return self.wrap(self.model.logits)(*args)


class TimedBatch(typing.NamedTuple):
  """A `models.TargetBatch` whose `rows` and `decode` are timed by `wrap`."""
  batch: models.TargetBatch
  wrap: Wrap

  def rows(self, *args: typing.Any) -> typing.Any:
    return self.wrap(self.batch.rows)(*args)

  def decode(self, *args: typing.Any) -> typing.Any:
    return self.wrap(self.batch.decode)(*args)

  def drop(self, rid: int) -> None:
    self.batch.drop(rid)

  def holds(self, rid: int) -> bool:
    return self.batch.holds(rid)


class TimedSlabTarget(TimedTarget):
  """A `TimedTarget` of a target with a slab (`batch`): the round engine
  scores the whole batch in one timed call."""

  def batch(self, capacity: int) -> TimedBatch:
    model = typing.cast(typing.Any, self.model)
    return TimedBatch(model.batch(capacity), self.wrap)


def timed_target(target: models.TargetModel, wrap: Wrap) -> TimedTarget:
  """`target` with its calls timed, its slab kept where it has one."""
  kind = TimedSlabTarget if hasattr(target, "batch") else TimedTarget
  return kind(target, wrap)


class TimingHook(bridge.RoundHook):
  """The run's round hook: every exchange (STEP out to replies validated:
  the draft + the bridge) is timed as "exchange"."""

  def __init__(self, watch: stopwatch.Stopwatch):
    self.watch = watch

  def around_exchange(self) -> contextlib.AbstractContextManager[None]:
    return self.watch.phase("exchange")


def uniform_q_verify(verify: typing.Callable[..., typing.Any],
                     caps: bridge.Capabilities, logits: typing.Any,
                     q: typing.Any, draft: typing.Any, keys: typing.Any,
                     anchors: typing.Any) -> typing.Any:
  """The mutant: verifies against a uniform q, not the sampled one."""
  del q
  v, (requests, depth) = caps.vocab, np.shape(draft)
  counts = np.full((requests, depth, v), dj.M // v, np.int32)
  counts[..., :dj.M - (dj.M // v) * v] += 1
  return verify(logits, dj.DenseQ(counts), draft, keys, anchors)


def build(config: pipeline_config.PipelineConfig, mesh: jax.sharding.Mesh,
          sharer: typing.Any, watch: stopwatch.Stopwatch,
          hooks: typing.Sequence[bridge.RoundHook] = ()) -> bridge.Verifier:
  """A Verifier over `mesh` with the toy target, compiled (no address yet).

  sharer: the plan sharer of a multi-rank verifier (None: one process);
  hooks: round hooks after the run's timing (a drill's). Everything the
  rounds call is compiled here (`Verifier.warmup`), before the first round
  and on every rank, so that compilation is a phase of its own.
  """
  caps = config.capabilities()
  leader = not flags.RANK.value
  target: models.TargetModel
  if config.model != "toy":
    stopwatch.say(f"start-up: loading the {config.model} pair and cutting "
                  "the held-out prompts")
    flags.held_out_prompts()
  target, _ = flags.models(config)
  verify = functools.partial(sharding.verify_batch, mesh=mesh)
  sample = functools.partial(sharding.sample_target, mesh=mesh)
  if flags.MUTANT.value == "uniform_q":
    verify = functools.partial(uniform_q_verify, verify, caps)
  block = jax.block_until_ready
  all_hooks: list[bridge.RoundHook] = [TimingHook(watch), *hooks]
  validator: rank_links.RankValidator | None = None
  if config.rank_links:
    executor = sharding.executor(mesh)
    assemble = functools.partial(sharding.from_blocks, mesh=mesh)
    if leader:
      # The agreement with the other ranks: validator, plan sharer and the
      # first round hook (the other ranks learn the round first).
      agreement = rank_links.RankRound(
          caps, executor=executor, assemble=assemble, broadcast=sharer)
      validator = sharer = agreement
      all_hooks.insert(0, agreement)
    else:
      validator = rank_links.RankValidator(caps, executor=executor,
                                           assemble=assemble)
  # A follower rank never talks to the worker's session: it holds no
  # session keys (its rank link is opened with its own, `main.follow`).
  secret, curve = (config.link_keys("verifier") if leader
                   else (None, None))
  verifier = bridge.Verifier(
      caps, None, validator=validator, hooks=all_hooks,
      target=timed_target(target, lambda fn: watch.timed(
          "verification", fn, block)),
      verify_fn=watch.timed("verification", verify, block),
      sample_fn=watch.timed("verification", sample, block),
      timeout_s=flags.TIMEOUT.value, deadline=deadline(), sharer=sharer,
      secret=secret, curve=curve,
      sampling_audit=not flags.NO_AUDIT.value,
      request_factory=lambda rid: flags.request_spec(rid, caps.vocab))
  stopwatch.say("compile: the verifier's programs (target rows, "
                "verification, the target-only fallback)")
  with watch.phase("compile", absorb=True):
    verifier.warmup(flags.request_spec(0, config.vocab)[0],
                    say=lambda what: stopwatch.say(f"compile: {what}"))
  stopwatch.say("compile: done")
  return verifier
