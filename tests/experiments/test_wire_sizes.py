"""experiments/wire_sizes reproduces the seed's size table exactly."""

import json
import subprocess
import sys

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


def test_seed_table_reproduced(tmp_path):
  out = tmp_path / "sizes.json"
  env = paths.subprocess_env()
  run = subprocess.run(
      [sys.executable, "-m", "experiments.wire_sizes", "--json_out",
       str(out)], cwd=_ROOT, env=env, capture_output=True, text=True,
      timeout=120)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "seed table reproduced" in run.stdout
  record = json.loads(out.read_text())
  rows = {r["layout"]: r for r in record["rows"]}
  assert rows["dense"]["estimate_request"] == 2_585_600
  assert rows["k32"]["estimate_batch"] == 5_120
  assert record["two_dense_slots"] == 20_684_800
  # Measured frames: one REPLY per request, 64 bytes of header and body
  # plus tokens and n (8 bytes per row) around its D rows.
  assert rows["k32"]["frames_request"] == 64 + 5 * (8 + 8 * 32)
  assert rows["dense"]["frames_request"] == 64 + 5 * (8 + 4 * 129280)
  # The 40 Gb/s ideal per request and per 4-request batch (the seed's
  # 0.517 and 2.068 ms), printed side by side.
  assert round(rows["dense"]["ideal_ms_request"], 3) == 0.517
  assert round(rows["dense"]["ideal_ms_batch"], 3) == 2.068
  assert "ideal ms/batch" in run.stdout and "2.0685" in run.stdout
