"""Issue 50, item 5: a SIGKILLed leader's 0700 run folder (its throwaway
keys) is removed at the next start (experiments/run_folder.py).

Real processes, real SIGKILLs: a leader killed holding its folder leaves
it; the next start of the same kind removes it, and nothing else (a live
leader's folder, a folder without a record, another kind's, a record from
a reused pid is dead). Then the main job itself: killed after it made its
keys, its folder is gone once the next run starts. No test here reads a
clock; every process a test starts is gone when it ends.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import time

from tests import paths

_HOLD = ("import os, sys, time\n"
         "from experiments import run_folder\n"
         "path = run_folder.make('pp1-', sys.argv[1])\n"
         "with open(os.path.join(path, 'secret.key'), 'w') as f:\n"
         "  f.write('00' * 32)\n"
         "print(path, flush=True)\n"
         "time.sleep(3600)\n")


def _holder(parent):
  """A leader that made its folder under `parent` and waits: (process,
  folder)."""
  proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(parent)],
                          stdout=subprocess.PIPE, text=True,
                          env=paths.subprocess_env())
  return proc, proc.stdout.readline().strip()


def _kill(proc):
  if proc.poll() is None:
    proc.kill()
  proc.wait()
  if proc.stdout:
    proc.stdout.close()


def test_only_dead_leaders_folders_are_reaped(tmp_path):
  from experiments import run_folder  # pylint: disable=g-import-not-at-top
  dead, dead_folder = _holder(tmp_path)
  live, live_folder = _holder(tmp_path)
  try:
    _kill(dead)                      # SIGKILL: no cleanup ran
    assert os.path.isfile(os.path.join(dead_folder, "secret.key"))
    bare = tmp_path / "pp1-norecord"         # being made, or an older run's
    bare.mkdir()
    other = tmp_path / "other-run"           # another kind's folder
    other.mkdir()
    with open(os.path.join(dead_folder, run_folder.LEADER)) as f:
      (other / run_folder.LEADER).write_text(f.read())
    reused = tmp_path / "pp1-reused"         # a live pid, another start
    reused.mkdir()
    pid, _, ns = run_folder.record().split()
    (reused / run_folder.LEADER).write_text(f"{live.pid} 1 {ns}\n")
    foreign = tmp_path / "pp1-foreign"        # another pid namespace
    foreign.mkdir()
    (foreign / run_folder.LEADER).write_text(f"{dead.pid} 1 pid:[1]\n")
    del pid
    assert sorted(run_folder.stale("pp1-", str(tmp_path))) == sorted(
        [dead_folder, str(reused)])
    with run_folder.folder("pp1-", str(tmp_path)) as mine:
      assert not os.path.exists(dead_folder) and not reused.exists()
      assert os.path.isdir(live_folder) and bare.is_dir()
      assert other.is_dir() and foreign.is_dir()
      assert oct(os.stat(mine).st_mode & 0o777) == "0o700"
      assert run_folder.stale("pp1-", str(tmp_path)) == []
    assert not os.path.exists(mine)
  finally:
    _kill(dead)
    _kill(live)


def _absent_platform():
  cuda = importlib.util.find_spec("jax_plugins") and any(
      importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
  return "rocm" if cuda else "cuda"


def _processes_naming(text):
  """Pids of live processes whose command line holds `text`."""
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        if text.encode() in f.read():
          found.append(int(entry))
    except OSError:
      continue
  return found


def _pp1_folders(tmpdir):
  return sorted(p for p in os.listdir(tmpdir) if p.startswith("pp1-"))


def test_a_sigkilled_main_jobs_keys_are_gone_at_the_next_start(tmp_path):
  tmpdir = tmp_path / "tmp"
  tmpdir.mkdir()
  env = paths.subprocess_env(TMPDIR=str(tmpdir))
  command = [sys.executable, "-m", "experiments.pp1_pipeline",
             *paths.pipeline_flags("--vocab=64", "--tokens=2", "--json_out=",
                                   "--plot_out=")]
  leader = subprocess.Popen(command, cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
  try:
    # Until the run has written its throwaway keys (or has ended).
    secret = None
    while leader.poll() is None and secret is None:
      for name in _pp1_folders(tmpdir):
        path = tmpdir / name / "keys" / "secret.key"
        if path.is_file():
          secret = path
      time.sleep(0.05)
    assert secret is not None, leader.stderr.read()
    leader.kill()
    leader.wait()
    assert secret.is_file()          # what a SIGKILL leaves
    # The next start removes it (this one fails at once on its backend).
    run = subprocess.run(command, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300,
                         env=dict(env, JAX_PLATFORMS=_absent_platform()))
    assert run.returncode == 1, run.stderr
    assert _pp1_folders(tmpdir) == [], run.stderr
  finally:
    _kill(leader)
    for pid in _processes_naming(str(tmpdir)):
      os.kill(pid, signal.SIGKILL)
