"""experiments/bench_host runs (--quick) and records every figure.

Speed is never asserted: only that each phase, floor, side and ratio is
present as a positive finite number, and each side's verdict a boolean.
"""

import json
import math
import subprocess
import sys

from tests import paths
from tests.paths import ROOT as _ROOT

_PHASES = ("v_begin", "w_receive", "w_write", "w_finish", "v_receive",
           "v_validate", "v_plan", "v_commit", "w_commit")
_FLOORS = ("numpy_pass", "memcpy", "numpy_call")
_RATIOS = tuple(f"x_{f}" for f in _FLOORS)
_SIDES = {"worker": ("w_receive", "w_write", "w_finish", "w_commit"),
          "verifier": ("v_begin", "v_receive", "v_validate", "v_plan",
                       "v_commit")}


def _positive(value, where):
  assert isinstance(value, (int, float)) and not isinstance(value, bool), (
      f"{where}: {value!r} is not a number")
  assert math.isfinite(value) and value > 0, f"{where}: {value!r}"


def test_bench_host_records_every_phase_and_side(tmp_path):
  out = tmp_path / "bench_host.json"
  run = subprocess.run(
      [sys.executable, "-m", "experiments.bench_host", "--quick",
       "--host_rounds=20", "--json_out", str(out)], cwd=_ROOT,
      env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=120)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.count("[PASS]") + run.stdout.count("[MISS]") == 2
  rec = json.loads(out.read_text())
  assert set(rec["phases"]) == set(_PHASES) | set(_FLOORS)
  for name, phase in rec["phases"].items():
    for key in ("median_us", "p90_us", "min_us") + _RATIOS:
      _positive(phase[key], f"{name}.{key}")
    assert phase["n"] == 20
  for f in _FLOORS:
    _positive(rec["floors_us"][f], f)
  for side, parts in _SIDES.items():
    s = rec["sides"][side]
    assert s["parts"] == list(parts)
    for key in ("median_us",) + _RATIOS:
      _positive(s[key], f"{side}.{key}")
    assert math.isclose(s["median_us"], sum(
        rec["phases"][p]["median_us"] for p in parts))
    assert math.isclose(sum(s["share"].values()), 1.0)
    assert isinstance(s["pass"], bool) and s["target_ms"] == 0.4
  for key in ("step_bytes", "reply_bytes", "q_bytes"):
    _positive(rec["sizes"][key], key)
  assert rec["config"]["rounds"] == 20 and rec["config"]["k"] == 32
