"""experiments/bench_bridge runs (--quick) and records every figure.

Speed is never asserted: only that each stage, ratio, round trip and target
is present as a positive finite number (or a boolean verdict).
"""

import json
import math
import subprocess
import sys

import pytest

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top

_STAGES = ("encode", "decode", "plan", "validate",
           "validate_no_audit", "validate_device", "draws", "naive",
           "objects", "memcpy", "memcpy_hot", "read", "rowsum", "gmac",
           "blake3",
           "blake3_threads", "crc32c", "hmac_sha256", "send_tcp", "send_ipc",
           "send_curve")
_STAGE_KEYS = ("median_ms", "p90_ms", "min_ms", "mean_ms", "x_memcpy",
               "x_read", "x_ideal", "gb_per_s")
_HEADLINE_KEYS = ("ms", "x_memcpy", "x_memcpy_hot", "x_read", "x_ideal",
                  "ideal_ms", "memcpy_ms", "objects_ms", "objects_x_memcpy",
                  "draws_ms", "mac_share", "curve_over_clear")
_HEADLINE_PARTS = ("encode", "decode", "plan", "validate")
# Each side: its stages and the stages of its floor.
_SIDES = {"worker": (("encode",), ("memcpy", "gmac")),
          "verifier_host": (("decode", "plan"), ("gmac", "memcpy")),
          "validation": (("validate",), ("rowsum",))}
_SIDE_KEYS = ("ms", "x_memcpy", "x_mac", "x_blake3", "x_link", "floor_ms",
              "x_floor", "target_x")
_ROUND_TRIPS = ("pyzmq_floor", "exchange", "exchange_insecure",
                "exchange_curve", "host", "round")
_ROUND_TRIP_KEYS = ("p50_us", "p90_us", "p99_us", "min_us", "mean_us",
                    "x_floor_p50")


def _positive(value, where):
  assert isinstance(value, (int, float)) and not isinstance(value, bool), (
      f"{where}: {value!r} is not a number")
  assert math.isfinite(value) and value > 0, f"{where}: {value!r}"


