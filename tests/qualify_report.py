"""GPU qualification as a pytest selection: its options and JSON report.

The qualification is every test marked `qualify`: the oracle, row-mode and
sharded identity tests beside the modules they check, and
tests/system/test_qualify.py (the checks no other test makes: no bridge,
64-bit arithmetic, the division, platform facts, the benchmark). A GPU
machine runs it as one command (COMMAND below; docs/guide.md, "Row modes
and GPU qualification"):

    python -m pytest -m qualify --runslow -n 0 -q \\
        --qualify-report=qualify.json \\
        tests/core tests/sharding tests/system/test_qualify.py

The paths keep collection to the files that hold the selection: the rest
of tests/ imports the bridge and wire, which need pyzmq, blake3 and
crc32c, and GPU machines may lack them (test_qualify.py's no-bridge check
collects the selection with those three unimportable). `--runslow`: the
whole grid of the marked tests (the default tier keeps the corners of
the sharded identity grid). `-n 0`: one process, which holds the
accelerator.

Options (registered by tests/conftest.py through `pytest_plugins`):
  --qualify-report=PATH  one JSON file: platform facts (backend, devices,
                         jax and jaxlib, python, row modes, gather) and,
                         per test that ran, its outcome (passed, failed,
                         skipped with the reason), duration and the
                         properties it recorded (`record_property`: the
                         benchmark's figures and speed targets); prints
                         where it went. Kept current as the run goes: a
                         process that dies leaves "complete": false and
                         "running": the test it died in; "process":
                         its memory mappings (now, peak, the kernel's
                         limit: tests/memory_maps.py), cache drops, RSS
                         and threads as of the last write.
  --qualify-full         full sizes on CPU too (V = 129280, bench_core's
                         own defaults); the default on an accelerator.
"""

import json
import os
import platform
import time

import pytest

from tests import memory_maps

PATHS = ("tests/core", "tests/sharding", "tests/system/test_qualify.py")
COMMAND = ("python -m pytest -m qualify --runslow -n 0 -q "
           "--qualify-report=qualify.json " + " ".join(PATHS))


def pytest_addoption(parser):
  group = parser.getgroup("qualify", "GPU qualification (-m qualify)")
  group.addoption("--qualify-report", metavar="PATH", default=None,
                  help="write the run's JSON qualification report to PATH")
  group.addoption("--qualify-full", action="store_true", default=False,
                  help="full qualification sizes on CPU too (the default "
                  "on accelerators)")


def full_size(config) -> bool:
  """Full sizes: asked for, or JAX's default backend is an accelerator."""
  if config.getoption("--qualify-full"):
    return True
  import jax  # pylint: disable=g-import-not-at-top
  return jax.default_backend() != "cpu"


@pytest.fixture(scope="session")
def qualify_full(request) -> bool:
  """Whether the qualification runs at full size (see `full_size`)."""
  return full_size(request.config)


