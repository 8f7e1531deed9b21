"""The main job's program: the leader rank runs the whole run (its
children, the verifier, the rounds, the record); a follower rank
(--rank >= 1, started by the leader) runs the leader's plans."""

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import tempfile
import time

import jax

from dyadic_jax.bridge import keys
from dyadic_jax.bridge import rank_links
from dyadic_jax.bridge import ranks
from experiments import cli
from experiments import interrupt
from experiments import pipeline_config
from experiments import run_folder
from experiments.pp1 import drills
from experiments.pp1 import flags
from experiments.pp1 import report
from experiments.pp1 import rounds
from experiments.pp1 import stopwatch
from experiments.pp1 import supervisor
from experiments.pp1 import verifier as verifier_lib
import sharding


def main(argv: list[str]) -> int | None:
  del argv
  cli.exit_with_parent()     # a follower rank: never outlives the leader
  # absl shows INFO records; JAX logs its backend probe ("Unable to
  # initialize backend 'tpu'") and the distributed service at INFO.
  logging.getLogger("jax").setLevel(logging.WARNING)
  if flags.RANK.value:
    follow()
    return None
  # A SIGKILLed run's folder (its throwaway keys) is removed here, next time.
  with run_folder.folder("pp1-", _run_parent()) as tmp:
    try:
      return lead(tmp)
    except supervisor.ChildFailed as e:
      sys.stderr.write(f"{cli.program()}: {e}\n")
      return 1


def _run_parent() -> str | None:
  """Where the run's folder goes: the temporary directory, or /tmp when a
  multi-rank run's unix sockets would not fit under it (a sockaddr_un
  holds 107 bytes of path)."""
  multi = flags.verifier_ranks() > 1 or flags.config().worker_ranks > 1
  longest = len(os.path.join(tempfile.gettempdir(), "pp1-12345678",
                             "worker-coordinator99.sock").encode())
  return "/tmp" if multi and longest > supervisor.MAX_SOCKET_PATH else None


def follow() -> None:
  """A verifier rank s >= 1: runs the leader's plans. With rank links it
  receives block s of q on its own link first and takes part in the
  agreement; otherwise it never touches a transport."""
  config = flags.config()
  verifier_lib.setup_jax(flags.COORDINATOR.value)
  mesh = verifier_lib.make_mesh()
  caps = config.capabilities()
  share = ranks.plan_broadcast(caps, counts=not config.rank_links)
  verifier = verifier_lib.build(config, mesh, share,
                                stopwatch.Stopwatch(time.perf_counter()))
  if not config.rank_links:
    verifier.follow()
    jax.distributed.shutdown()
    return
  rank = flags.RANK.value
  secret, curve = config.link_keys("verifier")
  receiver = rank_links.ShardReceiver(
      caps.link(rank), flags.SHARD_ADDRESS.value, secret=secret,
      timeout_s=flags.TIMEOUT.value, deadline=verifier_lib.deadline(),
      curve=curve)
  # The worker rank may still be starting (JAX import, one compile).
  receiver.open(attempts=max(1, int(supervisor.READY_TIMEOUT_S
                                    / flags.TIMEOUT.value)))
  done = rank_links.follow_rounds(
      verifier, receiver, sharding.executor(mesh),
      functools.partial(sharding.from_blocks, mesh=mesh))
  if flags.STATS_OUT.value:
    with open(flags.STATS_OUT.value, "w") as f:
      json.dump({"rank": rank, "rounds": done,
                 **receiver.figures(),
                 "deadline_s": (None if receiver.deadline is None
                                else receiver.deadline.figures()),
                 "counters": receiver.counters.snapshot(),
                 "committed": {str(rid): list(req.tokens)
                               for rid, req in verifier.requests.items()}},
                f)
  receiver.close()
  jax.distributed.shutdown()


