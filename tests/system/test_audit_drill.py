"""The sampling-audit drill, end to end (issue 10, item 5).

`python -m experiments.pp1_pipeline --check_distribution
--worker_bug=token_not_from_q`: the worker process sends its q rows but
each drafted token is the next live entry after the one its PROPOSAL draw
picked (an off-by-one in the cumulative search; tokens never drawn from
the q they travel with). With the sampling audit (the default) every such
proposal is refused as SAMPLING_MISMATCH, counted, and the round falls
back to the target alone, so the distribution check passes; with
--no_sampling_audit the same drill verifies the forged tokens against
their q and the check fails.

Statistics: fixed seeds, alpha = 1e-8 per statistic (two statistics: a
false failure rate of at most 2e-8 for the passing run). Power: with the
audit off, 400 first tokens gave chi2 ~ 8e4 on 5 degrees of freedom
(2,000 gave 4.1e5): p is 0 to machine precision, far below alpha.
"""

import json
import subprocess
import sys

import pytest

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top
_SAMPLES = 400


def _run(tmp_path, *flags):
  out = tmp_path / "drill.json"
  env = paths.subprocess_env()
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.pp1_pipeline",
       "--check_distribution", "--worker_bug=token_not_from_q",
       f"--check_samples={_SAMPLES}", "--alpha=1e-8", f"--json_out={out}",
       # A deadline no healthy exchange misses on a loaded machine: the
       # only refusals are then the audit's (asserted exactly).
       "--timeout=120", "--plot_out=", *paths.pipeline_flags(*flags)],
      cwd=_ROOT, env=env, capture_output=True,
      text=True, timeout=900)
  return proc, json.loads(out.read_text())


@pytest.mark.long
def test_the_audit_refuses_every_forged_proposal(tmp_path):
  proc, record = _run(tmp_path)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert record["config"]["worker_bug"] == "token_not_from_q"
  assert record["config"]["sampling_audit"] is True
  assert record["errors"] == {"SAMPLING_MISMATCH": _SAMPLES}
  assert record["fallback_rounds"] == record["request_rounds"] == _SAMPLES
  assert record["distribution_check"]["verdict"] == "pass"


@pytest.mark.long
def test_without_the_audit_the_same_drill_fails_the_check(tmp_path):
  proc, record = _run(tmp_path, "--no_sampling_audit")
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert record["config"]["sampling_audit"] is False
  assert record["errors"] == {} and record["fallback_rounds"] == 0
  check = record["distribution_check"]
  assert check["verdict"] == "fail" and check["p_value"] < 1e-8
