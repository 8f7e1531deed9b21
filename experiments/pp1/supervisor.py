"""The run's child processes: the worker's ranks and the follower verifier
ranks, started, watched, awaited and stopped; their stderr in logs under
the run's temporary folder.

No JAX here: the leader starts its children while it starts JAX itself.
"""

import contextlib
import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import typing

from experiments import cli
from experiments import pipeline_config
from experiments.pp1 import flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
READY_TIMEOUT_S = 600   # worker start-up: JAX import and one compile
_GROUPS = itertools.count()   # worker groups started (a restart: one more)


class ChildFailed(Exception):
  """A child process failed; the message carries its own error text."""


# A unix socket's path must fit a sockaddr_un (108 bytes, its NUL included).
MAX_SOCKET_PATH = 107


def socket_path(tmp: str, name: str) -> str:
  """`name`'s path in the run's folder, for a unix socket (ValueError if it
  is too long for one: `main` makes the folder short enough)."""
  path = os.path.join(tmp, name)
  if len(path.encode()) > MAX_SOCKET_PATH:
    raise ValueError(f"{path}: too long for a unix socket")
  return path


def coordinator_address(tmp: str, name: str) -> str:
  """A jax.distributed coordinator of the run: a unix socket in its 0700
  folder, so that only this user reaches it (docs/security.md, "The ranks'
  fabric"). Its service has no authentication: any process that connects
  as an existing task aborts every rank. No port, so nothing on a command
  line names one, and nothing can be squatted between a pick and a bind."""
  return "unix:" + socket_path(tmp, f"{name}.sock")


def child_env(devices: int | None = None) -> dict[str, str]:
  """This process's environment for a child: the repository on its path,
  XLA_FLAGS without a device count (or with `devices`)."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get(
      "PYTHONPATH", ""))
  env["XLA_FLAGS"] = " ".join(
      f for f in env.get("XLA_FLAGS", "").split()
      if "force_host_platform_device_count" not in f)
  if devices:
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
  # The child asks to die with this process (`cli.exit_with_parent`): no
  # preexec_fn, which would fork this multi-threaded process.
  env[cli.PARENT_ENV] = str(os.getpid())
  return env


def tail(path: str, lines: int = 6) -> str:
  """The last lines of a child's log, for an error message."""
  try:
    with open(path, errors="replace") as f:
      text = f.read().strip().splitlines()
  except OSError:
    return "(no output)"
  return "\n".join(text[-lines:]) or "(no output)"


def link_address(tmp: str, rank: int) -> str:
  """Where worker rank `rank` binds. The session's link (rank 0): tcp port 0
  (the worker binds a free port and says which in its READY line) or a
  path. A rank link (rank s >= 1): always an ipc socket in the run's 0700
  folder: the follower rank must know it before the worker binds it, and
  a port picked for it could be taken in between (before: a squatter that
  bound it first failed the run)."""
  if rank:
    return "ipc://" + socket_path(tmp, f"pp1-worker{rank}.sock")
  if flags.TRANSPORT.value == "ipc":
    return f"ipc://{tmp}/pp1-worker.sock"   # too long: the worker says so
  return "tcp://127.0.0.1:0"


# Set when the run is being stopped on purpose (a signal): from then on a
# child's death is expected, not an error to report.
STOPPING = threading.Event()


class Watch:
  """A child watched during start-up (`watch`); `stop()` ends the watch
  (a wait that sees the child itself, or a shutdown, takes over)."""

  def __init__(self, proc: typing.Any):
    self.proc = proc
    self.on = True

  def stop(self) -> None:
    self.on = False


def watch(proc: typing.Any, log: str, name: str,
          on_death: typing.Callable[[], None]) -> Watch:
  """Ends this program with the child's error if it dies during start-up.

  Start-up waits (the collective rendezvous of --multiprocess) cannot see
  a dead peer and cannot be interrupted; this thread can see it, and then
  runs `on_death` and exits, until the returned Watch is stopped.
  """
  watching = Watch(proc)

  def run() -> None:
    while watching.on and proc.poll() is None:
      time.sleep(0.2)
    if watching.on and proc.returncode and not STOPPING.is_set():
      sys.stderr.write(f"\n{cli.program()}: the {name} exited with status "
                       f"{proc.returncode}:\n{tail(log)}\n")
      sys.stderr.flush()
      on_death()
      os._exit(1)   # pylint: disable=protected-access
  threading.Thread(target=run, daemon=True).start()
  return watching


