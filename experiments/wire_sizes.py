"""The seed's q size table, by shape arithmetic, beside measured frames.

    python -m experiments.wire_sizes [--json_out /tmp/wire_sizes.json]
        [--fleet=1,4,16,64,256 --round_ms=20]

Expected runtime: about 2 s (no JAX computation; it encodes one frame of
each layout with dyadic_jax.wire). Every flag is checked when the command
line is parsed: a bad value exits at once with a one-line error.

Estimated sizes are exact shape arithmetic, excluding headers and
checksums, as in the seed (MB = 10^6 bytes): dense FP32 q at V=129280 over
depth 5, sparse int32 id + FP32 q for k in --ks, one TP2 vocabulary shard,
the 40 Gb/s serialization bounds and two in-flight dense batch slots.
Measured sizes are the wire v3 frames actually encoded: one REPLY frame per
request holding its D rows (48-byte header with the MAC tag + 16-byte REPLY
body + tokens and n, 8 bytes per row + payload).
The script fails (exit 1) if the arithmetic does not reproduce the seed's
figures.

Fleet table (JSON key "fleet"): the worker -> verifier link when N requests
(--fleet) each ship one round of depth D every --round_ms (the verification
round time), for dense and each sparse k. Bytes per request per round are
the seed's estimate (q payload only) and the measured frames (D REPLY
frames + the request's COMPLETION frame, headers included); the link load
is bytes per request per round x N / round time, as a percentage of
--link_gbps (over 100%: the link cannot carry it within a round), and one
link sustains floor(link bytes per round / bytes per request per round)
concurrent requests (link bytes per round = link_gbps 10^9 / 8 x round_ms
10^-3, exact decimal arithmetic, floored to whole bytes).

The rank links of a TP-n pair (--link_ranks; dyadic_jax/bridge/rank_links.py)
are in both tables: rank 0's link ("tp2_link0") carries the session's REPLY
frame of vocabulary block 0 (ceil(V / n) entries per row) and the
COMPLETION, rank s >= 1's link ("tp2_link") the REPLY frame of its block
alone; the frames are encoded with the capabilities of those links. The
pipeline measures the same bytes on a live run (its "bytes_per_link").
"""

from fractions import Fraction
import json
import math
import typing

from absl import flags

from experiments import cli

_VOCAB = flags.DEFINE_integer(
    "vocab", cli.DEFAULT_VOCAB, f"Vocabulary size V, 2..{cli.MAX_VOCAB}.",
    lower_bound=2, upper_bound=cli.MAX_VOCAB)
_DEPTH = flags.DEFINE_integer(
    "depth", 5, "Draft depth D (rows per request), 1..255.", lower_bound=1,
    upper_bound=255)
_REQUESTS = flags.DEFINE_integer(
    "requests", 4, "Requests per batch (>= 1).", lower_bound=1,
    upper_bound=1 << 20)
_KS = flags.DEFINE_list("ks", ["16", "32", "64", "256"],
                        "Sparse support sizes k, each in [1, V].")
_LINK_GBPS = flags.DEFINE_float(
    "link_gbps", 40.0, "Nominal link rate for the ideal bounds, Gb/s (> 0).")
_JSON_OUT = flags.DEFINE_string("json_out", None,
                                "Optional path for a JSON record.")
_FLEET = flags.DEFINE_list(
    "fleet", ["1", "4", "16", "64", "256"], "Concurrent requests N (each "
    ">= 1) on one worker -> verifier link for the fleet table.")
_LINK_RANKS = flags.DEFINE_list(
    "link_ranks", ["2"], "TP sizes n (each in [2, 64]) whose rank links "
    "join the tables.")
_ROUND_MS = flags.DEFINE_float(
    "round_ms", 20.0, "Verification round time in ms (> 0): every request "
    "ships one round of q (depth rows) per round time.")

cli.check(["ks", "vocab"], lambda ks, vocab: cli.int_list(ks, 1, vocab),
          "--ks must be integers in [1, --vocab]")
cli.check("fleet", lambda n: cli.int_list(n, 1, 1 << 40),
          "--fleet must be positive integers")
cli.check("link_ranks", lambda n: cli.int_list(n, 2, 64),
          "--link_ranks must be integers in [2, 64]")
for _name in ("link_gbps", "round_ms"):
  cli.check(_name, lambda x: math.isfinite(x) and 0 < x <= 1e9,
            f"--{_name} must be a positive number")
cli.check_output_path("json_out")
cli.parse_flags_early(__name__)

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import numpy as np

import dyadic_jax as dj
from dyadic_jax.bridge import hello
from dyadic_jax.wire import codec, layouts, qformats
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

# The seed's table (V=129280, depth 5, four requests), bytes.
_SEED = {"dense": (2_585_600, 10_342_400), "k16": (640, 2_560),
         "k32": (1_280, 5_120), "k64": (2_560, 10_240),
         "k256": (10_240, 40_960), "tp2_shard": (1_292_800, 5_171_200)}
