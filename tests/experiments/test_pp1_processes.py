"""The main job's processes against other local processes, and its end on a
signal (real processes, real signals; docs/security.md, "The ranks'
fabric").

* Nothing a rank is told on its command line (readable by every local user
  in /proc) names a port: the jax.distributed coordinators are unix
  sockets in the run's 0700 folder, the rank links ipc sockets there, the
  worker binds port 0 and says which port it got. Before, a port was
  picked, closed and handed on: a squatter that bound it first failed the
  run, and anyone who read the coordinator's port could abort every rank.
* SIGTERM (what `timeout` and a CI cancel send) and SIGINT (Ctrl-C) end a
  run at once: one line, status 128 + the signal, no child and no pp1-*
  folder (it holds the run's throwaway secret keys) left behind.

The default tier signals runs during start-up (seconds); --runslow reads a
TP-2 x TP-2 run's command lines (in a loaded 2-core CI run of the default
tier it once saw one side's coordinator only: under investigation),
signals a multi-rank run in its rounds, squats the restarted worker's port
and attacks a live run's coordinator. Waits are bounded by work (lines,
processes), and a hang ends at a generous limit as a failure.
"""

import os
import pathlib
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests import paths

_LIMIT_S = 300     # a hang fails here; a healthy run never comes near it
_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


