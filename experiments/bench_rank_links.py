"""Dense q over one link vs rank-to-rank links, measured in one run.

    python -m experiments.bench_rank_links [--vocab=129280 --tokens=12
        --json_out=/tmp/bench_rank_links.json --plot_out=/tmp/links.png]

Expected runtime: about 5-6 minutes on a 2-core CPU at V = 129280 (three
pipelines of 3, 4 and 4 processes, each mostly JAX start-up and compiles).

Runs the main job three times with the same seed, --q=dense and a TP-2
verifier (2 jax.distributed ranks on loopback):

  one link     --verifier_ranks=2: the worker (one process) sends the
               whole dense q to verifier rank 0, which broadcasts it to
               rank 1 with the round's plan (gloo);
  rank links   --worker_ranks=2 --verifier_ranks=2: worker rank s sends
               only vocabulary block s to verifier rank s on its own link
               (dyadic_jax/bridge/rank_links.py); the plan travels without q.
  rank links, 1 in flight
               the same with --in_flight=1: one exchange at a time instead
               of two request groups in flight (the others' default).

(each with a 60 s exchange deadline: a slow healthy round is measured, not
timed out) and reports, per link: bytes per request and round (the seed expects
V / 2 x 4 B x D = 1,292,800 B per rank link at V = 129280, D = 5, plus
framing), the link's time per round (STEP out to the last frame in, p50),
that time per request of a round beside the seed's ideal 0.259 ms/request/shard
(a block's bytes at 40 Gb/s; the one link carries both blocks), and two floors measured
here on the same bytes: one memcpy, and one ZeroMQ loopback send of a
round's bytes; and per run the rounds' time (draft + bridge +
verification + host, the time split's round phases) and new tokens per
second of it. It checks that every run committed the same tokens.

What loopback can show: the bytes each link carries, that no rank receives
another rank's block, what framing, MACs and copies cost per byte, and that
the two modes commit the same tokens. What it cannot: a NIC's bandwidth, a
shared uplink's contention, or two links' concurrency (on this machine all
processes share the same 2 cores and memory bus, and the link time
includes the worker's own draft, which dominates at this size).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from experiments import cli

_VOCAB = flags.DEFINE_integer(
    "vocab", cli.DEFAULT_VOCAB, f"Vocabulary V, 2..{cli.MAX_VOCAB}.",
    lower_bound=2, upper_bound=cli.MAX_VOCAB)
_TOKENS = flags.DEFINE_integer("tokens", 12, "New tokens per request.",
                               lower_bound=1, upper_bound=10_000)
_SEED = flags.DEFINE_integer("seed", 0, "The pipelines' --seed.",
                             lower_bound=0, upper_bound=1 << 40)
_LINK_GBPS = flags.DEFINE_float("link_gbps", 40.0, "Link rate of the ideal "
                                "bound, Gb/s.")
_JSON_OUT = flags.DEFINE_string("json_out", "bench_rank_links.json",
                                "Where to write the JSON record ('': none).")
_PLOT_OUT = flags.DEFINE_string("plot_out", "bench_rank_links.png",
                                "Where to write the PNG plot ('': none).")
cli.check("link_gbps", lambda g: 0 < g < 1e6, "--link_gbps must be > 0")
cli.check_output_path("json_out")
cli.check_output_path("plot_out")
cli.parse_flags_early(__name__, extra="experiments")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODES = {"one link": ["--verifier_ranks=2"],
          "rank links": ["--worker_ranks=2", "--verifier_ranks=2"],
          "rank links, 1 in flight": ["--worker_ranks=2",
                                      "--verifier_ranks=2", "--in_flight=1"]}
# The time split's phases of the rounds themselves.
_ROUND_PHASES = ("draft", "bridge", "verification", "host")


def _pipeline(flags_, tmp, name):
  out = os.path.join(tmp, "".join(c if c.isalnum() else "_" for c in name)
                     + ".json")
  env = dict(os.environ, PYTHONPATH=_ROOT)
  env.pop("XLA_FLAGS", None)
  start = time.perf_counter()
  proc = subprocess.run(
      # The toy pair: any V (the trained pair's is its tokenizer's).
      [sys.executable, "-m", "experiments.pp1_pipeline", "--model=toy",
       "--q=dense",
       f"--vocab={_VOCAB.value}", f"--tokens={_TOKENS.value}",
       f"--seed={_SEED.value}", f"--json_out={out}", "--plot_out=",
       # Healthy runs are measured: no slow round may become a fallback.
       "--timeout=60",
       *flags_], cwd=_ROOT, env=env, capture_output=True, text=True,
      timeout=1800)
  if proc.returncode:
    raise SystemExit(f"{cli.program()}: the {name} pipeline failed:\n"
                     f"{proc.stderr[-2000:]}")
  sys.stderr.write(f"{name}: {time.perf_counter() - start:.0f} s\n")
  with open(out) as f:
    return json.load(f)


def _floors(nbytes, repeats=20):
  """(memcpy ms, ZeroMQ loopback send+recv ms) of `nbytes`, medians."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import zmq
  # pylint: enable=g-import-not-at-top
  src = np.ones(max(nbytes, 1), np.uint8)
  dst = np.empty_like(src)
  copies = []
  for _ in range(repeats):
    t = time.perf_counter()
    np.copyto(dst, src)
    copies.append(time.perf_counter() - t)
  ctx = zmq.Context.instance()
  a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
  port = a.bind_to_random_port("tcp://127.0.0.1")
  b.connect(f"tcp://127.0.0.1:{port}")
  sends = []
  for _ in range(repeats):
    t = time.perf_counter()
    a.send(src, copy=False)
    b.recv(copy=False)
    sends.append(time.perf_counter() - t)
  a.close(0)
  b.close(0)
  return float(np.median(copies) * 1e3), float(np.median(sends) * 1e3)