_SEED_TWO_SLOTS = 20_684_800
_SEED_DENSE_MS = (0.517, 2.068)


_DENSE, _SPARSE = qformats.BY_NAME["dense"], qformats.BY_NAME["sparse"]


def _layouts(vocab, ks):
  """(name, q format, V, k) of the seed table's layouts: dense, one TP2
  vocabulary shard (a dense row of ceil(V / 2)), sparse for each k."""
  return ([("dense", _DENSE, vocab, 0),
           ("tp2_shard", _DENSE, -(-vocab // 2), 0)]
          + [(f"k{k}", _SPARSE, vocab, k) for k in ks])


def _reply_frame(fmt, vocab, k, depth):
  """One encoded REPLY frame of a request's D valid rows in format `fmt`
  (all the mass on the first entry of rows of ids 0..w-1), and its
  Bounds."""
  bounds = codec.Bounds(vocab=vocab, depth=depth, width=fmt.width(vocab, k),
                        representation=fmt.representation)
  buf = bytearray(bounds.reply_bytes(depth))
  _, rows = codec.begin_reply(buf, bounds=bounds, session=1, generation=0,
                              round_id=0, request=0, depth=depth)
  counts = np.zeros((depth, bounds.width), np.int64)
  counts[:, 0] = dj.M
  fmt.put(rows, np.broadcast_to(np.arange(bounds.width, dtype=np.int32),
                                counts.shape), counts)
  return bytes(buf), bounds


def _rank_link_frame(vocab, depth, ranks, rank):
  """One REPLY frame of a rank link (block `rank` of `ranks`), encoded with
  that link's capabilities."""
  caps = hello.Capabilities(vocab=vocab, max_depth=depth,
                            representation=_DENSE.representation,
                            shards=ranks, shard=rank)
  bounds = caps.bounds
  buf = bytearray(bounds.reply_bytes(depth))
  _, rows = codec.begin_reply(buf, bounds=bounds, session=1, generation=0,
                              round_id=0, request=0, depth=depth)
  rows.values[:] = 0
  rows.n[:] = caps.width
  return bytes(buf)


def link_bytes_per_round(link_gbps: float, round_ms: float) -> int:
  """Whole bytes the link carries in one round (exact decimal arithmetic)."""
  exact = (Fraction(repr(link_gbps)) * 10 ** 9 / 8
           * Fraction(repr(round_ms)) / 1000)
  return exact.numerator // exact.denominator


def fleet_table(rows: list[dict[str, typing.Any]], *, depth: int,
                fleet: list[int], round_ms: float,
                link_gbps: float) -> dict[str, typing.Any]:
  """Link load of N concurrent requests, and requests one link sustains.

  Args:
    rows: the size records of `main` (its dense and sparse layouts are
      used; the TP2 shard is one half of a split link, not a request).
    depth: draft depth D (rows of each request's REPLY frame, per round).
    fleet: the concurrent request counts N.
    round_ms: verification round time in ms.
    link_gbps: nominal link rate in Gb/s.

  Returns:
    The JSON record of the table (also printed).
  """
  if round_ms <= 0 or not fleet or min(fleet) < 1:
    raise ValueError("fleet_table: round_ms must be > 0 and fleet values >= 1")
  link_round = link_bytes_per_round(link_gbps, round_ms)
  completion = layouts.FIXED_BYTES[layouts.Kind.COMPLETION]
  out: dict[str, typing.Any] = {
      "round_ms": round_ms, "link_gbps": link_gbps, "depth": depth,
      "link_bytes_per_round": link_round, "completion_frame": completion,
      "requests": fleet, "layouts": []}
  for r in rows:
    if r["layout"] == "tp2_shard":
      continue  # one shard of a split link, not a whole request's q
    per_request = {"estimate": r["estimate_request"],
                   "measured": r["frames_request"] + (
                       completion if r.get("completion", True) else 0)}
    entry = {"layout": r["layout"]}
    for kind, size in per_request.items():
      entry[f"{kind}_bytes_request_round"] = size
      entry[f"{kind}_sustained"] = link_round // size
    entry["by_requests"] = []
    for n in fleet:
      load = {"requests": n}
      for kind, size in per_request.items():
        load[f"{kind}_bytes_per_s"] = size * n / (round_ms / 1e3)
        # Against the same whole bytes per round as `sustained`: N fits
        # exactly when the load is at most 100%.
        load[f"{kind}_link_pct"] = 100 * size * n / link_round
      entry["by_requests"].append(load)
    out["layouts"].append(entry)

  print(f"\nfleet: one {link_gbps:g} Gb/s worker -> verifier link, one round "
        f"of depth {depth} per request every {round_ms:g} ms "
        f"({link_round:,} link bytes per round)")
  print("  bytes per request per round: estimate = q payload only (seed); "
        f"measured = its REPLY frame ({depth} rows) + 1 COMPLETION frame "
        f"({completion} B)")
  print(f"  {'layout':>10} {'est B/req':>11} {'meas B/req':>11} "
        f"{'sustained est':>14} {'sustained meas':>15}")
  for e in out["layouts"]:
    print(f"  {e['layout']:>10} {e['estimate_bytes_request_round']:>11,} "
          f"{e['measured_bytes_request_round']:>11,} "
          f"{e['estimate_sustained']:>14,} {e['measured_sustained']:>15,}")
  print("  link load, % of the link (estimate / measured); > 100% does not "
        "fit in a round")
  print(f"  {'layout':>10} " + " ".join(f"{'N=' + str(n):>17}" for n in fleet))
  for e in out["layouts"]:
    cells = [f"{b['estimate_link_pct']:.3g}/{b['measured_link_pct']:.3g}"
             for b in e["by_requests"]]
    print(f"  {e['layout']:>10} " + " ".join(f"{c:>17}" for c in cells))
  return out


def main(argv: list[str]) -> int:
  del argv
  vocab, depth, requests = _VOCAB.value, _DEPTH.value, _REQUESTS.value
  ks = [int(k) for k in _KS.value]
  link_bytes_per_ms = _LINK_GBPS.value * 1e9 / 8 / 1e3

  print(f"q sizes: V={vocab} depth={depth} requests={requests} "
        f"(MB = 10^6 bytes; estimate = payload only, as in the seed)")
  print(f"{'layout':>10} {'est/request':>13} {'est/batch':>13} "
        f"{'REPLY/request':>15} {'overhead':>9} {'ideal ms/req':>13} "
        f"{'ideal ms/batch':>15}")
  record: dict[str, typing.Any] = {"vocab": vocab, "depth": depth, "requests": requests, "rows": []}

  def add(name, per_request, measured, **extra):
    ideal_ms = per_request / link_bytes_per_ms
    # The batch's ideal (the seed's 2.068 ms for dense at the defaults) is
    # what a round of --requests waits for: the bench's targets use it.
    batch_ms = per_request * requests / link_bytes_per_ms
    print(f"{name:>10} {per_request:>13,} {per_request * requests:>13,} "
          f"{measured:>15,} {measured / per_request - 1:>8.2%} "
          f"{ideal_ms:>13.4f} {batch_ms:>15.4f}")
    record["rows"].append({"layout": name, "estimate_request": per_request,
                           "estimate_batch": per_request * requests,
                           "frames_request": measured,
                           "framing_request": measured - per_request,
                           "ideal_ms_request": ideal_ms,
                           "ideal_ms_batch": batch_ms, **extra})

  for name, fmt, v, k in _layouts(vocab, ks):
    frame, bounds = _reply_frame(fmt, v, k, depth)
    codec.decode(frame, bounds, validate_rows=True)   # a valid frame
    add(name, fmt.seed_bytes(depth, v, k), len(frame))
  for n in sorted({int(x) for x in _LINK_RANKS.value}):
    for rank, name in ((0, f"tp{n}_link0"), (1, f"tp{n}_link")):
      add(name, _DENSE.seed_bytes(depth, -(-vocab // n), 0),
          len(_rank_link_frame(vocab, depth, n, rank)),
          completion=rank == 0)
  two_slots = 2 * _DENSE.seed_bytes(depth, vocab, 0) * requests
  print(f"two in-flight dense batch slots: {two_slots:,} bytes "
        f"({two_slots / 2 ** 20:.2f} MiB)")
  print(f"framing: header {layouts.HEADER_BYTES} B + REPLY body "
        f"{layouts.BODIES[layouts.Kind.REPLY].itemsize} B + 8 B per row, "
        "per request; COMPLETION frame "
        f"{layouts.FIXED_BYTES[layouts.Kind.COMPLETION]} B per request")
  record["two_dense_slots"] = two_slots

  problems = []
  if (vocab, depth, requests) == (dj.DEFAULT_VOCAB, 5, 4):
    by_name = {r["layout"]: r for r in record["rows"]}
    for name, (req, batch) in _SEED.items():
      if name in by_name and (by_name[name]["estimate_request"],
                              by_name[name]["estimate_batch"]) != (req, batch):
        problems.append(f"{name}: {by_name[name]['estimate_request']} != "
                        f"seed {req}")
    if two_slots != _SEED_TWO_SLOTS:
      problems.append(f"two slots {two_slots} != seed {_SEED_TWO_SLOTS}")
    dense_ms = round(by_name["dense"]["ideal_ms_request"], 3)
    if _LINK_GBPS.value == 40.0 and (dense_ms, round(dense_ms * 4, 3)) != (
        _SEED_DENSE_MS):
      problems.append(f"dense ideal {dense_ms} ms != seed {_SEED_DENSE_MS}")
    print("seed table reproduced" if not problems else
          "MISMATCH: " + "; ".join(problems))
  record["fleet"] = fleet_table(
      record["rows"], depth=depth, fleet=[int(n) for n in _FLEET.value],
      round_ms=_ROUND_MS.value, link_gbps=_LINK_GBPS.value)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=2)
    print(f"Wrote {_JSON_OUT.value}")
  return 1 if problems else 0


if __name__ == "__main__":
  cli.run(main)