class Worker:
  """One worker process: started, awaited, stopped; its stderr in a log."""

  def __init__(self, config: pipeline_config.PipelineConfig, tmp: str,
               on_death: typing.Callable[[], None],
               address: str | None = None, rank: int = 0,
               coordinator: str = ""):
    self.log = os.path.join(tmp, f"worker{rank or ''}.log")
    address = address or link_address(tmp, 0)
    env = child_env()
    env["JAX_PLATFORMS"] = "cpu"   # the worker's draft runs on the host CPU
    ranked = ([f"--rank={rank}", f"--coordinator={coordinator}"]
              if config.worker_ranks > 1 else [])
    with open(self.log, "a") as log:
      self.proc: typing.Any = subprocess.Popen(
          [sys.executable, "-m", "experiments.bridge_worker",
           f"--address={address}", *ranked, *config.to_flags()], cwd=ROOT,
          env=env, stdout=subprocess.PIPE, stderr=log, text=True,
          # A terminal's Ctrl-C reaches this process alone, which stops
          # its children itself (`interrupt`): no child reports a crash.
          start_new_session=True)
    self.address: str | None = None
    self.name = f"worker rank {rank}" if ranked else "worker"
    # A worker that dies while this process compiles ends the run at once.
    self.watch = watch(self.proc, self.log, self.name, on_death)

  def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
    """Blocks until the worker prints READY; ChildFailed if it dies."""
    self.watch.stop()       # from here on, this wait sees it
    # A thread reads the lines: select() on the pipe cannot see a READY
    # line that readline() already pulled into the text buffer with the
    # line before it (gloo's "[Gloo] Rank 0 is connected ..." comes just
    # before READY on a ranked worker), and would wait out the timeout.
    lines: queue.Queue[str] = queue.Queue()
    stdout = self.proc.stdout

    def pump() -> None:
      for line in stdout:
        lines.put(line)
        if line.startswith("READY "):
          return            # the rest (STATS) is `stop`'s to read
      lines.put("")         # end of output

    threading.Thread(target=pump, name="worker-ready", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    # Never silent: a line every few seconds says what it waits for.
    with cli.heartbeat(f"worker start-up: waiting for the {self.name}'s "
                       "READY (its JAX start and compile)"):
      while (left := deadline - time.monotonic()) > 0:
        try:
          line = lines.get(timeout=left)
        except queue.Empty:
          break
        if line.startswith("READY "):
          self.address = line.split()[1]
          return self.address
        if not line:         # end of output: the worker exited
          self.proc.wait()
          raise ChildFailed(f"the worker exited with status "
                            f"{self.proc.returncode} before it was ready:\n"
                            f"{tail(self.log)}")
    self.proc.kill()
    raise ChildFailed(f"the worker was not ready after {timeout_s} s:\n"
                      f"{tail(self.log)}")

  def kill(self) -> None:
    self.proc.kill()
    self.proc.wait()

  def stop(self) -> dict[str, typing.Any]:
    """Stops the worker; returns its STATS counters ({} if none)."""
    self.proc.terminate()
    try:
      out, _ = self.proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      out, _ = self.proc.communicate()
    for line in (out or "").splitlines():
      if line.startswith("STATS "):
        return json.loads(line[6:])
    return {}


class WorkerGroup:
  """The worker's ranks (one process, or --worker_ranks of them with a
  jax.distributed coordinator of their own), started and stopped together;
  `addresses[s]` is where rank s binds (rank 0: the session's link)."""

  def __init__(self, config: pipeline_config.PipelineConfig, tmp: str,
               on_death: typing.Callable[[], None],
               addresses: typing.Sequence[str]):
    # A coordinator of its own per start (a restarted group's is new).
    coordinator = (coordinator_address(tmp, f"worker-coordinator{next(_GROUPS)}")
                   if config.worker_ranks > 1 else "")
    self.addresses = list(addresses)
    self.ranks = [Worker(config, tmp, on_death, a, s, coordinator)
                  for s, a in enumerate(self.addresses)]
    self.stats: list[dict[str, typing.Any]] = []

  def wait_ready(self) -> str:
    """The leader's address, once every rank printed READY."""
    ready = [w.wait_ready() for w in self.ranks]
    self.addresses = ready[:1] + self.addresses[1:]
    return ready[0]

  def kill(self, rank: int | None = None) -> None:
    for w in self.ranks if rank is None else [self.ranks[rank]]:
      if w.proc.poll() is None:
        w.kill()

  def stop(self) -> dict[str, typing.Any]:
    """Stops every rank (the leader first: it tells the others); returns
    the leader's STATS counters and keeps every rank's in `stats`."""
    self.stats = [w.stop() for w in self.ranks]
    return self.stats[0]


def start_followers(config: pipeline_config.PipelineConfig, tmp: str,
                    coordinator: str, shard_links: typing.Sequence[str],
                    on_death: typing.Callable[[], None]) -> list[Watch]:
  """The verifier ranks 1.. as processes of this program (`--rank`), each
  watched; shard_links[s]: where rank s's rank link connects."""
  followers = []
  for rank in range(1, flags.verifier_ranks()):
    log = os.path.join(tmp, f"follower{rank}.log")
    link = [f"--shard_address={shard_links[rank]}"
            if config.rank_links else "--shard_address="]
    if config.keys_dir and not flags.given("keys_dir"):
      link.append(f"--keys_dir={config.keys_dir}")   # the throwaway set
    with open(log, "w") as out:
      proc = subprocess.Popen(
          [sys.executable, "-m", "experiments.pp1_pipeline",
           f"--rank={rank}", f"--coordinator={coordinator}", *link,
           f"--stats_out={tmp}/rank{rank}.json"] + [
               a for a in sys.argv[1:] if not a.startswith("--rank")],
          cwd=ROOT, env=child_env(), stdout=out,
          stderr=subprocess.STDOUT, start_new_session=True)
    # A follower that dies would leave the rendezvous waiting.
    followers.append(watch(proc, log, f"verifier rank {rank}", on_death))
  return followers


def wait_followers(followers: typing.Sequence[Watch]) -> None:
  """Waits for the follower ranks to end (after the leader's shutdown
  barrier); kills one that does not."""
  for follower in followers:
    try:
      follower.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      follower.proc.kill()


def cleanup(workers: typing.Sequence[WorkerGroup], tmp: str,
            followers: typing.Sequence[Watch] = ()) -> None:
  """Last-resort cleanup before an abrupt exit: no orphan, no /tmp litter
  (the run's folder holds its throwaway secret keys)."""
  for group in workers:
    group.kill()
  for follower in followers:
    if follower.proc.poll() is None:
      follower.proc.kill()
      follower.proc.wait()
  shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def stdout_to_devnull() -> typing.Iterator[None]:
  """Silences native code that prints to stdout (gloo's "[Gloo] Rank 0 is
  connected to 1 peer ranks" when the collective group forms)."""
  sys.stdout.flush()
  saved = os.dup(1)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  try:
    yield
  finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)
    os.close(devnull)