def main(argv):
  del argv
  with tempfile.TemporaryDirectory(prefix="bench-links-") as tmp:
    runs = {name: _pipeline(f, tmp, name) for name, f in _MODES.items()}
  requests = runs["one link"]["config"]["requests"]
  depth = runs["one link"]["config"]["depth"]
  shard_bytes = 4 * (-(-_VOCAB.value // 2)) * depth
  ideal_ms = shard_bytes * 8 / (_LINK_GBPS.value * 1e9) * 1e3
  same = all(r["committed"] == runs["one link"]["committed"]
             for r in runs.values())
  speed = []
  for name, record in runs.items():
    split = record["time_s"]["split"]
    rounds_s = sum(split[p] for p in _ROUND_PHASES)
    speed.append({"mode": name, "in_flight": record["config"]["in_flight"],
                  "rounds": record["rounds"],
                  "request_rounds": record["request_rounds"],
                  "fallback_rounds": record["fallback_rounds"],
                  "rounds_s": rounds_s,
                  "tokens_per_rounds_s": record["tokens"] / rounds_s,
                  **{f"{p}_s": split[p] for p in _ROUND_PHASES}})
  rows = []
  for name, record in runs.items():
    for link in record["links"]:
      memcpy_ms, zmq_ms = _floors(int(link["bytes_per_round"]))
      shards = 2 if name == "one link" else 1     # blocks the link carries
      # A round carries one group's requests (two groups in flight: half).
      per_round = record["request_rounds"] / max(record["rounds"], 1)
      per_request = link["round_ms_p50"] / per_round
      rows.append({
          "mode": name, "link": link["rank"], "shards_on_link": shards,
          "bytes_per_request_round": link["bytes_per_request_round"],
          "bytes_per_round": link["bytes_per_round"],
          "requests_per_round": per_round,
          "round_ms_p50": link["round_ms_p50"],
          "ms_per_request": per_request,
          "ideal_ms_per_request": shards * ideal_ms,
          "ratio_to_ideal": per_request / (shards * ideal_ms),
          "memcpy_ms_round": memcpy_ms, "zmq_loopback_ms_round": zmq_ms,
          "fallback_rounds": record["fallback_rounds"]})
  print(f"\ndense q, V={_VOCAB.value}, D={depth}, {requests} requests, TP-2 "
        f"verifier; ideal {ideal_ms:.3f} ms/request/shard "
        f"({shard_bytes:,} B at {_LINK_GBPS.value:g} Gb/s)")
  print(f"  {'mode':<24} {'link':>4} {'B/request-round':>16} "
        f"{'p50 ms/round':>13} {'ms/request':>11} {'ideal':>7} "
        f"{'x ideal':>8} {'memcpy ms':>10} {'zmq ms':>8}")
  for r in rows:
    print(f"  {r['mode']:<24} {r['link']:>4} "
          f"{r['bytes_per_request_round']:>16,.0f} {r['round_ms_p50']:>13.1f} "
          f"{r['ms_per_request']:>11.2f} {r['ideal_ms_per_request']:>7.3f} "
          f"{r['ratio_to_ideal']:>8.1f} {r['memcpy_ms_round']:>10.2f} "
          f"{r['zmq_loopback_ms_round']:>8.2f}")
  print("  (ms/request: the link's p50 round time / the requests of a "
        "round (a group's, with two in flight); ideal: the "
        "link's blocks at --link_gbps; memcpy, zmq: one round's bytes of "
        "that link, copied once / sent once over loopback)")
  print(f"\n  {'mode':<24} {'in flight':>9} {'rounds':>6} {'rounds s':>9} "
        f"{'tokens/s':>9} {'draft s':>8} {'bridge s':>9} {'verify s':>9} "
        f"{'host s':>7}")
  for r in speed:
    print(f"  {r['mode']:<24} {r['in_flight']:>9} {r['rounds']:>6} "
          f"{r['rounds_s']:>9.2f} {r['tokens_per_rounds_s']:>9.1f} "
          f"{r['draft_s']:>8.2f} {r['bridge_s']:>9.2f} "
          f"{r['verification_s']:>9.2f} {r['host_s']:>7.2f}")
  print("  (rounds s: the time split's draft + bridge + verification + host; "
        "tokens/s: the new tokens over it)")
  print(f"  committed tokens identical in every mode: {same}")
  record = {"vocab": _VOCAB.value, "depth": depth, "requests": requests,
            "ideal_ms_per_request_per_shard": ideal_ms,
            "shard_bytes_per_request": shard_bytes, "links": rows,
            "rounds": speed, "committed_identical": same,
            "time_split": {n: r["time_s"] for n, r in runs.items()}}
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=1)
    print(f"wrote {_JSON_OUT.value}")
  if _PLOT_OUT.value:
    _plot(rows, ideal_ms, _PLOT_OUT.value)
    print(f"wrote {_PLOT_OUT.value}")
  return 0 if same else 1


def _plot(rows, ideal_ms, path):
  # pylint: disable=g-import-not-at-top
  import logging
  logging.getLogger("matplotlib").setLevel(logging.ERROR)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  # pylint: enable=g-import-not-at-top
  names = [f"{r['mode']}\nlink {r['link']}" for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(14, 4.2))
  axes[0].bar(names, [r["bytes_per_request_round"] / 1e6 for r in rows])
  axes[0].set(title="bytes per request-round on each link", ylabel="MB")
  axes[1].bar(names, [r["ms_per_request"] for r in rows],
              label="measured (p50 link time / requests)")
  axes[1].plot(names, [r["ideal_ms_per_request"] for r in rows], "k_",
               markersize=30, label=f"ideal ({ideal_ms:.3f} ms per block)")
  axes[1].set_yscale("log")
  axes[1].set(title="link time per request", ylabel="ms")
  axes[1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  cli.run(main)
