"""experiments/bench_curve.py runs and reports what it measured.

The benchmark itself is not a test (no test asserts on time): one small
run checks that both settings (clear and CURVE) crossed the real bridge
endpoints between two processes for both q forms, that the message sizes
are the PACKED answer's (docs/wire.md), and that the record holds a time
and a ratio for each side.
"""

import json
import subprocess
import sys

import pytest

from experiments import bench_curve
from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


def test_packed_sizes():
  # The PACKED answers of the default batch, as docs/wire.md counts them.
  assert bench_curve.packed_bytes(4, 5, 32, ids=True) == 5_472
  assert bench_curve.packed_bytes(4, 5, 129_280, ids=False) == 10_342_752


def test_a_small_run(tmp_path):
  out = tmp_path / "curve.json"
  run = subprocess.run(
      [sys.executable, "-m", "experiments.bench_curve", "--vocab=4096",
       "--sparse_messages=20", "--dense_messages=4", f"--json_out={out}"],
      cwd=_ROOT, env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr
  record = json.loads(out.read_text())
  results = record["results"]
  assert results["sparse"]["bytes"] == bench_curve.packed_bytes(
      4, 5, 32, ids=True)
  assert results["dense"]["bytes"] == bench_curve.packed_bytes(
      4, 5, 4096, ids=False)
  for row in results.values():
    for side in ("one_way_ms", "worker_cpu_ms", "verifier_cpu_ms"):
      cell = row[side]
      assert cell["clear"] > 0 and cell["curve"] > 0, (side, cell)
      assert cell["x_clear"] == pytest.approx(cell["curve"] / cell["clear"])
  assert "CURVE cost per batch answer" in run.stdout
