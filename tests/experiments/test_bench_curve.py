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

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


def _packed(entries, ids):
  """A PACKED answer of 4 requests x 5 rows (docs/wire.md): header and
  body, records, tokens and n, ids (sparse) and q. (The experiment runs
  in a subprocess: its absl flags would clash with other modules'.)"""
  return 48 + 16 + 4 * 32 + 2 * 4 * 20 + 20 * entries * 4 * (2 if ids else 1)


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
  assert results["sparse"]["bytes"] == _packed(32, ids=True) == 5_472
  assert results["dense"]["bytes"] == _packed(4096, ids=False)
  for row in results.values():
    for side in ("one_way_ms", "worker_cpu_ms", "verifier_cpu_ms"):
      cell = row[side]
      assert cell["clear"] > 0 and cell["curve"] > 0, (side, cell)
      assert cell["x_clear"] == pytest.approx(cell["curve"] / cell["clear"])
  assert "CURVE cost per batch answer" in run.stdout
