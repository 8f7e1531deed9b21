"""Records the figures the docs quote: docs/figures.json, from real runs.

    python -m experiments.record_figures                  # the main job
    python -m experiments.record_figures --write_readme   # ... and the docs
    python -m experiments.record_figures --commands=acceptance,bench_core
    python -m experiments.record_figures --norecord --write_readme

Each command of --commands runs as a reader runs it, `python -m
experiments.X` with its defaults, in a temporary folder (its outputs land
there, never in the repository) and with XLA_FLAGS and
JAX_COMPILATION_CACHE_DIR removed, so that it starts and compiles from
scratch. Its output is passed through as it comes. For each command
docs/figures.json gets:

  wall_s      the process's wall time, from its start to its exit
  conditions  date, cores (nproc), the load average (1, 5, 15 min) just
              before and just after, a memcpy of 10 MB (numpy, median of
              21) just before and just after, so that a reader can judge
              how fast the machine was; Python, JAX and numpy versions
  stdout      the main job only: what it printed on stdout, verbatim (its
              summary table; progress goes to stderr)
  figures     the main job only: the key figures of its --json_out record
              (tokens, rounds, acceptance, bytes, errors, the time split)

The default records the main job only, so it takes about as long as one
run of it; a command not in --commands keeps its earlier entry, with the
conditions of that earlier run. The main job's plot replaces --plot_out
(the README's figure), so that the picture and the numbers are of one run.

--write_readme then renders, from the JSON, every place the docs quote it
(experiments/figures.py, SLOTS): the README's main-job runtime, its sample
output block and the sentence after it, and the runtime paragraphs of the
pp1_pipeline, acceptance and bench_core docstrings (and so their --help)
and bench_core's in docs/benchmarks.md.
tests/test_figures.py fails when any of them disagrees with the JSON, so
that refreshing the figures is this one command, not hand edits. The test
suite's own runtime is not recorded here.
"""

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import typing

from absl import flags

from experiments import cli
from experiments import figures as figures_lib

_COMMANDS = flags.DEFINE_list(
    "commands", [figures_lib.MAIN_JOB], "The commands to run and record, "
    "each at its defaults: a comma-separated subset of "
    f"{', '.join(figures_lib.COMMANDS)} (the others keep their recorded "
    "entry).")
_FIGURES_JSON = flags.DEFINE_string(
    "figures_json", figures_lib.FIGURES_JSON, "The recorded figures (read, "
    "then replaced); a relative path is relative to the repository root.")
_PLOT_OUT = flags.DEFINE_string(
    "plot_out", "docs/pp1_pipeline.png", "Where the main job's plot of the "
    "recorded run goes ('' for nowhere); relative to the repository root.")
_RECORD = flags.DEFINE_bool(
    "record", True, "Run the commands and record their figures; "
    "--norecord only renders the docs from the JSON as it is (with "
    "--write_readme).")
_WRITE_README = flags.DEFINE_bool(
    "write_readme", False, "Then render the README's figures and the "
    "experiments' runtime paragraphs from the JSON.")


def _in_root(path: str) -> str:
  return os.path.join(figures_lib.ROOT, path) if path else path


cli.check("commands", lambda commands: bool(commands) and set(commands) <= (
    set(figures_lib.COMMANDS)), "--commands must be a comma-separated subset "
          f"of {', '.join(figures_lib.COMMANDS)}")
cli.check("figures_json", lambda path: bool(path) and cli.writable_path(
    _in_root(path)), "--figures_json must be a file path in an existing, "
          "writable folder")
cli.check("plot_out", lambda path: cli.writable_path(_in_root(path)),
          "--plot_out must be a file path in an existing, writable folder")
cli.check(["record", "write_readme"], lambda record, write_readme: (
    record or write_readme), "--norecord records nothing: it needs "
          "--write_readme (render the docs from the JSON as it is)")
cli.parse_flags_early(__name__, extra="experiments")


def _memcpy_ms() -> float:
  """Median time of one numpy copy of 10 MB into a preallocated buffer."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  src = np.ones(figures_lib.MEMCPY_BYTES, np.uint8)
  dst = np.empty_like(src)
  np.copyto(dst, src)                 # the pages are touched before timing
  times = []
  for _ in range(21):
    start = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def _state() -> tuple[list[float], float]:
  """(load average, memcpy of 10 MB in ms) now."""
  return [round(x, 2) for x in os.getloadavg()], round(_memcpy_ms(), 3)


def _version(package: str) -> str | None:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


def _nproc() -> int:
  """What `nproc` says: the cores this process may run on."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def _env() -> dict[str, str]:
  """The environment of a reader's fresh run of a command."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")   # its lines as they come
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (figures_lib.ROOT, env.get("PYTHONPATH")) if p)
  # A device count or a warm compilation cache is not a reader's.
  for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):
    env.pop(name, None)
  return env


def _main_job_figures(record: dict[str, typing.Any]) -> dict[str, typing.Any]:
  """The key figures of the main job's --json_out record."""
  keys = ("config", "tokens", "tokens_dropped", "rounds", "request_rounds",
          "fallback_rounds", "fallbacks_by_code", "mean_accepted",
          "tokens_per_round", "acceptance_by_position",
          "bytes_per_request_round", "errors", "time_s")
  return {k: record[k] for k in keys if k in record}


