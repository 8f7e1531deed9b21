"""experiments/gpu_qualify.py end to end, as CI runs it (--quick, on CPU).

Every run is a subprocess in which zmq cannot be imported (a package shim
that raises ImportError is first on PYTHONPATH, for the benchmark's child
process too), as on the GPU machines that lack pyzmq. Mutant runs show that
the checks fail a broken library; bad flags fail at parse time.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top
_CORRECTNESS = ("no_bridge", "fp64_int64", "division", "oracle_allocation",
                "oracle_verification", "rows_identity", "sharded_identity",
                "benchmark")


@pytest.fixture(scope="module")
def no_zmq_env(tmp_path_factory):
  shim = tmp_path_factory.mktemp("no_zmq")
  (shim / "zmq").mkdir()
  (shim / "zmq" / "__init__.py").write_text(
      "raise ImportError('zmq is not installed here (test shim)')\n")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(shim), _ROOT] + [p for p in env.get("PYTHONPATH", "").split(
          os.pathsep) if p])
  env.pop("XLA_FLAGS", None)  # gpu_qualify asks for its own CPU devices
  env.pop("DYADIC_JAX_ROWS", None)
  return env


def _run(env, *args, timeout=900):
  return subprocess.run(
      [sys.executable, "-m", "experiments.gpu_qualify", *args], cwd=_ROOT,
      env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_zmq_shim_works(no_zmq_env):
  out = subprocess.run([sys.executable, "-c", "import zmq"], env=no_zmq_env,
                       capture_output=True, text=True, check=False)
  assert out.returncode != 0 and "test shim" in out.stderr


@pytest.mark.long(minutes=3)
def test_quick_run_passes_without_zmq(no_zmq_env, tmp_path):
  path = tmp_path / "report.json"
  out = _run(no_zmq_env, "--quick", f"--json_out={path}")
  print(out.stdout[-4000:])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  report = json.loads(path.read_text())
  by_name = {c["name"]: c for c in report["checks"]}
  for name in _CORRECTNESS:
    assert by_name[name]["status"] == "PASS", by_name[name]
  assert report["exit_status"] == 0 and report["summary"]["FAIL"] == 0
  # Speed targets are recorded but not judged at --quick sizes.
  targets = [c for c in report["checks"] if c["kind"] == "performance"]
  assert targets and all(c["status"] == "SKIP" for c in targets)
  # Both row modes and a 2-device mesh really ran.
  assert by_name["sharded_identity"]["details"]["shards"] == [2]
  assert by_name["rows_identity"]["details"]["comparisons"] == 2 * 10
  assert report["platform"]["row_modes_in_jit_key"]
  # Progress while it runs, and where the report went.
  assert "[8/8] benchmark" in out.stdout
  assert out.stdout.rstrip().endswith(f"report: {path}")


@pytest.mark.parametrize("mutant,checks,failing", [
    ("reciprocal", "no_bridge,division", "division"),
    ("ticket", "oracle_allocation", "oracle_allocation"),
])
def test_mutants_fail(no_zmq_env, tmp_path, mutant, checks, failing):
  path = tmp_path / "report.json"
  out = _run(no_zmq_env, "--quick", f"--mutant={mutant}",
             f"--checks={checks}", f"--json_out={path}")
  assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
  report = json.loads(path.read_text())
  status = {c["name"]: c["status"] for c in report["checks"]}
  assert status[failing] == "FAIL"
  assert all(s == "PASS" for n, s in status.items() if n != failing)
  assert f"FAILED: {failing}" in out.stdout


@pytest.mark.parametrize("flag,message", [
    ("--checks=bogus", "--checks takes a non-empty list of"),
    ("--vocab=3", "flag --vocab=3"),
    ("--json_out=/nonexistent/dir/r.json", "existing directory"),
    ("--mutant=worse", "flag --mutant=worse"),
])
def test_bad_flags_fail_at_parse_time(no_zmq_env, flag, message):
  out = _run(no_zmq_env, flag, timeout=120)
  assert out.returncode != 0
  lines = out.stderr.strip().splitlines()
  assert message in lines[-2], lines
  assert "Traceback" not in out.stderr
