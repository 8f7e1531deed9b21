"""Dense q over one link vs rank-to-rank links, measured in one run.

    python -m experiments.bench_rank_links [--vocab=129280 --tokens=12
        --json_out=/tmp/bench_rank_links.json --plot_out=/tmp/links.png]

Expected runtime: about 3-4 minutes on a 2-core CPU at V = 129280 (two
pipelines of 3 and 4 processes, each mostly JAX start-up and compiles).

Runs the main job twice with the same seed, --q=dense and a TP-2 verifier
(2 jax.distributed ranks on loopback):

  one link     --verifier_ranks=2: the worker (one process) sends the
               whole dense q to verifier rank 0, which broadcasts it to
               rank 1 with the round's plan (gloo);
  rank links   --worker_ranks=2 --verifier_ranks=2: worker rank s sends
               only vocabulary block s to verifier rank s on its own link
               (dyadic_jax/bridge/rank_links.py); the plan travels without q.

(each with a 60 s exchange deadline: a slow healthy round is measured, not
timed out) and reports, per link: bytes per request and round (the seed expects
V / 2 x 4 B x D = 1,292,800 B per rank link at V = 129280, D = 5, plus
framing), the link's time per round (STEP out to the last frame in, p50),
that time per request beside the seed's ideal 0.259 ms/request/shard
(a block's bytes at 40 Gb/s; the one link carries both blocks), and two floors measured
here on the same bytes: one memcpy, and one ZeroMQ loopback send of a
round's bytes. It checks that both runs committed the same tokens.

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
          "rank links": ["--worker_ranks=2", "--verifier_ranks=2"]}


def _pipeline(flags_, tmp, name):
  out = os.path.join(tmp, name.replace(" ", "_") + ".json")
  env = dict(os.environ, PYTHONPATH=_ROOT)
  env.pop("XLA_FLAGS", None)
  start = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.pp1_pipeline", "--q=dense",
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
  same = runs["one link"]["committed"] == runs["rank links"]["committed"]
  rows = []
  for name, record in runs.items():
    for link in record["links"]:
      per_round = link["bytes_per_round"]
      memcpy_ms, zmq_ms = _floors(int(per_round))
      shards = 2 if name == "one link" else 1     # blocks the link carries
      per_request = link["round_ms_p50"] / requests
      rows.append({
          "mode": name, "link": link["rank"], "shards_on_link": shards,
          "bytes_per_request_round": link["bytes_per_request_round"],
          "bytes_per_round": per_round,
          "round_ms_p50": link["round_ms_p50"],
          "ms_per_request": per_request,
          "ideal_ms_per_request": shards * ideal_ms,
          "ratio_to_ideal": per_request / (shards * ideal_ms),
          "memcpy_ms_round": memcpy_ms, "zmq_loopback_ms_round": zmq_ms,
          "fallback_rounds": record["fallback_rounds"]})
  print(f"\ndense q, V={_VOCAB.value}, D={depth}, {requests} requests, TP-2 "
        f"verifier; ideal {ideal_ms:.3f} ms/request/shard "
        f"({shard_bytes:,} B at {_LINK_GBPS.value:g} Gb/s)")
  print(f"  {'mode':<11} {'link':>4} {'B/request-round':>16} "
        f"{'p50 ms/round':>13} {'ms/request':>11} {'ideal':>7} "
        f"{'x ideal':>8} {'memcpy ms':>10} {'zmq ms':>8}")
  for r in rows:
    print(f"  {r['mode']:<11} {r['link']:>4} "
          f"{r['bytes_per_request_round']:>16,.0f} {r['round_ms_p50']:>13.1f} "
          f"{r['ms_per_request']:>11.2f} {r['ideal_ms_per_request']:>7.3f} "
          f"{r['ratio_to_ideal']:>8.1f} {r['memcpy_ms_round']:>10.2f} "
          f"{r['zmq_loopback_ms_round']:>8.2f}")
  print("  (ms/request: the link's p50 round time / requests; ideal: the "
        "link's blocks at --link_gbps; memcpy, zmq: one round's bytes of "
        "that link, copied once / sent once over loopback)")
  print(f"  committed tokens identical in both modes: {same}")
  record = {"vocab": _VOCAB.value, "depth": depth, "requests": requests,
            "ideal_ms_per_request_per_shard": ideal_ms,
            "shard_bytes_per_request": shard_bytes, "links": rows,
            "committed_identical": same,
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
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
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