def _record(command: str, tmp: str) -> dict[str, typing.Any]:
  """Runs `python -m experiments.<command>` in its own folder under tmp."""
  cwd = os.path.join(tmp, command)
  os.mkdir(cwd)
  started = datetime.datetime.now(datetime.timezone.utc)
  load_before, memcpy_before = _state()
  cli.progress(f"{command}: load average {load_before[0]:.2f}, memcpy of "
               f"10 MB {memcpy_before:.2f} ms; running `python -m "
               f"experiments.{command}` with its defaults in {cwd} (its "
               "output follows)")
  start = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-m", f"experiments.{command}"],
                          cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                          text=True)
  stdout = []
  assert proc.stdout is not None
  for line in proc.stdout:
    sys.stderr.write(line)            # the reader sees the run as it goes
    stdout.append(line.rstrip("\n"))
  status = proc.wait()
  wall = time.perf_counter() - start
  if status:
    cli.fail(f"`python -m experiments.{command}` exited with status "
             f"{status}; {_FIGURES_JSON.value} is left as it was")
  load_after, memcpy_after = _state()
  cli.progress(f"{command}: {wall:.1f} s; load average {load_after[0]:.2f}, "
               f"memcpy of 10 MB {memcpy_after:.2f} ms")
  entry: dict[str, typing.Any] = {
      "command": f"python -m experiments.{command}",
      "wall_s": round(wall, 2),
      "conditions": {
          "date": started.strftime("%Y-%m-%d"),
          "started_utc": started.isoformat(timespec="seconds"),
          "nproc": _nproc(),
          "load_average_before": load_before,
          "load_average_after": load_after,
          "memcpy_10mb_ms_before": memcpy_before,
          "memcpy_10mb_ms_after": memcpy_after,
          "python": platform.python_version(),
          "jax": _version("jax"), "jaxlib": _version("jaxlib"),
          "numpy": _version("numpy"),
          "platform": platform.platform(),
          "fresh": "XLA_FLAGS and JAX_COMPILATION_CACHE_DIR unset: every "
                   "program compiled from scratch",
      },
  }
  if command == figures_lib.MAIN_JOB:
    with open(os.path.join(cwd, "pp1_pipeline.json")) as f:
      record = json.load(f)
    entry["stdout"] = stdout
    entry["figures"] = _main_job_figures(record)
    if _PLOT_OUT.value:
      shutil.copyfile(os.path.join(cwd, "pp1_pipeline.png"),
                      _in_root(_PLOT_OUT.value))
  return entry


def _write_json(path: str, figures: dict[str, typing.Any]) -> None:
  """Replaces `path` at once: a failed run never leaves half a file."""
  staged = path + ".tmp"
  with open(staged, "w") as f:
    json.dump(figures, f, indent=1)
    f.write("\n")
  os.replace(staged, path)


def main(argv: list[str]) -> int:
  del argv
  path = _in_root(_FIGURES_JSON.value)
  figures: dict[str, typing.Any] = {"commands": {}}
  if os.path.exists(path):
    figures = figures_lib.load(path)
  elif not _RECORD.value:
    cli.fail(f"{_FIGURES_JSON.value} does not exist: record it first")
  if _RECORD.value:
    commands = [c for c in figures_lib.COMMANDS if c in _COMMANDS.value]
    with tempfile.TemporaryDirectory(prefix="record-figures-") as tmp:
      recorded = {c: _record(c, tmp) for c in commands}
    figures["about"] = (
        "Recorded by `python -m experiments.record_figures` (see its "
        "docstring); the README and the experiments' docstrings quote it, "
        "tests/test_figures.py holds them to it.")
    figures["commands"] = dict(figures.get("commands", {}), **recorded)
    _write_json(path, figures)
    print("recorded:")
    for command, entry in recorded.items():
      print(f"  {command:<14} {entry['wall_s']:7.1f} s  "
            f"{figures_lib.measured(entry)}")
    print(f"wrote {_FIGURES_JSON.value}"
          + (f" and {_PLOT_OUT.value}" if _PLOT_OUT.value
             and figures_lib.MAIN_JOB in recorded else ""))
  if _WRITE_README.value:
    try:
      changed = figures_lib.rewrite_files(figures)
    except figures_lib.SlotError as e:
      cli.fail(f"nothing rewritten: {e}")
    print("rewrote " + (", ".join(changed) if changed else "nothing (the "
                        "docs already agree with the figures)"))
  return 0


if __name__ == "__main__":
  cli.run(main)
