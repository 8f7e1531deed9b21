"""GPU qualification: the checks no other test makes, and the report.

The qualification is the tests marked `qualify` (the command and the
report: tests/qualify_report.py). Most of them sit beside what they check:
the allocation and verification oracles on adversarial rows
(tests/core/test_allocation.py, test_verification.py), batches against
rows and the two row modes (test_row_modes.py, test_proposal.py), the
64-bit scope (test_weights.py), the sharded ops against their
single-device twins (tests/sharding/test_ops.py, test_collectives.py).
This file holds the rest: the selection imports neither the bridge nor the
packages GPU machines lack, float64/int64/uint64 arithmetic on the device,
the library's division against IEEE 1 / z, the platform facts, and
experiments/bench_core.py with its speed targets; then the power of the
division check (a mutant fails it), the report plugin itself, and a run
kept under the kernel's cap on memory mappings (tests/memory_maps.py).

Sizes: small on CPU; full (bench_core at V = 129280) on an accelerator or
with --qualify-full.
"""

import json
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import draws
from dyadic_jax import reference as ref
from dyadic_jax import weights
from tests import qualify_report
from tests.paths import ROOT

pytest_plugins = ["pytester"]

# What GPU machines may lack (the bridge's and the wire's dependencies).
_MISSING = ("zmq", "blake3", "crc32c")


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory):
  """An environment in which _MISSING cannot be imported (package shims
  that raise ImportError, first on PYTHONPATH), as on a GPU machine."""
  shim = tmp_path_factory.mktemp("shim")
  for name in _MISSING:
    (shim / name).mkdir()
    (shim / name / "__init__.py").write_text(
        f"raise ImportError('{name} is not installed here (test shim)')\n")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(shim), ROOT] + [p for p in env.get("PYTHONPATH", "").split(
          os.pathsep) if p])
  return env


# Collects the selection as the GPU command does, then lists what it loaded
# of the bridge and of _MISSING. (Wire modules that need none of _MISSING,
# e.g. its error codes, may load.)
_COLLECT = """
import sys
import pytest
missing = {missing!r}
for name in missing:
  try:
    __import__(name)
  except ImportError:
    pass
  else:
    sys.exit(f"the shim does not hide {{name}}")
rc = pytest.main(["--collect-only", "-q", "-m", "qualify",
                  "-p", "no:cacheprovider", *{paths!r}])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in missing
                or m.startswith("dyadic_jax.bridge"))
print("loaded:", loaded)
sys.exit(int(rc) or bool(loaded))
"""


@pytest.mark.qualify
def test_selection_needs_no_bridge(without_extras, record_property):
  run = subprocess.run(
      [sys.executable, "-c", _COLLECT.format(missing=_MISSING,
                                             paths=qualify_report.PATHS)],
      cwd=ROOT, env=without_extras, capture_output=True, text=True,
      timeout=600, check=False)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-4000:]
  assert "loaded: []" in out
  selected = re.search(r"(\d+)/\d+ tests collected", out)
  assert selected and int(selected.group(1)) > 0, out[-2000:]
  record_property("selected", int(selected.group(1)))


