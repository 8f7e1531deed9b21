"""Entry points other than the pipeline on SIGTERM and SIGINT (issue 40,
item 6; the pipeline's own: test_pp1_processes.py). Real runs, real
signals: each ends with status 128 + the signal (the worker: 0, its
counters reported), one line and no traceback, its children gone and its
temporary folder removed. Waits are bounded by work (a line, a child, a
folder); a hang fails at a generous limit, nothing is timed.
"""

import os
import pathlib
import signal
import subprocess
import sys
import threading

import pytest

from dyadic_jax.bridge import keys
from experiments import interrupt
from tests import no_leftovers
from tests import paths

_LIMIT_S = 300
_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _start(tmp_path: pathlib.Path, *argv: str) -> subprocess.Popen:
  tmpdir = tmp_path / "tmp"
  tmpdir.mkdir()
  return subprocess.Popen(
      [sys.executable, "-m", *argv], cwd=paths.ROOT,
      env=paths.subprocess_env(TMPDIR=str(tmpdir), JAX_PLATFORMS="cpu"),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until(predicate, proc: subprocess.Popen):
  """Polls `predicate` until it holds (the run must still be going)."""
  while not (found := predicate()):
    assert proc.poll() is None, proc.communicate(timeout=_LIMIT_S)
    threading.Event().wait(0.05)
  return found


def _stopped(proc: subprocess.Popen, program: str, signum: int,
             tmp_path: pathlib.Path, children: list[int]) -> None:
  _, stderr = proc.communicate(timeout=_LIMIT_S)
  assert proc.returncode == 128 + signum, stderr[-3000:]
  name = signal.Signals(signum).name
  assert stderr.rstrip().splitlines()[-1] == f"{program}: stopped by {name}"
  assert "Traceback" not in stderr, stderr[-3000:]
  assert not os.listdir(tmp_path / "tmp")
  assert not [pid for pid in children if _alive(pid)], children


@pytest.mark.parametrize("name", sorted(_SIGNALS))
def test_the_bridge_worker_ends_quietly(tmp_path, name):
  """A serving worker: it ends at once, status 0, its counters reported
  (before: SIGINT was a KeyboardInterrupt traceback, status 1)."""
  keys_dir = keys.make(tmp_path / "keys")
  proc = _start(tmp_path, "experiments.bridge_worker",
                "--address=tcp://127.0.0.1:0", "--vocab=64", "--depth=2",
                "--requests=1", "--q=sparse", "--k=4",
                f"--keys_dir={keys_dir}")
  no_leftovers.wait_for_line(proc, proc.stdout, "READY ")   # its progress
  proc.send_signal(_SIGNALS[name])
  out, err = proc.communicate(timeout=_LIMIT_S)
  assert proc.returncode == 0, err[-3000:]
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
  assert out.splitlines()[-1].startswith("STATS "), out


@pytest.mark.parametrize("name", sorted(_SIGNALS))
def test_a_benchmark_with_a_child_stops_it(tmp_path, name):
  """bench_curve in its rounds (a child process serves them): one line,
  128 + the signal, the child gone (before: SIGTERM killed the parent
  alone, -15, and left its child waiting; SIGINT printed a traceback)."""
  proc = _start(tmp_path, "experiments.bench_curve",
                "--sparse_messages=1048576", "--dense_messages=1")
  # Its child has started: the signal finds the parent waiting on it or
  # in the rounds, the child starting or serving.
  children = _until(lambda: interrupt.children(proc.pid), proc)
  proc.send_signal(_SIGNALS[name])
  _stopped(proc, "bench_curve", _SIGNALS[name], tmp_path, children)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_SIGNALS))
def test_bench_pair_in_its_bridge_leg(tmp_path, name):
  """bench_pair while its worker serves (a bench_pair-* folder holds the
  worker's keys): the worker and the folder go (before: SIGTERM killed
  bench_pair alone and left both)."""
  proc = _start(tmp_path, "experiments.bench_pair", "--prompts=2",
                "--new_tokens=12", "--formats=dense,16", "--json_out=",
                "--plot_out=", "--nohf")
  _until(lambda: list((tmp_path / "tmp").glob("bench_pair-*")), proc)
  children = _until(lambda: interrupt.children(proc.pid), proc)
  proc.send_signal(_SIGNALS[name])
  _stopped(proc, "bench_pair", _SIGNALS[name], tmp_path, children)
