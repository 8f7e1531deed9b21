"""experiments/idle_flood.py (issue 40, item 5: the figures in
docs/security.md, "Connections and handshakes below the bridge") runs to
its two report lines on a small flood. --runslow: a worker's start-up."""

import subprocess
import sys

import pytest

from tests import paths


@pytest.mark.slow
def test_a_small_flood_reports_both_costs():
  run = subprocess.run(
      [sys.executable, "-m", "experiments.idle_flood", "--connections=200",
       "--replay_s=0.5", "--settle_s=0.2"], cwd=paths.ROOT,
      env=paths.subprocess_env(JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = run.stdout.splitlines()
  assert lines[0].startswith("idle connections: 200; worker RSS idle ")
  assert lines[1].startswith("replayed HELLO (266 bytes recorded): ")