@pytest.mark.qualify
def test_fp64_int64_on_the_device():
  # Results that float32 or int32 would change. (The library's own 64-bit
  # scope and its X64Required guard: tests/core/test_weights.py.)
  with jax.enable_x64(True):
    tiny = jax.jit(lambda a, b: (a + b) - a)(jnp.float64(1.0),
                                             jnp.float64(2.0 ** -40))
    assert tiny.dtype == jnp.float64 and float(tiny) == 2.0 ** -40
    x = np.linspace(-700.0, 700.0, 4001)  # float32 exp overflows past 88
    e = np.asarray(jax.jit(jnp.exp)(x))
    assert e.dtype == np.float64
    assert np.max(np.abs(e - np.exp(x)) / np.exp(x)) < 1e-14
    prod = jax.jit(lambda a: a * np.int64(2 ** 20 + 3))(np.int64(2 ** 40 + 7))
    assert int(prod) == (2 ** 40 + 7) * (2 ** 20 + 3)
    u = np.random.default_rng(0).integers(0, 2 ** 64, size=(2, 4096),
                                          dtype=np.uint64)
    u[:, :4] = [[0, 1, 2 ** 64 - 1, 2 ** 63], [2 ** 64 - 1, 2 ** 64 - 1, 2, 3]]
    hi = np.asarray(jax.jit(draws.mulhi64)(u[0], u[1]))
    assert hi.dtype == np.uint64
    assert hi.tolist() == [(int(a) * int(b)) >> 64 for a, b in zip(*u)]
  probs = np.full((1, 1000), 1e-3)
  _, total = dj.quantize_target(probs)
  assert np.asarray(total).dtype == np.int64
  assert int(total[0]) == sum(ref.quantize_target(probs[0]))


