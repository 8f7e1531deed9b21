"""The PP1 pipeline end to end, as a user runs it (subprocesses, real sockets).

Each test runs `python -m experiments.pp1_pipeline` with small --tokens and
checks its JSON record. The distribution checks use a fixed seed and
alpha = 1e-8 per statistic (two statistics, two passing runs: a false
failure rate of at most 4e-8 for this file); the mutant (a verifier that
verifies against a uniform q instead of the sampled one) moves the
first-token distribution far enough that 2,000 samples reject it at any
reasonable alpha (chi2 ~ 130 on 5 degrees of freedom, p ~ 1e-26, measured),
so the same harness demonstrably has power.
"""

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ALPHA = "1e-8"


def _run(tmp_path, *flags, expect=0):
  out = tmp_path / "pp1.json"
  plot = tmp_path / "pp1.png"
  env = dict(os.environ, PYTHONPATH=_ROOT)
  env.pop("XLA_FLAGS", None)       # the pipeline sets its own device count
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.pp1_pipeline", f"--json_out={out}",
       f"--plot_out={plot}", *flags], cwd=_ROOT, env=env,
      capture_output=True, text=True, timeout=600)
  assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert plot.stat().st_size > 0
  return json.loads(out.read_text()), proc.stdout


def _healthy(record, requests=4, tokens=8):
  assert record["tokens"] >= requests * tokens
  assert record["rounds"] >= 1
  assert 0 < record["mean_accepted"] <= record["config"]["depth"]
  assert all(a is None or 0 <= a <= 1
             for a in record["acceptance_by_position"])
  assert record["acceptance_by_position"][0] is not None
  assert 0 < record["acceptance_by_position"][0] <= 1
  assert record["bytes_per_round"]["measured_in"] > 0
  for key in ("tokens", "rounds", "mean_accepted", "acceptance_by_position",
              "bytes_per_round", "errors"):
    assert key in record


def test_default_pipeline_single_process(tmp_path):
  record, stdout = _run(tmp_path, "--tokens=8")
  _healthy(record)
  assert record["errors"] == {} and record["fallback_rounds"] == 0
  assert record["config"]["vocab"] == 129280
  assert "PP1 pipeline" in stdout and "acceptance by position" in stdout
  # Sparse k=32 q: the measured reply bytes carry the seed's q estimate
  # plus framing (48 B per row, 40+32 B per COMPLETION).
  assert record["bytes_per_round"]["measured_in"] >= (
      record["bytes_per_round"]["seed_estimate_q"])


@pytest.mark.multidevice
def test_default_pipeline_multiprocess(tmp_path):
  single, _ = _run(tmp_path, "--tokens=8", "--vocab=4096")
  multi, _ = _run(tmp_path, "--tokens=8", "--vocab=4096", "--multiprocess")
  _healthy(multi)
  assert multi["errors"] == {} and multi["config"]["multiprocess"]
  # Two gloo ranks commit exactly what one process with two devices does.
  for key in ("tokens", "rounds", "mean_accepted", "acceptance_by_position"):
    assert multi[key] == single[key], key


def test_distribution_check_passes(tmp_path):
  record, stdout = _run(tmp_path, "--check_distribution", f"--alpha={_ALPHA}")
  check = record["distribution_check"]
  assert check["verdict"] == "pass" and check["samples"] == 2000
  assert "Distribution check" in stdout


def test_distribution_check_passes_with_faults(tmp_path):
  record, _ = _run(tmp_path, "--check_distribution", f"--alpha={_ALPHA}",
                   "--inject_faults=0.05", "--timeout=0.5")
  assert record["distribution_check"]["verdict"] == "pass"
  assert record["faults"], "no fault was injected"
  assert record["fallback_rounds"] > 0
  assert sum(record["errors"].values()) > 0


def test_distribution_check_rejects_the_mutant(tmp_path):
  record, _ = _run(tmp_path, "--check_distribution", f"--alpha={_ALPHA}",
                   "--mutant=uniform_q", expect=1)
  check = record["distribution_check"]
  assert check["verdict"] == "fail" and check["p_value"] < 1e-12


def test_worker_killed_mid_run(tmp_path):
  record, _ = _run(tmp_path, "--tokens=16", "--vocab=4096",
                   "--kill_worker_at=2", "--timeout=1.0")
  _healthy(record, tokens=16)
  assert record["fallback_rounds"] >= 4            # the dead round, at least
  assert record["errors"].get("TIMEOUT", 0) >= 4
  assert record["events"]["hellos"] >= 2           # a new session after it
