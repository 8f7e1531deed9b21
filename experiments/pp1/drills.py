"""The run's fault drills: a worker killed in the middle of a round and
restarted (--kill_worker_at), and the fault proxy in front of a link
(--inject_faults)."""

import logging
import typing

from dyadic_jax import bridge
from dyadic_jax.testing import proxy as proxy_lib
from experiments import pipeline_config
from experiments.pp1 import flags
from experiments.pp1 import stopwatch
from experiments.pp1 import supervisor


class WorkerKill(bridge.RoundHook):
  """The --kill_worker_at drill: a round hook (pass it to the Verifier)
  and the `rounds.Drill` between rounds.

  After --kill_worker_at rounds the worker's last rank (the whole worker
  when it has one rank) dies in the middle of the next round: once the
  round has begun, before its STEP goes out (`begin`). Then the
  supervisor restarts the worker: every rank (the survivors' collective
  group is broken). The session's link takes a fresh port (a squatter on
  the dead worker's port cannot keep it from starting) and the verifier,
  or the fault proxy in front of it (`proxy`), follows its READY line;
  the rank links are sockets in the run's own folder, the same again.
  """

  proxy: proxy_lib.Proxy | None = None   # set when it fronts the session

  def __init__(self, workers: list[supervisor.WorkerGroup],
               config: pipeline_config.PipelineConfig, tmp: str,
               watch: stopwatch.Stopwatch,
               on_death: typing.Callable[[], None]):
    """workers: the run's worker groups, the live one last (a restart
    appends the new one)."""
    self.workers, self.config, self.tmp = workers, config, tmp
    self.watch, self.on_death = watch, on_death
    self._armed = False

  def begin(self, exchange: typing.Any) -> None:
    if exchange is not None and self._armed:
      group = self.workers[-1]
      group.kill(len(group.ranks) - 1)

  def __call__(self, verifier: bridge.Verifier, rounds: int,
               live: list[int]) -> list[bridge.RoundResult]:
    if rounds != flags.KILL_AT.value or not live:
      return []
    group = self.workers[-1]
    self._armed = True
    try:
      lost = verifier.round(live)
    finally:
      self._armed = False
    logging.info("fault drill: worker rank %d killed; restarting the "
                 "worker (its JAX start and compile)", len(group.ranks) - 1)
    with self.watch.phase("worker restart"):
      group.kill()
      self.workers.append(supervisor.WorkerGroup(
          self.config, self.tmp, self.on_death,
          [supervisor.link_address(self.tmp, s)
           for s in range(len(group.ranks))]))
      address = self.workers[-1].wait_ready()
    if self.proxy is not None:
      self.proxy.retarget(address)
    else:
      verifier.address = address
      if verifier.endpoint is not None:
        # Replaced before the next round (a new socket, a new session).
        verifier.endpoint.lost = True
    logging.info("fault drill: worker restarted")
    return lost


def proxy(address: str) -> proxy_lib.Proxy:
  """The --inject_faults proxy in front of the worker at `address`."""
  kinds = tuple(flags.FAULT_KINDS.value) or proxy_lib.KINDS
  floor = flags.TIMEOUT.value
  ceiling = max(floor, flags.TIMEOUT_MAX.value)
  # deadline_s sets its jitter below the deadline's floor; a held reply is
  # never released before the longest deadline could pass.
  return proxy_lib.Proxy("tcp://127.0.0.1:0", address,
                         rate=flags.FAULTS.value, seed=flags.SEED.value,
                         deadline_s=floor,
                         hold_max_s=max(10.0, 8 * floor, 2 * ceiling),
                         kinds=kinds).start()
