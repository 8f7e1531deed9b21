"""The seed's q size table, by shape arithmetic, beside measured frames.

    python -m experiments.wire_sizes [--json_out /tmp/wire_sizes.json]

Expected runtime: about 2 s (no JAX computation; it encodes one frame of
each layout with dyadic_jax.wire).

Estimated sizes are exact shape arithmetic, excluding headers and
checksums, as in the seed (MB = 10^6 bytes): dense FP32 q at V=129280 over
depth 5, sparse int32 id + FP32 q for k in --ks, one TP2 vocabulary shard,
the 40 Gb/s serialization bounds and two in-flight dense batch slots.
Measured sizes are the wire v2 frames actually encoded (32-byte header
with CRC32C + 16-byte REPLY body + payload), one REPLY frame per position.
The script fails (exit 1) if the arithmetic does not reproduce the seed's
figures.
"""

import json

from absl import app
from absl import flags
import numpy as np

import dyadic_jax as dj
from dyadic_jax.wire import codec, layouts

_VOCAB = flags.DEFINE_integer("vocab", dj.DEFAULT_VOCAB, "Vocabulary size V.")
_DEPTH = flags.DEFINE_integer("depth", 5, "Draft depth D (rows per request).")
_REQUESTS = flags.DEFINE_integer("requests", 4, "Requests per batch.")
_KS = flags.DEFINE_list("ks", ["16", "32", "64", "256"],
                        "Sparse support sizes k.")
_LINK_GBPS = flags.DEFINE_float("link_gbps", 40.0,
                                "Nominal link rate for the ideal bounds.")
_JSON_OUT = flags.DEFINE_string("json_out", None,
                                "Optional path for a JSON record.")

# The seed's table (V=129280, depth 5, four requests), bytes.
_SEED = {"dense": (2_585_600, 10_342_400), "k16": (640, 2_560),
         "k32": (1_280, 5_120), "k64": (2_560, 10_240),
         "k256": (10_240, 40_960), "tp2_shard": (1_292_800, 5_171_200)}
_SEED_TWO_SLOTS = 20_684_800
_SEED_DENSE_MS = (0.517, 2.068)


def _reply_frame(vocab, k=None):
  """One encoded REPLY frame of a valid row (dense, or sparse with k ids)."""
  if k is None:
    values = np.zeros(vocab, np.float32)
    values[0] = 1.0
    ids = None
  else:
    values = np.zeros(k, np.float32)
    values[0] = 1.0
    ids = np.arange(k, dtype=np.int32)
  return codec.encode(layouts.Kind.REPLY, session=1, generation=0, round_id=0,
                      body={"position": 0, "token": 0, "mass": dj.M},
                      values=values, ids=ids)


def main(argv):
  del argv
  vocab, depth, requests = _VOCAB.value, _DEPTH.value, _REQUESTS.value
  ks = [int(k) for k in _KS.value]
  rows = {"dense": 4 * vocab, "tp2_shard": 4 * (-(-vocab // 2))}
  rows.update({f"k{k}": 8 * k for k in ks})
  bounds = codec.Bounds(vocab=vocab, max_support=max(ks), max_depth=depth)
  link_bytes_per_ms = _LINK_GBPS.value * 1e9 / 8 / 1e3

  print(f"q sizes: V={vocab} depth={depth} requests={requests} "
        f"(MB = 10^6 bytes; estimate = payload only, as in the seed)")
  print(f"{'layout':>10} {'est/request':>13} {'est/batch':>13} "
        f"{'frame/row':>10} {'frames/request':>15} {'overhead':>9} "
        f"{'ideal ms/req':>13}")
  record = {"vocab": vocab, "depth": depth, "requests": requests, "rows": []}
  for name, row_bytes in rows.items():
    per_request = row_bytes * depth
    k = int(name[1:]) if name.startswith("k") else None
    if name == "tp2_shard":
      frame = len(_reply_frame(-(-vocab // 2)))
    else:
      frame_bytes = _reply_frame(vocab, k)
      codec.decode(frame_bytes, bounds)  # the measured frame is a valid one
      frame = len(frame_bytes)
    measured = frame * depth
    ideal_ms = per_request / link_bytes_per_ms
    print(f"{name:>10} {per_request:>13,} {per_request * requests:>13,} "
          f"{frame:>10,} {measured:>15,} {measured / per_request - 1:>8.2%} "
          f"{ideal_ms:>13.4f}")
    record["rows"].append({"layout": name, "estimate_request": per_request,
                           "estimate_batch": per_request * requests,
                           "frame_row": frame, "frames_request": measured,
                           "ideal_ms_request": ideal_ms})
  two_slots = 2 * rows["dense"] * depth * requests
  print(f"two in-flight dense batch slots: {two_slots:,} bytes "
        f"({two_slots / 2 ** 20:.2f} MiB)")
  print(f"framing: header {layouts.HEADER.itemsize} B + REPLY body "
        f"{layouts.BODIES[layouts.Kind.REPLY].itemsize} B per row; "
        f"COMPLETION frame {layouts.frame_bytes(layouts.Kind.COMPLETION)} B "
        f"per round")
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
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=2)
    print(f"Wrote {_JSON_OUT.value}")
  return 1 if problems else 0


if __name__ == "__main__":
  app.run(main)
