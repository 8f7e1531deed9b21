"""No test leaves a process behind, whatever its outcome (issue 51, item 7).

A pytest plugin (tests/conftest.py loads it): each test runs with its own
tag in the environment (`TAG_ENV`), which every process it starts inherits
(`tests.paths.subprocess_env` copies the environment, and so does a bare
`subprocess.Popen`), and so do their children, even one orphaned when its
parent died. When the test ends (passed, failed, errored or interrupted)
every live process that carries the tag is killed; when the session ends,
every one that carries any of this process's tags. Before,
test_worker_process_kill_and_restart failed waiting for READY at load
10-23 and left its bridge_worker running for good.

Also `wait_for_line`: a start-up wait bounded by progress, not by a fixed
deadline: it waits for a line as long as the process is alive and either
prints or uses CPU time (its own or its children's), and fails only when
the process exits or makes no progress at all for `stall_s` seconds. A
loaded machine slows a start-up down; it does not stop it.
"""

import itertools
import os
import queue
import signal
import threading
import typing

import pytest

TAG_ENV = "DYADIC_JAX_TEST_TAG"
_COUNT = itertools.count()
_PREFIX = f"{os.getpid()}:"


def tagged(prefix: str) -> list[int]:
  """Pids of live processes (not this one) whose environment holds a
  TAG_ENV value starting with `prefix`."""
  needle = f"{TAG_ENV}={prefix}".encode()
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = f.read()
      with open(f"/proc/{entry}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if state != "Z" and any(v.startswith(needle) for v in env.split(b"\0")):
      found.append(int(entry))
  return found


def kill_tagged(prefix: str) -> list[int]:
  """SIGKILLs `tagged(prefix)`; returns their pids."""
  pids = tagged(prefix)
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass
  return pids


def _last_pid() -> str:
  """The kernel's most recently assigned pid (/proc/loadavg)."""
  try:
    with open("/proc/loadavg") as f:
      return f.read().split()[-1]
  except OSError:
    return ""


@pytest.fixture(autouse=True)
def no_process_left_behind() -> typing.Iterator[None]:
  tag = f"{_PREFIX}{next(_COUNT)}"
  before = os.environ.get(TAG_ENV)
  os.environ[TAG_ENV] = tag
  first = _last_pid()
  try:
    yield
  finally:
    if before is None:
      os.environ.pop(TAG_ENV, None)
    else:
      os.environ[TAG_ENV] = before
    if _last_pid() != first:      # some process started meanwhile
      kill_tagged(tag)


def pytest_unconfigure(config: typing.Any) -> None:
  del config
  kill_tagged(_PREFIX)


def _cpu_ticks(pid: int) -> int:
  """CPU ticks of `pid` and its reaped children (utime, stime, cutime,
  cstime), plus those of its live children; 0 when gone."""
  total = 0
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    total += sum(int(x) for x in fields[11:15])
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      children = [int(c) for c in f.read().split()]
  except (OSError, ValueError):
    return total
  return total + sum(_cpu_ticks(c) for c in children)


def wait_for_line(proc: typing.Any, stream: typing.Any, prefix: str,
                  stall_s: float = 120.0) -> str:
  """The first line of `stream` (a text pipe of `proc`) that starts with
  `prefix`; the lines before it are dropped, those after it are left in
  the stream. Bounded by progress: AssertionError when the process ends
  first, or when it neither prints nor uses CPU time for `stall_s`
  seconds (a hang, whatever the load)."""
  lines: queue.Queue[str] = queue.Queue()

  def pump() -> None:       # a thread: select cannot see buffered lines
    for line in stream:
      lines.put(line)
      if line.startswith(prefix):
        return
    lines.put("")           # the end of the output

  threading.Thread(target=pump, daemon=True).start()
  seen, idle = _cpu_ticks(proc.pid), 0.0
  while True:
    try:
      line = lines.get(timeout=1.0)
    except queue.Empty:
      ticks = _cpu_ticks(proc.pid)
      idle = 0.0 if ticks != seen else idle + 1.0
      seen = ticks
      if idle >= stall_s:
        raise AssertionError(f"no {prefix!r} and no progress (output or "
                             f"CPU time) for {stall_s:.0f} s") from None
      continue
    if not line:
      proc.wait()
      raise AssertionError(f"exited with status {proc.returncode} before "
                           f"{prefix!r}")
    if line.startswith(prefix):
      return line
    idle = 0.0
