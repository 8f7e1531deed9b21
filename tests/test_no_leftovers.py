"""Issue 51, item 7: no test leaves a process behind, whatever its outcome,
and start-up waits are bounded by progress (tests/no_leftovers.py).

An inner pytest run (a subprocess with the plugin) whose tests start
processes and fail, pass or leave an orphan behind: once it ends, none of
them is alive. Then `wait_for_line` finds a line after others, fails when
the process exits first, and fails a process that makes no progress at
all (it sleeps) without waiting out a fixed deadline. Nothing is timed.
"""

import os
import subprocess
import sys
import textwrap

from tests import paths

_INNER = textwrap.dedent('''\
    import os, subprocess, sys
    import pytest
    from tests import no_leftovers

    SLEEP = [sys.executable, "-c", "import time; print('up', flush=True); "
             "time.sleep(3600)"]

    def _record(name, pid):
        with open(os.path.join(os.environ["PIDS"], name), "w") as f:
            f.write(str(pid))

    def test_fails_with_its_child_running():
        child = subprocess.Popen(SLEEP, stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
        _record("failed", child.pid)
        assert False, "a failure, its child still running"

    def test_passes_with_an_orphan_running():
        # The child starts a grandchild and exits: the grandchild is
        # nobody's child here any more.
        code = ("import subprocess, sys; p = subprocess.Popen(sys.argv[1:], "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                "print(p.pid, flush=True)")
        out = subprocess.run([sys.executable, "-c", code, *SLEEP],
                             capture_output=True, text=True, check=True)
        _record("orphan", int(out.stdout.split()[0]))

    def test_errors_in_teardown_with_a_child(request):
        child = subprocess.Popen(SLEEP, stdout=subprocess.PIPE, text=True)
        _record("errored", child.pid)
        request.addfinalizer(lambda: 1 / 0)

    def test_wait_for_line_finds_it_after_other_lines():
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('a'); print('b'); "
             "print('READY x', flush=True); import time; time.sleep(3600)"],
            stdout=subprocess.PIPE, text=True)
        assert no_leftovers.wait_for_line(
            proc, proc.stdout, "READY ") == "READY x\\n"

    def test_wait_for_line_fails_when_it_exits_first():
        proc = subprocess.Popen([sys.executable, "-c", "print('no')"],
                                stdout=subprocess.PIPE, text=True)
        with pytest.raises(AssertionError, match="exited with status 0"):
            no_leftovers.wait_for_line(proc, proc.stdout, "READY ")

    def test_wait_for_line_fails_a_process_that_makes_no_progress():
        proc = subprocess.Popen(SLEEP, stdout=subprocess.PIPE, text=True)
        with pytest.raises(AssertionError, match="no progress"):
            no_leftovers.wait_for_line(proc, proc.stdout, "READY ",
                                       stall_s=2)
''')


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def test_no_process_outlives_its_test_whatever_the_outcome(tmp_path):
  (tmp_path / "test_inner.py").write_text(_INNER)
  pids = tmp_path / "pids"
  pids.mkdir()
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "tests.no_leftovers",
       "-p", "no:cacheprovider", "-q", "test_inner.py"], cwd=tmp_path,
      env=paths.subprocess_env(PIDS=str(pids)), capture_output=True,
      text=True, timeout=300)
  summary = run.stdout.strip().splitlines()[-1]
  assert "1 failed, 5 passed, 1 error" in summary, run.stdout[-3000:]
  recorded = {p.name: int(p.read_text()) for p in pids.iterdir()}
  assert sorted(recorded) == ["errored", "failed", "orphan"], recorded
  left = {name: pid for name, pid in recorded.items() if _alive(pid)}
  for pid in left.values():
    os.kill(pid, 9)
  assert not left, f"left running: {left}"