def lead(tmp: str) -> int:
  """The leader rank: the whole run, its record and its outputs."""
  watch = stopwatch.Stopwatch(stopwatch.START)
  # Start-up counts from the program's start: the imports are JAX's start.
  with watch.phase("start-up", since=stopwatch.START):
    config = flags.config()
    stopwatch.say(
        f"start-up: model {config.model}, V={config.vocab} q={config.q} requests="
        f"{config.requests} depth={config.depth}; starting the worker "
        f"({config.worker_ranks} process{'es' * (config.worker_ranks > 1)}"
        f"), JAX and the verifier")
    if config.insecure:
      print(pipeline_config.INSECURE_WARNING, file=sys.stderr, flush=True)
    elif config.keys_dir is None:
      # One command stays one command: a throwaway key set, removed with tmp.
      config = dataclasses.replace(config, keys_dir=str(keys.make(
          os.path.join(tmp, "keys"))))
  count = flags.verifier_ranks()
  multiprocess = count > 1
  workers: list[supervisor.WorkerGroup] = []
  followers: list[supervisor.Watch] = []
  proxy, joined = None, False

  def interrupted() -> None:
    # SIGTERM or Ctrl-C (experiments/interrupt.py): no child, no folder (it
    # holds the throwaway secret keys) is left behind.
    supervisor.STOPPING.set()
    supervisor.cleanup(workers, tmp, followers)
    # One still being started (not in `workers` yet) goes too.
    interrupt.signal_children(signal.SIGKILL)
  interrupt.on_interrupt(interrupted)
  try:
    with watch.phase("start-up"):
      if not multiprocess and "force_host_platform_device_count" not in (
          os.environ.get("XLA_FLAGS", "")):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count="
                                   f"{flags.DEVICES.value}").strip()
      # The worker starts (and compiles) while this process does the same.
      on_death = lambda: supervisor.cleanup(workers, tmp, followers)
      workers.append(supervisor.WorkerGroup(config, tmp, on_death, [
          supervisor.link_address(tmp, s)
          for s in range(config.worker_ranks)]))
      coordinator = (supervisor.coordinator_address(tmp, "coordinator")
                     if multiprocess else "")
      shard_links = list(workers[0].addresses)
      fault_link = flags.FAULT_LINK.value
      if flags.FAULTS.value > 0 and fault_link:
        # Between verifier rank s and worker rank s (both start later).
        proxy = drills.proxy(shard_links[fault_link])
        shard_links[fault_link] = proxy.address
      followers.extend(supervisor.start_followers(
          config, tmp, coordinator, shard_links, on_death))
      if multiprocess:
        stopwatch.say(f"start-up: {count} verifier ranks joining "
                      "(jax.distributed, gloo)")
      drill = (drills.WorkerKill(workers, config, tmp, watch, on_death)
               if flags.KILL_AT.value else None)
      # gloo prints "[Gloo] Rank 0 is connected ..." on stdout.
      with (supervisor.stdout_to_devnull() if multiprocess
            else contextlib.nullcontext()):
        verifier_lib.setup_jax(coordinator)
        joined = multiprocess
        stopwatch.say(f"start-up: JAX on {jax.default_backend()}, "
                      f"{jax.device_count()} device(s); building the "
                      "verifier")
        caps = config.capabilities()
        share = (ranks.plan_broadcast(caps, counts=not config.rank_links)
                 if multiprocess else None)
        verifier = verifier_lib.build(config, verifier_lib.make_mesh(),
                                      share, watch,
                                      [drill] if drill else [])
    with watch.phase("worker start-up"):
      stopwatch.say("worker start-up: waiting for the worker (its JAX "
                    "start and compile, then the HELLO)")
      address = workers[0].wait_ready()
      if flags.FAULTS.value > 0 and not fault_link:
        proxy = drills.proxy(address)
        address = proxy.address
      if drill is not None:
        drill.proxy = proxy if not fault_link else None
      verifier.address = address
      verifier.open()
      stopwatch.say(f"worker start-up: session open with the worker at "
                    f"{address}; rounds")
    check = None
    with watch.phase("rounds"):
      if flags.CHECK.value:
        samples = flags.CHECK_SAMPLES.value
        first, run = rounds.first_tokens(verifier, rounds.Progress(
            samples - samples % caps.max_requests, "check"))
      else:
        run = rounds.generate(verifier, rounds.Progress(
            flags.TOKENS.value * caps.max_requests, "tokens"), drill)
    baseline = None
    if config.model != "toy" and not flags.CHECK.value:
      with watch.phase("target-only baseline"):
        stopwatch.say("target-only baseline: the same prompts, one target "
                      "call per token")
        baseline = rounds.target_only(config)
    if flags.CHECK.value:
      with watch.phase("distribution check"):
        check = rounds.distribution_check(first, config)
    with watch.phase("shutdown"):
      verifier.stop_followers()
      verifier.close()
  finally:
    with watch.phase("shutdown"):
      worker_stats = workers[-1].stop() if workers else {}
      if proxy:
        proxy.stop()
      for follower in followers:
        follower.stop()
      if joined:
        # A barrier with the followers' own shutdown: before the wait.
        jax.distributed.shutdown()
      supervisor.wait_followers(followers)
  watch.stop()
  links, agree = report.link_figures(verifier, len(run.results), tmp,
                                     count if config.rank_links else 1)
  record = report.summarize(run, verifier, config, worker_stats, proxy,
                            watch, check, links, agree)
  if baseline is not None:
    record["speed"] = report.speed(record, baseline)
    record["samples"] = report.samples(run, config)
  report.print_summary(record)
  report.write(record)
  if check is not None and check["verdict"] != "pass":
    return 1
  return 0