@pytest.fixture(scope="module")
def record(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench_bridge") / "bench.json"
  env = paths.subprocess_env()
  run = subprocess.run(
      [sys.executable, "-m", "experiments.bench_bridge", "--quick",
       "--json_out", str(out)], cwd=_ROOT, env=env, capture_output=True,
      text=True, timeout=120)
  assert run.returncode == 0, run.stdout + run.stderr
  for word in ("host work =", "pyzmq_floor", "exchange"):
    assert word in run.stdout, run.stdout
  # 3 sides x 2 scales in the tables, then 6 targets.
  assert run.stdout.count("[PASS]") + run.stdout.count("[MISS]") == 12
  return json.loads(out.read_text())


def test_config(record):
  config = record["config"]
  assert config["quick"] is True
  assert (config["requests"], config["depth"], config["k"]) == (4, 5, 32)
  _positive(record["wall_s"], "wall_s")


@pytest.mark.parametrize("scale,requests", [("request", 1), ("batch", 4)])
def test_dense_stages_and_ratios(record, scale, requests):
  rec = record["dense"][scale]
  vocab, depth = record["config"]["vocab"], record["config"]["depth"]
  assert rec["requests"] == requests and rec["rows"] == requests * depth
  assert rec["q_bytes"] == requests * depth * vocab * 4
  # One PACKED frame (docs/wire.md): the 48 B header, a 16 B body, a 32 B
  # record per request, tokens and n (int32 per row), then q.
  assert rec["message_bytes"] == rec["q_bytes"] + 64 + requests * (
      32 + 8 * depth)
  assert rec["frames"] == 1
  _positive(rec["ideal_ms"], f"{scale} ideal_ms")
  assert set(_STAGES) <= set(rec["stages"]), sorted(rec["stages"])
  for stage in _STAGES:
    for key in _STAGE_KEYS:
      _positive(rec["stages"][stage][key], f"{scale} {stage} {key}")
    s = rec["stages"][stage]
    assert s["min_ms"] <= s["median_ms"] <= s["p90_ms"]
  head = rec["headline"]
  assert head["audit_ms"] >= 0
  for key in _HEADLINE_KEYS:
    _positive(head[key], f"{scale} headline {key}")
  assert tuple(head["parts"]) == _HEADLINE_PARTS
  parts = sum(rec["stages"][p]["median_ms"] for p in _HEADLINE_PARTS)
  assert math.isclose(head["ms"], parts, rel_tol=1e-9)
  assert math.isclose(sum(head["share"].values()), 1.0, rel_tol=1e-9)
  for part in _HEADLINE_PARTS:
    _positive(head["share"][part], f"{scale} share {part}")
  stages = rec["stages"]
  for side, (parts, floor) in _SIDES.items():
    got = rec["sides"][side]
    for key in _SIDE_KEYS:
      _positive(got[key], f"{scale} {side} {key}")
    assert (tuple(got["parts"]), tuple(got["floor"])) == (parts, floor)
    ms = sum(stages[p]["median_ms"] for p in parts)
    assert math.isclose(got["ms"], ms, rel_tol=1e-9)
    assert math.isclose(got["floor_ms"], sum(stages[p]["median_ms"]
                                             for p in floor), rel_tol=1e-9)
    assert math.isclose(got["x_link"], ms / rec["ideal_ms"], rel_tol=1e-9)
    assert isinstance(got["pass"], bool) and got["target"]


def test_headline_and_targets(record):
  head = record["headline"]
  assert head["name"].startswith("host work for a dense")
  assert head == dict(record["dense"]["batch"]["headline"], name=head["name"])
  vocab = record["config"]["vocab"]
  # The seed's 40 Gb/s ideal of the batch's q bytes (2.068 ms at V=129280).
  assert math.isclose(head["ideal_ms"], 20 * vocab * 4 / 5e9 * 1e3,
                      rel_tol=1e-9)
  assert record["sides"] == record["dense"]["batch"]["sides"]
  targets = record["targets"]
  assert len(targets) == 6
  for t in targets:
    assert isinstance(t["pass"], bool) and t["target"] and t["detail"]


def test_sparse_round_trips(record):
  sparse = record["sparse"]
  assert sparse["k"] == 32 and sparse["max_x_floor"] == 3.0
  # One PACKED answer (docs/wire.md): the 48 B header, a 16 B body, 4
  # records of 32 B, then tokens and n (int32[4, 5] each), ids and q
  # (int32 and float32 [4, 5, 32]).
  assert sparse["reply_frames"] == 1
  assert sparse["reply_bytes"] == (48 + 16 + 4 * 32 + 2 * 4 * 5 * 4
                                   + 2 * 4 * 5 * 32 * 4)
  # One PACKED_STEP: the 48 B header, an 8 B body, 4 records of 72 B.
  assert sparse["step_bytes"] == 48 + 8 + 4 * 72
  for name in _ROUND_TRIPS:
    rt = sparse["round_trips"][name]
    for key in _ROUND_TRIP_KEYS:
      _positive(rt[key], f"sparse {name} {key}")
    assert rt["min_us"] <= rt["p50_us"] <= rt["p90_us"] <= rt["p99_us"]
    assert rt["n"] >= 1


def test_overlap_rounds(record):
  """Both legs ran every round; sleeps bound each from below (a sleep is
  never shorter than asked), so these hold on any load: with one round
  in flight a round waits out the draft and the verification, with two
  at least the longer of them."""
  o = record["overlap"]
  n = record["config"]["overlap_rounds"]
  assert o["rounds"] == n == 10 and o["requests"] == 4
  draft_s, verify_s = o["draft_ms"] / 1e3, o["verify_ms"] / 1e3
  for leg, floor in (("one", draft_s + verify_s),
                     ("two", max(draft_s, verify_s))):
    got = o[leg]
    assert got["units"] == n
    assert 0 <= got["waited_s"] <= got["wall_s"]
    assert got["wall_s"] >= n * floor, (leg, got)
  f = o["overlap"]
  assert f["hidden"] <= 1 and f["wall_over_busier"] > 0
  assert math.isclose(f["wall_ms"], 1e3 * o["two"]["wall_s"] / n,
                      rel_tol=1e-9)
