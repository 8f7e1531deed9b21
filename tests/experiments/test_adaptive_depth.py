"""experiments/adaptive_depth.py runs and its record adds up.

One small run on the shipped pair (--runslow: two prompts, a given step
cost, so no target-only leg). No test asserts on time or on the ratio:
the record's figures must be consistent with each other and with the
cost model the docstring states.
"""

import json
import subprocess
import sys

import pytest

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


@pytest.mark.slow
def test_a_small_run(tmp_path):
  out = tmp_path / "adaptive.json"
  run = subprocess.run(
      [sys.executable, "-m", "experiments.adaptive_depth", "--prompts=2",
       "--new_tokens=16", "--step_cost=0.2", "--max_depth=6",
       "--train_prompts", f"--json_out={out}"], cwd=_ROOT, env=paths.subprocess_env(),
      capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  record = json.loads(out.read_text())
  fixed, adaptive = record["fixed"], record["adaptive"]
  assert record["train_prompts"] and adaptive["prior_weight"] == 16
  assert fixed["mean_rows"] == fixed["mean_steps"] == 5
  assert 1 <= adaptive["mean_rows"] <= 6
  assert adaptive["mean_steps"] == adaptive["mean_rows"]   # no lookahead
  for e in (fixed, adaptive):
    assert e["tokens_per_round"] == pytest.approx(e["mean_accepted"] + 1)
    assert e["tokens_per_cost"] == pytest.approx(
        e["tokens_per_round"] / (1 + 0.2 * e["mean_steps"]))
  assert record["ratio"] == pytest.approx(
      adaptive["tokens_per_cost"] / fixed["tokens_per_cost"])
