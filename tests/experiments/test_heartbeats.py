"""Issue 51, item 6: no silent wait. A wait longer than a few seconds
prints a line every DYADIC_JAX_HEARTBEAT_S seconds saying what it waits
for (`cli.heartbeat`): the main job's wait for its worker's READY, and
train_pair after its last step (each phase says what it does, and beats).

Every wait here is bounded by what the program prints (a hang fails at a
generous limit); nothing is timed. The heartbeat's interval is made short
so that a beat comes while the test holds the wait open.
"""

import os
import select
import subprocess
import sys

from experiments import cli
from experiments import corpus
from tests import paths

_LIMIT_S = 300
_EVERY = "DYADIC_JAX_HEARTBEAT_S"     # cli.HEARTBEAT_ENV

# A stand-in worker that prints READY only once the test has seen the
# main job's heartbeat (the gate file), and ends with its parent.
_SLOW_WORKER = """\
import os, sys, time
parent = os.getppid()
while not os.path.exists(sys.argv[1]) and os.getppid() == parent:
  time.sleep(0.01)
print("READY tcp://127.0.0.1:1", flush=True)
while os.getppid() == parent:
  time.sleep(0.05)
"""

# The main job's supervisor waiting for that worker (its wait_ready).
_WAIT = """\
import os, subprocess, sys, types
from experiments.pp1 import supervisor
worker = object.__new__(supervisor.Worker)
worker.proc = subprocess.Popen([sys.executable, "-c", sys.argv[1],
                                sys.argv[2]], stdout=subprocess.PIPE,
                               text=True)
worker.log, worker.name = os.devnull, "worker"
worker.watch = types.SimpleNamespace(stop=lambda: None)
try:
  print(worker.wait_ready(timeout_s=120), flush=True)
finally:
  worker.proc.kill()
  worker.proc.wait()
"""


def test_a_heartbeat_says_what_it_waits_for(monkeypatch, capsys):
  assert cli.HEARTBEAT_ENV == _EVERY
  monkeypatch.setenv(_EVERY, "0.01")
  seen = ""
  with cli.heartbeat("the thing"):
    while seen.count("still waiting") < 2:
      seen += capsys.readouterr().err
  lines = [l for l in seen.splitlines() if l]
  assert lines[0].endswith(": the thing: still waiting (0 s)"), lines


def test_the_main_job_beats_while_its_worker_starts(tmp_path):
  gate = tmp_path / "ready"
  proc = subprocess.Popen(
      [sys.executable, "-c", _WAIT, _SLOW_WORKER, str(gate)], cwd=tmp_path,
      env=paths.subprocess_env(**{_EVERY: "0.01"}),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    beat = None
    while beat is None and select.select([proc.stderr], [], [],
                                         _LIMIT_S)[0]:
      line = proc.stderr.readline()
      if not line:
        break
      if "still waiting" in line:
        beat = line
    assert beat is not None, "no heartbeat while the worker started"
    assert "worker start-up: waiting for the worker's READY" in beat, beat
    gate.touch()
    out, _ = proc.communicate(timeout=_LIMIT_S)
    assert proc.returncode == 0 and out.strip() == "tcp://127.0.0.1:1"
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_train_pair_says_what_it_does_after_its_last_step(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train_pair",
       f"--corpus_root={corpus.stdlib_root() / 'json'}", "--steps=2",
       f"--output_dir={tmp_path / 'pair'}",
       f"--cache_dir={tmp_path / 'cache'}", "--vocab=300", "--max_len=96",
       "--seq_len=64", "--batch=2", "--eval_windows=2", "--log_every=1",
       "--target_d_model=32", "--target_layers=1", "--target_heads=2",
       "--target_d_ff=64", "--draft_d_model=16", "--draft_heads=1",
       "--draft_d_ff=32"], cwd=tmp_path,
      env=paths.subprocess_env(**{_EVERY: "1"}),
      capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  after = proc.stderr.split("step 2/2", 1)[1]
  for phase in ("after training: the target's held-out loss",
                "after training: the draft's held-out loss",
                "after training: the pair's exact acceptance",
                "after training: writing the checkpoint"):
    assert phase in after, after
  assert os.path.isfile(tmp_path / "pair" / "config.json")
