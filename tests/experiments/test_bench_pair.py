"""experiments/bench_pair.py runs and reports what it measured.

No test asserts on time: one small run (2 prompts, dense and sparse k=16,
the bridge leg included; --runslow: about a minute, mostly compiles, and
the default tier's generate and pipeline tests already decode the trained
pair in one process and over the bridge; the transformers peer's legs
too where $DYADIC_JAX_HF_PYTHON names an interpreter with torch and
transformers, else --nohf) checks that the record holds every figure
docs/benchmarks.md's tables come from, that they are consistent with
each other, and that the rows a chunked verify pass computes equal the
rows of a one-token-at-a-time decode within the float tolerance
docs/numerics.md states.
"""

import json
import os
import subprocess
import sys

import pytest

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


@pytest.mark.slow
def test_a_small_run(tmp_path):
  out, plot = tmp_path / "pair.json", tmp_path / "pair.png"
  run = subprocess.run(
      [sys.executable, "-m", "experiments.bench_pair", "--prompts=2",
       "--new_tokens=12", "--formats=dense,16", f"--json_out={out}",
       f"--plot_out={plot}", *_peer_flags()], cwd=_ROOT,
      env=paths.subprocess_env(),
      capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert plot.stat().st_size > 0
  assert "Unable to initialize backend" not in run.stderr
  record = json.loads(out.read_text())
  assert set(record["formats"]) == {"dense", "16"}
  for name, e in record["formats"].items():
    assert e["tokens"] == 2 * 12, name
    for a, x in zip(e["acceptance_by_position"], e["expected_by_position"]):
      assert 0 <= a <= 1 and 0 <= x <= 1
    assert 0 <= e["expected"] <= 1 and e["draft_cost_ratio"] > 0
    assert e["predicted_speedup"] > 0 and e["speedup"] > 0
    assert e["pass_ratio"] > 0 and e["tokens_per_cpu_second"] > 0
    # The model's speedup is 1 exactly at the break-even pass ratio.
    assert e["break_even_pass_ratio"] == pytest.approx(
        e["predicted_speedup"] * (e["draft_cost_ratio"] * 5
                                  + e["pass_ratio"] + e["rest_ratio"])
        - 5 * e["draft_cost_ratio"] - e["rest_ratio"])
    # The split adds up to the wall.
    assert sum(e["seconds"][p] for p in ("draft", "target", "verify",
                                         "exchange", "host")) == (
                                             pytest.approx(
                                                 e["seconds"]["wall"]))
  # A sparse row holds at most the dense row's mass: sum min(p, q) too.
  assert record["formats"]["16"]["expected"] <= (
      record["formats"]["dense"]["expected"] + 1e-9)
  assert record["target_only"]["tokens"] == 2 * 12
  two = record["bridge"]
  for leg in (two, two["one_in_flight"]):
    assert leg["tokens"] == 2 * 12 and leg["fallbacks"] == 0
    assert 0 <= leg["waited_s"] <= leg["seconds"]["wall"]
  assert (two["in_flight"], two["one_in_flight"]["in_flight"]) == (2, 1)
  o = two["overlap"]
  assert o["hidden"] <= 1 and o["wall_over_busier"] > 0
  assert o["wall_ms"] >= o["exposed_ms"]
  rows = record["rows"]
  assert rows["max_abs_logit_difference"] < 1e-3 and rows["max_tv"] < 1e-4
  for table in ("k screen", "speed", "rows of one chunked verify pass",
                "regime (q ", "with one round in flight", "overlap: "):
    assert table in run.stdout
  if os.environ.get("DYADIC_JAX_HF_PYTHON"):
    for leg in ("target_b1", "target_b4", "assisted_b1"):
      assert record["peer"][leg]["tokens"] == 2 * 12, leg
    assert "transformers assisted generation" in run.stdout
  else:
    assert "peer" not in record


def _peer_flags():
  python = os.environ.get("DYADIC_JAX_HF_PYTHON")
  return [f"--hf_python={python}"] if python else ["--nohf"]


def test_bad_formats_flag_is_one_line():
  run = subprocess.run(
      [sys.executable, "-m", "experiments.bench_pair", "--formats=dense,x"],
      cwd=_ROOT, env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=120)
  assert run.returncode == 2
  assert len(run.stderr.strip().splitlines()) == 1, run.stderr
  assert "--formats" in run.stderr
