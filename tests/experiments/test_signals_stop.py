"""Issue 51, item 1: SIGTERM and SIGINT always stop a program
(experiments/interrupt.py): a flag the loops check and a watchdog, never
an exception raised inside whatever code the main thread runs.

Real programs, real signals: in a GC-heavy phase (JAX's `_xla_gc_callback`
and a slow callback of the program's own: an exception raised there was
printed as "Exception ignored" and the program went on), during the
worker's warm-up compiles (it compiled on, or ended with status 0 and no
word), and in a loop that checks the flag (its `finally` runs). Waits are
bounded by work (a line, the end of the output); a hang fails at a
generous limit, nothing is timed.
"""

import select
import signal
import subprocess
import sys

import pytest

from dyadic_jax.bridge import keys
from tests import paths

_LIMIT_S = 300
_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}

# A program in a GC-heavy phase: every collection runs JAX's gc callback
# and a slow one of its own, where nearly every signal lands.
_GC_PHASE = """\
import gc, sys, time
from experiments import cli, interrupt
mode = sys.argv.pop(1)
if mode == "as_exit":
  interrupt.as_exit()

def slow(*_):
  end = time.perf_counter() + 0.02
  while time.perf_counter() < end:
    pass

def main(argv):
  import jax.numpy as jnp
  keep = [jnp.ones(4) for _ in range(64)]
  gc.callbacks.append(slow)
  print("gc phase", flush=True)
  while True:
    cycle = []
    cycle.append(cycle)
    gc.collect()

cli.run(main)
"""

# A loop that checks the flag at its safe point: it unwinds (finally runs).
_CHECKING_LOOP = """\
import time
from experiments import cli, interrupt

def main(argv):
  try:
    print("looping", flush=True)
    while True:
      interrupt.check()
      time.sleep(0.01)
  finally:
    print("finally ran", flush=True)

cli.run(main)
"""


def _start(tmp_path, name, code, *argv, **env):
  script = tmp_path / f"{name}.py"
  script.write_text(code)
  return subprocess.Popen(
      [sys.executable, str(script), *argv], cwd=tmp_path,
      env=paths.subprocess_env(JAX_PLATFORMS="cpu", **env),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _line(stream, text):
  """Reads `stream` until a line holding `text` (None: it ended first)."""
  while select.select([stream], [], [], _LIMIT_S)[0]:   # a hang: fail
    line = stream.readline()
    if not line:
      return None
    if text in line:
      return line
  raise AssertionError(f"no {text!r} within {_LIMIT_S} s")


def _ends_stopped(proc, program, signum):
  """The process ends by the signal's stop: no exception lost on the way
  (stderr is read as it comes: a swallowed one fails at once)."""
  lines = []
  try:
    while select.select([proc.stderr], [], [], _LIMIT_S)[0]:
      line = proc.stderr.readline()
      if not line:
        break
      lines.append(line.rstrip("\n"))
      assert "Exception ignored" not in line, "\n".join(lines[-20:])
    else:
      raise AssertionError(f"still running after {_LIMIT_S} s")
    proc.wait(_LIMIT_S)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  out = proc.stdout.read()
  proc.stdout.close()
  proc.stderr.close()
  text = "\n".join(lines)
  assert proc.returncode == 128 + signum, text[-3000:]
  assert [l for l in lines if l.strip()][-1] == (
      f"{program}: stopped by {signal.Signals(signum).name}"), text[-3000:]
  assert "Traceback" not in text, text[-3000:]
  return out


@pytest.mark.parametrize("mode", ["unwind", "as_exit"])
@pytest.mark.parametrize("name", sorted(_SIGNALS))
def test_a_signal_in_a_gc_heavy_phase_stops(tmp_path, mode, name):
  proc = _start(tmp_path, "gc_phase", _GC_PHASE, mode,
                DYADIC_JAX_STOP_GRACE_S="1")
  assert _line(proc.stdout, "gc phase")
  proc.send_signal(_SIGNALS[name])
  _ends_stopped(proc, "gc_phase", _SIGNALS[name])


def test_a_loop_that_checks_unwinds(tmp_path):
  proc = _start(tmp_path, "checking", _CHECKING_LOOP,
                DYADIC_JAX_STOP_GRACE_S="3600")    # the loop, not the watchdog
  assert _line(proc.stdout, "looping")
  proc.send_signal(signal.SIGTERM)
  out = _ends_stopped(proc, "checking", signal.SIGTERM)
  assert "finally ran" in out


@pytest.mark.parametrize("name", sorted(_SIGNALS))
def test_the_worker_stops_in_its_warmup_compiles(tmp_path, name):
  """The trained pair's worker given the signal during its warm-up (its
  first compile logged): the watchdog ends it there, it never serves."""
  keys_dir = keys.make(tmp_path / "keys")
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.bridge_worker", "--model=stdlib",
       "--address=tcp://127.0.0.1:0", "--depth=2", "--requests=1",
       f"--keys_dir={keys_dir}"], cwd=paths.ROOT,
      env=paths.subprocess_env(JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1",
                               DYADIC_JAX_STOP_GRACE_S="0"),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert _line(proc.stderr, "Compiling"), "it never compiled"
  proc.send_signal(_SIGNALS[name])
  out = _ends_stopped(proc, "bridge_worker", _SIGNALS[name])
  assert "READY" not in out