def _check_division(record=lambda name, value: None):
  """weights.reciprocal == numpy's IEEE 1 / z, bit for bit.

  On CPU the library divides one scalar at a time; on accelerators it is
  the vector 1.0 / z, which only a device can qualify (docs/numerics.md,
  section 11). Uniform exponents over 2^-40..2^40, integers up to 2^21 and
  edge values, in three layouts. The vector division is measured too, and
  held to the same standard on accelerators.
  """
  gen = np.random.default_rng(1)
  z = np.concatenate([
      2.0 ** gen.uniform(-40, 40, 16384), gen.uniform(1.0, 2.0 ** 21, 16384),
      [1.0, 3.0, 5.0, 7.0, 1 / 3, 129280.0, 2.0 ** 52 + 1, 2.0 ** -1022]])
  want = 1.0 / z
  lib_bad = vector_bad = 0
  with jax.enable_x64(True):
    lib = jax.jit(weights.reciprocal)  # looked up now: a mutant is seen
    vector = jax.jit(lambda z: 1.0 / z)
    for shape in [(z.size,), (8, z.size // 8), (z.size // 4, 4)]:
      n = int(np.prod(shape))
      zz, ww = z[:n].reshape(shape), want[:n].reshape(shape)
      lib_bad += int(np.sum(np.asarray(lib(zz)) != ww))
      vector_bad += int(np.sum(np.asarray(vector(zz)) != ww))
  record("values", int(z.size))
  record("library_mismatches", lib_bad)
  record("vector_division_mismatches", vector_bad)
  assert lib_bad == 0, (f"weights.reciprocal: {lib_bad} quotients are not "
                        "correctly rounded")
  if jax.default_backend() != "cpu":
    assert vector_bad == 0, (f"vector 1.0 / z: {vector_bad} quotients are "
                             "not correctly rounded on this device")


@pytest.mark.qualify
def test_division_is_ieee(record_property):
  _check_division(record_property)


def test_division_check_fails_a_reciprocal_one_ulp_up(monkeypatch):
  # Power: the same check fails a reciprocal rounded one ulp up. Only the
  # fresh jit inside the check sees the mutant (no library op is traced
  # while it is in place).
  exact = weights.reciprocal

  def one_ulp_up(z):
    r = exact(z)
    return jnp.nextafter(r, jnp.full_like(r, jnp.inf))

  monkeypatch.setattr(weights, "reciprocal", one_ulp_up)
  with pytest.raises(AssertionError, match="not correctly rounded"):
    _check_division()


@pytest.mark.qualify
def test_platform_facts(record_property):
  facts = qualify_report.platform_facts()
  for name, value in facts.items():
    record_property(name, value)
  assert facts["device_count"] == len(jax.local_devices()) >= 1
  assert facts["row_setting"] in ("auto", "loop", "batched")
  if facts["row_setting"] == "auto":
    assert facts["row_mode_default"] == (
        "loop" if facts["backend"] == "cpu" else "batched")
  # Both row modes run in one process: safe only with keyed jit caches.
  assert facts["row_modes_in_jit_key"]
  # The library scopes its own 64-bit mode; a global one would hide the
  # X64Required guard's failure mode from the tests.
  assert not facts["x64_global"]


_BENCH_QUICK = ["--vocab=2000", "--requests=2", "--depth=2", "--ks=32",
                "--repeats=1", "--nohf"]
_BENCH_FULL = [f"--vocab={dj.DEFAULT_VOCAB}", "--repeats=5"]


@pytest.mark.qualify
# Under --runslow (which the qualification command passes): on CPU it is
# compile time (about 30 s) for ops whose results tests/core checks.
@pytest.mark.slow
@pytest.mark.long(minutes=2)
def test_benchmark(qualify_full, without_extras, record_property, tmp_path):
  # bench_core asserts that the library's results equal the numpy ones; its
  # speed targets are recorded (judged only at full size), never asserted:
  # no test asserts on a clock.
  path = tmp_path / "bench_core.json"
  args = ["-m", "experiments.bench_core", f"--json_out={path}"] + (
      _BENCH_FULL if qualify_full else _BENCH_QUICK)
  record_property("bench_command", "python " + " ".join(args))
  run = subprocess.run([sys.executable] + args, cwd=ROOT, env=without_extras,
                       capture_output=True, text=True,
                       timeout=1800 if qualify_full else 900, check=False)
  print(run.stdout[-6000:])
  assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
  record = json.loads(path.read_text())
  record_property("bench_backend", record["backend"])
  record_property("bench_results", record["results"])
  targets = [dict(t, judged=qualify_full) for t in record["targets"]]
  record_property("speed_targets", targets)
  assert targets
  missed = [f"{t['target']} ({t['detail']})" for t in targets
            if not t["pass"]]
  if qualify_full and missed:
    warnings.warn("speed targets missed: " + "; ".join(missed))


# The report plugin and the selection's command.


_INNER = """
import pytest

def test_ok(record_property):
  record_property("figure", 3)

def test_bad():
  assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skipped():
  pass
"""


def test_report_records_each_outcome(pytester, tmp_path):
  pytester.makepyfile(test_inner=_INNER)
  path = tmp_path / "report.json"
  result = pytester.runpytest_inprocess("-p", "tests.qualify_report",
                                        f"--qualify-report={path}")
  result.assert_outcomes(passed=1, failed=1, skipped=1)
  assert f"qualify report: {path}" in result.stdout.str()
  report = json.loads(path.read_text())
  assert report["summary"] == {"passed": 1, "failed": 1, "skipped": 1}
  assert report["exit_status"] == 1
  assert report["complete"] is True and report["running"] is None
  assert report["platform"]["backend"] == jax.default_backend()
  assert report["platform"]["jax"] == jax.__version__
  tests = {t["nodeid"].rsplit("::", 1)[1]: t for t in report["tests"]}
  assert tests["test_ok"]["outcome"] == "passed"
  assert tests["test_ok"]["properties"] == {"figure": 3}
  assert tests["test_bad"]["outcome"] == "failed"
  assert tests["test_bad"]["phase"] == "call"
  assert "one is not two" in tests["test_bad"]["message"]
  assert tests["test_skipped"]["outcome"] == "skipped"
  assert tests["test_skipped"]["reason"] == "not here"
  assert all(t["duration_s"] >= 0 for t in report["tests"])


_DIES = """
import os

def test_first():
  pass

def test_dies():
  os.abort()  # as XLA aborts the process: no Python exception, no hook

def test_never_runs():
  pass
"""


def test_report_survives_a_process_that_dies(pytester, tmp_path,
                                             monkeypatch):
  # The report is kept current: a run killed mid-test leaves one that says
  # so and names the test.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
  pytester.makepyfile(test_inner=_DIES)
  path = tmp_path / "report.json"
  result = pytester.runpytest_subprocess(
      "-p", "tests.qualify_report", "-p", "no:cacheprovider",
      f"--qualify-report={path}")
  assert result.ret != 0
  report = json.loads(path.read_text())
  assert report["complete"] is False and report["exit_status"] is None
  assert report["running"].endswith("::test_dies")
  tests = {t["nodeid"].rsplit("::", 1)[1]: t for t in report["tests"]}
  assert tests["test_first"]["outcome"] == "passed"
  assert "test_never_runs" not in tests
  assert report["platform"]["jax"] == jax.__version__


# Issue 42 in small: one process compiling program after program, as the
# qualification does (it reached the kernel's cap on memory mappings in
# tests/sharding/test_ops.py, and XLA died). The budget is set a few
# programs above the process's mappings once JAX is up; each new program
# adds tens of mappings, so without tests/memory_maps.py, registered by
# the project's conftest loaded here as the command loads it, the run
# ends hundreds above it.
_PROGRAMS = """
import os
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import dyadic_jax as dj
from tests import memory_maps

jax.jit(jnp.sin)(1.0).block_until_ready()  # the client and its threads
os.environ["DYADIC_JAX_TEST_MAP_BUDGET"] = str(
    memory_maps.mapping_count() + {headroom})

@pytest.mark.parametrize("v", range(100, 100 + {programs}))
def test_compiles_new_programs(v):
  rows = np.random.default_rng(v).normal(size=(2, v)).astype(np.float32)
  jax.block_until_ready(dj.draft_weights(rows))  # ~50 mappings each
"""


@pytest.mark.skipif(qualify_report.memory_maps.mapping_limit() is None,
                    reason="no /proc/sys/vm/max_map_count (not Linux)")
def test_a_long_run_stays_under_its_mappings_budget(pytester, tmp_path,
                                                    monkeypatch):
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
  monkeypatch.delenv("DYADIC_JAX_TEST_MAP_BUDGET", raising=False)
  headroom, programs = 150, 12
  pytester.makepyfile(test_inner=_PROGRAMS.format(headroom=headroom,
                                                  programs=programs))
  path = tmp_path / "report.json"
  result = pytester.runpytest_subprocess(
      "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
      f"--qualify-report={path}")
  assert result.ret == 0, result.stdout.str()[-3000:]
  report = json.loads(path.read_text())
  assert report["complete"] is True
  assert report["summary"]["passed"] == programs
  process = report["process"]
  budget = process["map_budget"]
  assert process["cache_drops"] >= 2, process
  # Past the budget by at most the few programs of one test or two.
  assert process["maps_peak"] < budget + headroom, process


def test_report_directory_must_exist(pytester):
  pytester.makepyfile(test_inner="def test_ok():\n  pass\n")
  result = pytester.runpytest_inprocess(
      "-p", "tests.qualify_report", "--qualify-report=/nonexistent/r.json")
  assert result.ret == pytest.ExitCode.USAGE_ERROR
  assert "its directory does not exist" in result.stderr.str()


def test_command_paths_hold_every_qualify_test():
  # The GPU command collects PATHS only (the rest needs the bridge).
  marked = []
  for directory, _, files in os.walk(os.path.join(ROOT, "tests")):
    for name in files:
      path = os.path.relpath(os.path.join(directory, name), ROOT)
      if name.endswith(".py") and "mark.qualify" in open(
          os.path.join(ROOT, path), encoding="utf-8").read():
        marked.append(path.replace(os.sep, "/"))
  assert "tests/sharding/test_ops.py" in marked
  for path in marked:
    assert any(path == p or path.startswith(p + "/")
               for p in qualify_report.PATHS), path


def test_the_guide_gives_the_command():
  with open(os.path.join(ROOT, "docs", "guide.md"), encoding="utf-8") as f:
    guide = " ".join(f.read().replace("\\\n", " ").split())
  assert qualify_report.COMMAND in guide
