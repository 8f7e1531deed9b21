"""The acceptance, selection-bias and fleet experiments run and say the truth.

Each experiment runs as a subprocess with small flags (its absl flags live
on the global FLAGS, and several modules define the same names), writing
its JSON and PNG into tmp_path; the tests then check the contents.

Statistical checks use fixed keys, so they are reproducible; the stated
false-failure rate is over the choice of key for a correct implementation:
two binomial checks at 1e-9 each (normal approximation, two-sided) and five
chi-square tests at 1e-9 each: below 1e-8 for the whole file.
"""

from fractions import Fraction
import json
import math
import subprocess
import sys

import pytest
from scipy import stats

import dyadic_jax as dj

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top
_RATE = 1e-9  # per statistical check


def _run(module, tmp_path, *flags):
  """Runs `python -m experiments.<module>`; returns (stdout, record)."""
  json_out = tmp_path / f"{module}.json"
  plot_out = tmp_path / f"{module}.png"
  env = paths.subprocess_env()  # one CPU device: the experiments need no mesh
  args = [sys.executable, "-m", f"experiments.{module}", "--json_out",
          str(json_out)]
  if module != "wire_sizes":
    args += ["--plot_out", str(plot_out)]
  run = subprocess.run(args + list(flags), cwd=_ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr
  if module != "wire_sizes":
    assert plot_out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  return run.stdout, json.loads(json_out.read_text())


@pytest.mark.long
def test_acceptance_figures(tmp_path):
  stdout, record = _run("acceptance", tmp_path, "--vocab=512",
                        "--contexts=32", "--ks=16,512", "--closeness=0.9",
                        "--empirical_rounds=8", "--chunk=16")
  assert "closeness=0.9" in stdout and record["checks_ok"]
  vocab = record["vocab"]
  (result,) = record["results"]
  rows = {r["q"]: r for r in result["rows"]}
  assert list(rows) == ["ideal", "dense", "k16", "k512"]
  # The ideal q is the draft softmax itself.
  assert rows["ideal"]["tv_draft"] == 0 and rows["ideal"]["tv_draft_max"] == 0
  # docs/numerics.md section 2: |c_v - w_v 2^24| < 1, so TV < V 2^-25.
  assert record["dense_tv_bound"] == vocab / 2 ** 25
  assert 0 < rows["dense"]["tv_draft_max"] <= vocab / 2 ** 25
  for r in rows.values():
    assert 0 < r["alpha_min"] <= r["alpha"] <= r["alpha_max"] <= 1
    assert r["triangle_bound_ok"]
    # |alpha(q) - alpha(w)| <= TV(w, q) on average too.
    assert abs(r["alpha_loss_vs_ideal"]) <= r["tv_draft"] + 1e-12
    a, depth = r["alpha"], record["depth"]
    assert r["expected_accepted_iid"] == pytest.approx(
        sum(a ** i for i in range(1, depth + 1)))
  # Sparse k = V keeps the whole support: dense up to renormalization.
  assert abs(rows["k512"]["alpha"] - rows["dense"]["alpha"]) <= vocab / 2 ** 24
  assert rows["k512"]["tv_draft_max"] <= vocab / 2 ** 24
  # Truncation to 16 of 512 tokens costs far more than rounding.
  assert rows["k16"]["tv_draft"] > 100 * rows["dense"]["tv_draft"]
  for name in ("dense", "k16", "k512"):
    e = rows[name]["empirical"]
    assert e["rounds"] == 8
    assert 0 <= e["sampled_accepted"][0] <= record["depth"]
    assert 0 < e["conditional_accepted"][0] <= record["depth"]
    assert all(0 < a <= 1 for a in e["alpha_by_position"])


@pytest.mark.long
def test_selection_bias(tmp_path):
  # One test, so that pytest-xdist never runs the experiment twice.
  stdout, record = _run("selection_bias", tmp_path, "--samples=20000",
                        f"--alpha={_RATE}")
  _check_toy(record)
  _check_confidence_schedule(stdout, record)


def _check_toy(record):
  a = record["toy_a"]
  assert a["fixed_depth"]["exact"] == ["1/2", "1/2"]
  assert a["inspecting"]["exact"] == ["3/4", "1/4"]
  z = stats.norm.isf(_RATE / 2)
  for name, p in (("fixed_depth", 0.5), ("inspecting", 0.75)):
    n = a[name]["samples"]
    tolerance = z * math.sqrt(p * (1 - p) / n)  # about 0.02 at n = 20000
    assert abs(a[name]["empirical"][0] - p) <= tolerance, (name, tolerance)


def _check_confidence_schedule(stdout, record):
  assert record["checks_ok"], stdout
  b = record["toy_b"]
  for name in ("fixed_depth_1", "fixed_depth_2", "confidence_rule"):
    assert b[name]["legal"] and b[name]["tv_joint"] == "0", name
    # Consistent with its exact law, which is the target.
    assert b[name]["chi2_vs_exact_p"] >= _RATE
  for name in ("inspect_x1", "inspect_x2"):
    assert not b[name]["legal"] and Fraction(b[name]["tv_joint"]) > 0, name
    assert b[name]["chi2_vs_exact_p"] >= _RATE
    assert b[name]["chi2_vs_target_p"] < _RATE  # the bias is visible
  # Choosing depth 1 or 2 after seeing x_2 leaves t_1 alone; dropping x_1
  # after seeing it does not.
  assert b["inspect_x2"]["tv_first"] == "0"
  assert Fraction(b["inspect_x2"]["tv_second"]) > 0
  assert Fraction(b["inspect_x1"]["tv_first"]) > 0
  # Exact laws are distributions.
  for r in b.values():
    assert sum(Fraction(x) for row in r["exact_joint"] for x in row) == 1


def test_wire_sizes_fleet(tmp_path):
  stdout, record = _run("wire_sizes", tmp_path, "--fleet=1,3,1000",
                        "--round_ms=7.5")
  assert "seed table reproduced" in stdout and "fleet:" in stdout
  assert record["rows"][0]["estimate_request"] == 2_585_600  # unchanged
  fleet = record["fleet"]
  link = fleet["link_bytes_per_round"]
  assert link == 40 * 10 ** 9 // 8 * 75 // 10_000  # 37.5 MB in 7.5 ms
  assert fleet["requests"] == [1, 3, 1000]
  assert [e["layout"] for e in fleet["layouts"]] == [
      "dense", "k16", "k32", "k64", "k256", "tp2_link0", "tp2_link"]
  frames = {r["layout"]: r["frames_request"] for r in record["rows"]}
  # A rank link of TP-2: half the dense row (64,640 entries) per row; only
  # the session's link (rank 0) carries the COMPLETION.
  assert frames["tp2_link"] == 48 + 16 + 5 * (8 + 4 * 64_640)
  for e in fleet["layouts"]:
    assert e["measured_bytes_request_round"] == (
        frames[e["layout"]] + (0 if e["layout"] == "tp2_link"
                               else fleet["completion_frame"]))
    for kind in ("estimate", "measured"):
      size, sustained = (e[f"{kind}_bytes_request_round"],
                         e[f"{kind}_sustained"])
      assert sustained * size <= link < (sustained + 1) * size
      for load in e["by_requests"]:
        n = load["requests"]
        assert load[f"{kind}_bytes_per_s"] == pytest.approx(
            size * n / 7.5e-3)
        assert load[f"{kind}_link_pct"] == pytest.approx(
            100 * size * n / link)
        # N fits in a round exactly when N <= the sustained count.
        assert (n <= sustained) == (load[f"{kind}_link_pct"] <= 100)
  dense = fleet["layouts"][0]
  assert dense["estimate_bytes_request_round"] == 5 * 4 * dj.DEFAULT_VOCAB
  assert dense["estimate_sustained"] == 14  # 37.5e6 // 2,585,600


@pytest.mark.slow   # 4 processes, ~3 minutes on 2 cores: --runslow
@pytest.mark.multidevice
def test_bench_rank_links(tmp_path):
  """One link vs rank links (two rounds in flight, and one), one run:
  each rank link carries half of the one link's q bytes, and every mode
  commits the same tokens."""
  stdout, record = _run("bench_rank_links", tmp_path, "--vocab=512",
                        "--tokens=3")
  assert record["committed_identical"]
  assert "committed tokens identical in every mode: True" in stdout
  one, *ranked = record["links"]
  assert [r["mode"] for r in record["links"]] == (
      ["one link"] + ["rank links"] * 2 + ["rank links, 1 in flight"] * 2)
  speed = {r["mode"]: r for r in record["rounds"]}
  assert speed["rank links"]["in_flight"] == 2
  assert speed["rank links, 1 in flight"]["in_flight"] == 1
  for r in record["rounds"]:
    assert r["rounds_s"] == pytest.approx(
        r["draft_s"] + r["bridge_s"] + r["verification_s"] + r["host_s"])
  # The session's link (one link; rank 0's) carries PACKED answers: per
  # request a 32 B record, tokens and n (5 x 4 B each), q (5 x width x 4
  # B), and a share of the 64 B header (at most 4 requests a batch); rank
  # 1's link a REPLY frame per request (docs/wire.md).
  packed = lambda width: 32 + 2 * 5 * 4 + 5 * 4 * width + 64 / 4
  frame = lambda width: 48 + 16 + 5 * (8 + 4 * width)
  assert one["bytes_per_request_round"] >= packed(512)
  assert ranked[0]["bytes_per_request_round"] >= packed(256)
  assert ranked[1]["bytes_per_request_round"] >= frame(256)
  for r in record["links"]:
    assert r["ratio_to_ideal"] == pytest.approx(
        r["ms_per_request"] / r["ideal_ms_per_request"])
    assert r["fallback_rounds"] == 0