class _Run:
  """`python -m experiments.pp1_pipeline FLAGS` with its own TMPDIR; its
  stderr read line by line (`wait_for`)."""

  def __init__(self, tmp_path: pathlib.Path, *flags: str,
               tmpdir: pathlib.Path | None = None):
    self.tmpdir = tmpdir or tmp_path / "tmp"
    self.tmpdir.mkdir(exist_ok=True)
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.pp1_pipeline", "--json_out=",
         "--plot_out=", *paths.pipeline_flags(*flags)], cwd=paths.ROOT,
        env=paths.subprocess_env(TMPDIR=str(self.tmpdir)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    self.lines: list[str] = []

  def wait_for(self, text: str) -> str:
    """Reads stderr up to the first line holding `text` (fails at the end
    of the output: the run ended first)."""
    for line in self.proc.stderr:
      self.lines.append(line)
      if text in line:
        return line
    raise AssertionError(f"{text!r} never came:\n{''.join(self.lines)}")

  def finish(self) -> tuple[int, str]:
    """(status, the rest of stderr) once the program ended."""
    try:
      _, rest = self.proc.communicate(timeout=_LIMIT_S)
    except subprocess.TimeoutExpired:
      self.proc.kill()      # its children die with it (PDEATHSIG)
      _, rest = self.proc.communicate()
      raise AssertionError(f"still running after {_LIMIT_S} s:\n"
                           + "".join(self.lines) + rest) from None
    return self.proc.returncode, "".join(self.lines) + rest

  def folder(self) -> pathlib.Path:
    """The run's own folder (pp1-*), once it exists (a guard, not a
    timing: a run that never makes it under TMPDIR fails here)."""
    deadline = time.monotonic() + _LIMIT_S
    while time.monotonic() < deadline:
      found = list(self.tmpdir.glob("pp1-*"))
      if found:
        return found[0]
      assert self.proc.poll() is None, self.finish()
      threading.Event().wait(0.05)
    self.proc.kill()
    raise AssertionError(f"no pp1-* folder under {self.tmpdir}")


def _descendants(pid: int) -> dict[int, str]:
  """{pid: command line} of every process below `pid`."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  out, todo = {}, [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      try:
        with open(f"/proc/{child}/cmdline", "rb") as f:
          out[child] = f.read().replace(b"\0", b" ").decode()
      except OSError:
        continue
      todo.append(child)
  return out


def _wait_children(run: _Run, count: int) -> dict[int, str]:
  """The run's child processes once `count` of them started."""
  while len(found := _descendants(run.proc.pid)) < count:
    assert run.proc.poll() is None, run.finish()
    threading.Event().wait(0.05)
  return found


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _stopped_cleanly(run: _Run, children: dict[int, str], signum: int,
                     status: int, stderr: str) -> None:
  assert status == 128 + signum, stderr[-3000:]
  name = signal.Signals(signum).name
  assert stderr.rstrip().splitlines()[-1] == f"pp1_pipeline: stopped by {name}"
  assert "Traceback" not in stderr and "exited with status" not in stderr
  assert not os.listdir(run.tmpdir), os.listdir(run.tmpdir)
  assert not [pid for pid in children if _alive(pid)], children


@pytest.mark.parametrize("name", sorted(_SIGNALS))
def test_a_signal_during_start_up_stops_everything(tmp_path, name):
  """A signal while the worker starts: one line, the folder and the
  worker gone (before: SIGTERM left the folder and its keys; SIGINT
  printed a traceback)."""
  run = _Run(tmp_path, "--vocab=1024", "--tokens=4")
  run.folder()
  children = _wait_children(run, 1)
  run.proc.send_signal(_SIGNALS[name])
  _stopped_cleanly(run, children, _SIGNALS[name], *run.finish())


@pytest.mark.slow
@pytest.mark.multidevice
def test_no_rank_is_told_a_port(tmp_path):
  """A TP-2 worker and a TP-2 verifier: no command line names a port (the
  worker leader's tcp port 0 is a request, not a port); the coordinators
  are unix sockets in the run's 0700 folder. Then SIGTERM stops the four
  processes."""
  # Tokens enough that the run is still in its rounds when the last rank
  # has started (the signal ends it).
  # A short TMPDIR: under a long one (pytest's, with xdist) the run's
  # unix sockets would not fit a sockaddr_un and its folder goes to /tmp
  # instead (pp1/main.py, `_run_parent`), where this test would not look.
  short = pathlib.Path(tempfile.mkdtemp(prefix="pp1t-", dir="/tmp"))
  try:
    _no_port_named(_Run(tmp_path, "--vocab=1024", "--tokens=100000",
                        "--timeout=30", "--q=dense", "--worker_ranks=2",
                        "--verifier_ranks=2", tmpdir=short))
  finally:
    shutil.rmtree(short, ignore_errors=True)


def _no_port_named(run: "_Run") -> None:
  folder = run.folder()
  assert stat.S_IMODE(folder.stat().st_mode) == 0o700
  assert folder.stat().st_uid == os.getuid()
  coordinators: set[str] = set()
  children: dict[int, str] = {}
  # Until both sides' ranks are up (the worker's coordinator, the
  # verifier's): a loaded machine starts them one by one.
  deadline = time.monotonic() + 120
  while len(coordinators) < 2:
    assert time.monotonic() < deadline, (coordinators, children)
    children = _wait_children(run, 3)
    for line in children.values():
      for arg in line.split():
        flag, _, value = arg.partition("=")
        if flag in ("--address", "--shard_address", "--coordinator"):
          assert value in ("", "tcp://127.0.0.1:0") or value.startswith(
              ("ipc://" + str(folder) + "/", "unix:" + str(folder) + "/")), arg
        if flag == "--coordinator":
          coordinators.add(value)
    assert run.proc.poll() is None, run.finish()
    threading.Event().wait(0.05)
  assert len(coordinators) == 2, children     # the worker's, the verifier's
  run.proc.send_signal(signal.SIGTERM)
  _stopped_cleanly(run, children, signal.SIGTERM, *run.finish())


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("name", sorted(_SIGNALS))
def test_a_signal_in_the_rounds_of_a_multi_rank_run(tmp_path, name):
  """In the rounds of a TP-2 x TP-2 run (JAX caught SIGTERM there: the run
  went on 113 s past the limit; Ctrl-C left a worker rank's crash dump)."""
  run = _Run(tmp_path, "--vocab=1024", "--tokens=100000", "--timeout=30",
             "--worker_ranks=2", "--verifier_ranks=2")
  run.wait_for("; rounds")
  children = _descendants(run.proc.pid)
  run.proc.send_signal(_SIGNALS[name])
  _stopped_cleanly(run, children, _SIGNALS[name], *run.finish())


@pytest.mark.slow
def test_a_squatter_on_the_dead_workers_port(tmp_path):
  """--kill_worker_at: a process binds the killed worker's port before the
  new worker starts. The new worker takes a fresh port and the verifier
  follows it (before: "port ... is already in use", the run ended, rc 1)."""
  run = _Run(tmp_path, "--vocab=1024", "--tokens=16", "--kill_worker_at=2",
             "--timeout=1.0")
  line = run.wait_for("session open with the worker at tcp://")
  port = int(line.split("tcp://127.0.0.1:")[1].split(";")[0])
  squatter = socket.socket()
  squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  # The port is free from the moment the worker dies: bound then.
  while True:
    try:
      squatter.bind(("127.0.0.1", port))
      break
    except OSError:
      assert run.proc.poll() is None, run.finish()
      threading.Event().wait(0.002)
  squatter.listen()
  try:
    status, stderr = run.finish()
  finally:
    squatter.close()
  assert status == 0, stderr[-3000:]
  assert not os.listdir(run.tmpdir)


_ATTACK = """
import sys
from jax._src.lib import _jax
client = _jax.get_distributed_runtime_client(sys.argv[1], 1, init_timeout=20)
try:
  client.connect()
except Exception as e:
  print("refused:", e)
"""

_TOUCH = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
  s.connect(sys.argv[1])
  print("connected")
except OSError as e:
  print("refused:", e.strerror)
"""


@pytest.mark.slow
@pytest.mark.multidevice
def test_another_process_cannot_abort_the_ranks(tmp_path):
  """A local process reads the verifier ranks' coordinator from a rank's
  command line and joins as task 1 in the middle of the run. Before: every
  rank aborted ("unexpectedly tried to connect with a different
  incarnation", the job exited -6). Now the coordinator is a unix socket
  in the run's 0700 folder: another user cannot connect to it at all (as
  root: checked as `nobody`), and the run ends with every token."""
  run = _Run(tmp_path, "--vocab=1024", "--tokens=48", "--timeout=30",
             "--verifier_ranks=2")
  run.wait_for("; rounds")
  rank1 = [line for line in _descendants(run.proc.pid).values()
           if "--rank=1" in line and "pp1_pipeline" in line]
  address = next(a.partition("=")[2] for a in rank1[0].split()
                 if a.startswith("--coordinator="))
  if address.startswith("unix:"):
    path = address[len("unix:"):]
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    if os.getuid() == 0 and os.path.exists("/usr/bin/python3"):
      touch = subprocess.run(["/usr/bin/python3", "-c", _TOUCH, path],
                             user=65534, capture_output=True, text=True,
                             timeout=60)
      assert touch.stdout.startswith("refused: Permission denied"), touch
  else:
    # What any local user can do to a coordinator on a port.
    subprocess.run([sys.executable, "-c", _ATTACK, address],
                   env=paths.subprocess_env(), capture_output=True,
                   timeout=120, check=False)
  status, stderr = run.finish()
  assert status == 0, stderr[-3000:]


@pytest.mark.slow
@pytest.mark.multidevice
def test_a_rank_that_dies_in_the_rounds_ends_the_run(tmp_path):
  """Verifier rank 1 killed in the rounds of a TP-2 run: the run ends at
  once (its collectives would wait for the dead rank forever) with one
  line naming the rank and the last lines of its output; no child, no
  folder left. A hang fails at _LIMIT_S."""
  run = _Run(tmp_path, "--vocab=1024", "--tokens=100000", "--timeout=30",
             "--verifier_ranks=2")
  run.wait_for("; rounds")
  children = _descendants(run.proc.pid)
  rank1 = [pid for pid, line in children.items()
           if "--rank=1" in line and "pp1_pipeline" in line]
  assert len(rank1) == 1, children
  os.kill(rank1[0], signal.SIGKILL)
  status, stderr = run.finish()
  assert status == 1, stderr[-3000:]
  assert "pp1_pipeline: the verifier rank 1 exited with status -9:" in (
      stderr), stderr[-3000:]
  assert not os.listdir(run.tmpdir), os.listdir(run.tmpdir)
  assert not [pid for pid in children if _alive(pid)], children