def platform_facts() -> dict:
  """What the report says about the machine and this JAX."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  from dyadic_jax import rowwise  # pylint: disable=g-import-not-at-top
  from sharding import collectives  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  return {
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices],
      "device_count": len(devices),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "row_setting": rowwise.setting(),
      "row_mode_default": rowwise.row_mode(),
      "row_modes_in_jit_key": rowwise.jit_keyed(),
      "gather": collectives.GATHER,
      # 64-bit mode on outside the library's own scope (x64.py).
      "x64_global": jax.numpy.zeros(()).dtype == jax.numpy.float64,
  }


def process_facts() -> dict:
  """This process's resources: its memory mappings (now, and the most seen
  at the end of a test) against the kernel's limit and the budget past
  which tests/memory_maps.py drops JAX's caches, the times it did, its
  resident memory (now, peak) and its threads. Under xdist: the
  controller's (the report's writer)."""
  status = {}
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      status = dict(line.split(":", 1) for line in f if ":" in line)
  except OSError:
    pass
  kb = lambda name: (int(status[name].split()[0]) // 1024
                     if name in status else None)
  maps = memory_maps.mapping_count()
  return {
      "maps": maps,
      "maps_peak": max(maps or 0, memory_maps.peak) or None,
      "map_limit": memory_maps.mapping_limit(),
      "map_budget": memory_maps.budget(),
      "cache_drops": memory_maps.drops,
      "rss_mb": kb("VmRSS"),
      "rss_peak_mb": kb("VmHWM"),
      "threads": int(status["Threads"]) if "Threads" in status else None,
  }


def _message(report) -> str:
  """The failure in one line (the exception's message where there is one)."""
  crash = getattr(report.longrepr, "reprcrash", None)
  if crash is not None:
    return crash.message
  lines = str(report.longrepr).strip().splitlines()
  return lines[-1] if lines else ""


def _skip_reason(report) -> str:
  if hasattr(report, "wasxfail"):
    return f"xfail: {report.wasxfail}"
  if isinstance(report.longrepr, tuple):
    return report.longrepr[2].removeprefix("Skipped: ")
  return str(report.longrepr)


class _Recorder:
  """Collects each test's phases into one entry and keeps the file current.

  The file is rewritten (atomically: a temporary file, then a rename) when
  each test starts and ends, so a run that dies in native code (an abort,
  a segfault, the OOM killer) leaves a report of what had passed so far,
  `"complete": false` and `"running"` naming the test it died in.
  Under xdist it runs in the controller only (the workers' reports reach
  it through pytest_runtest_logreport), so one file is written.
  """

  def __init__(self, config, path):
    self.config = config
    self.path = os.path.abspath(path)
    self.tests = {}
    self.started = time.time()
    self.running = None
    self.platform = None

  def pytest_runtest_logstart(self, nodeid, location):
    del location
    if self.platform is None:  # collected: JAX is configured by now
      self.platform = platform_facts()
    self.running = nodeid
    self._write()

  def pytest_runtest_logfinish(self, nodeid, location):
    del location
    entry = self.tests.get(nodeid)
    if entry and entry["outcome"] == "running":
      entry["outcome"] = "passed"
    self.running = None
    self._write()

  def pytest_runtest_logreport(self, report):
    entry = self.tests.setdefault(report.nodeid, {
        "nodeid": report.nodeid, "outcome": "running", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
    if report.user_properties:
      entry.setdefault("properties", {}).update(
          (k, v) for k, v in report.user_properties)
    if report.skipped:
      entry.update(outcome="skipped", reason=_skip_reason(report))
    elif report.failed:
      # The first failing phase says what went wrong; a later teardown
      # failure does not overwrite it.
      if entry["outcome"] != "failed":
        entry.update(outcome="failed", phase=report.when,
                     message=_message(report),
                     longrepr=str(report.longrepr).splitlines()[-40:])

  def pytest_sessionfinish(self, session, exitstatus):
    del session
    self.running = None
    self.platform = platform_facts()
    self._write(exit_status=int(exitstatus))

  def _write(self, exit_status=None):
    tests = list(self.tests.values())
    report = {
        "command": " ".join(["python -m pytest"] + list(
            self.config.invocation_params.args)),
        "markexpr": self.config.getoption("markexpr"),
        "full_size": full_size(self.config),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z",
                                 time.localtime(self.started)),
        "wall_s": round(time.time() - self.started, 1),
        # False until the session ends: the process died during the run.
        "complete": exit_status is not None,
        "running": self.running,
        "platform": self.platform,
        "process": process_facts(),
        "summary": {o: sum(t["outcome"] == o for t in tests)
                    for o in ("passed", "failed", "skipped")},
        "exit_status": exit_status,
        "tests": tests,
    }
    partial = f"{self.path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2, default=str)
    os.replace(partial, self.path)

  def pytest_terminal_summary(self, terminalreporter):
    terminalreporter.write_line(f"qualify report: {self.path}")


def pytest_configure(config):
  path = config.getoption("--qualify-report")
  if path and not hasattr(config, "workerinput"):  # not an xdist worker
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
      raise pytest.UsageError(
          f"--qualify-report={path}: its directory does not exist")
    config.pluginmanager.register(_Recorder(config, path), "qualify_report")
