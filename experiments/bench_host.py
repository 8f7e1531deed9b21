"""Host work of one sparse round, per side and per phase, in memory.

    python -m experiments.bench_host --json_out /tmp/bench_host.json

Expected runtime: about 15 s on a 2-core CPU with the defaults (V =
129280, 4 requests x depth 5, k = 32, --host_rounds=2000), most of it
importing JAX and compiling the sparse validator once; `--quick` (300
rounds) about 8 s.

No socket and no model: the protocol's two sessions wired in memory
(`dyadic_jax.testing.session_pair`, record=False) serve prepared rows
(experiments/bench_bridge.py's `proposals` and `Rounds`: valid dyadic rows
whose tokens the round's PROPOSAL draws pick, so the sampling audit
passes). Each repetition serves one new round through the sessions' public
methods, one phase after the other, each timed alone (bench_bridge's
`interleaved`: machine noise hits every phase alike); figures are medians
over the repetitions, with the garbage collector off.

Phases (the order of a round):

  verifier  begin      `VerifierSession.begin`: the STEP message (one
                       PACKED_STEP frame of R records; R STEP frames
                       on a session without the feature)
  worker    receive    `WorkerSession.receive` of it: frames split,
                       authenticated, decoded, views moved, the answer's
                       frame laid out (PACKED: one frame, R records)
  worker    write      the proposer's rows copied into the frame
                       (`proposer.write`: what a drafted proposal costs to
                       hand over; the model's own time apart)
  worker    finish     `WorkerSession.finish`: records, tokens kept for the
                       COMMIT, the frame sealed (AES-256-GMAC)
  verifier  receive    `VerifierSession.receive` of the answer (a bytes
                       copy, as a link hands it over): split, checked,
                       records compared, rows staged -> Stage
  verifier  validate   the sparse q format's verdict of the staged batch
                       with the sampling audit (`validate(..., device=True)`,
                       the host validator on CPU)
  verifier  plan       `VerifierSession.staged`: the verdict's codes, the
                       Plan (rows copied out of the slot)
  verifier  commit     `VerifierSession.commit` of the round's outcomes
                       (every drafted token accepted, a bonus token): the
                       results and the COMMIT message
  worker    commit     `WorkerSession.receive` of the COMMIT: the views move
                       (anchor, digest, last token)

The PROPOSAL draws are looked up, untimed (a verifier computes them while
the worker drafts). Floors in the same run, over the same bytes (the
answer message): `numpy_pass` (one numpy reduction over them), `memcpy`
(np.copyto of them) and `numpy_call` (one numpy call on a 1-element
array: the fixed cost every numpy call pays); each phase is reported in
microseconds and as multiples of them. Target (issue 38): each side's
host work <= 0.4 ms (worker: receive + write + finish + commit; verifier:
begin + receive + validate + plan + commit).
"""

import gc
import json
import math
import os
import platform
import time

from absl import flags

from experiments import cli
# bench_bridge's data and timing helpers, and its flags (--vocab,
# --requests, --depth, --k, --seed, --quick, --json_out mean the same here).
from experiments import bench_bridge

_HOST_ROUNDS = flags.DEFINE_integer(
    "host_rounds", 2000, "Timed rounds (repetitions of every phase), >= 1 "
    "(--quick: 300 unless given).", lower_bound=1)
_TARGET_MS = 0.4

cli.parse_flags_early(__name__)

# pylint: disable=g-import-not-at-top,g-bad-import-order
import jax
import numpy as np

from dyadic_jax import bridge
from dyadic_jax.bridge import proposer as proposer_lib
from dyadic_jax.wire import qformats
from dyadic_jax.wire.layouts import Representation
# pylint: enable=g-import-not-at-top,g-bad-import-order

_SIDES = {"worker": ("w_receive", "w_write", "w_finish", "w_commit"),
          "verifier": ("v_begin", "v_receive", "v_validate", "v_plan",
                       "v_commit")}
_FLOORS = ("numpy_pass", "memcpy", "numpy_call")


def phases(requests, depth, vocab, k, rng, rounds_n):
  """{name: [seconds]} of every phase and floor over `rounds_n` rounds,
  and the round's sizes."""
  caps = bridge.Capabilities(vocab=vocab, max_depth=depth,
                             max_requests=requests, max_slots=2,
                             representation=Representation.SPARSE,
                             max_support=k)
  props = bench_bridge.proposals(rng, caps, depth, requests)
  warmup = bench_bridge._WARMUP   # pylint: disable=protected-access
  rounds = bench_bridge.Rounds(props, depth, warmup + rounds_n + 2)
  pair = bench_bridge.host_pair(caps, rounds)
  v, w = pair.verifier, pair.worker
  fmt = caps.format
  rids = list(range(requests))
  outcomes = [(depth, 1)] * requests
  state = {}

  def v_begin():
    state["step"] = v.begin(rids, depth, pair.now)[0].message

  def w_receive():
    state["answer"] = w.receive(state["step"], pair.now)

  def w_write():
    for p in state["answer"].propose:
      proposer_lib.write(p.rows, rounds.proposal(p.seed, p.round))

  def w_finish():
    sent = w.finish(state["answer"], {})[-1]
    state["message"] = bytes(sent.message)   # what the link hands over
    w.released(sent.slot)

  def draws():     # untimed: made while the worker drafts
    state["draws"] = rounds.draws_of(*v.draw_inputs(), depth)

  def v_receive():
    state["stage"] = v.receive(state["message"], pair.now)[0]

  def v_validate():
    state["verdict"] = fmt.validate(state["stage"].rows, vocab=vocab,
                                    draws=state["draws"], device=True)

  def v_plan():
    state["plan"] = v.staged(state["verdict"]).plan

  def settle():    # untimed: every round must verify
    bench_bridge._accepted(state["plan"])   # pylint: disable=protected-access

  def v_commit():  # every drafted token accepted, then a bonus token
    state["commit"] = v.commit(state["plan"], outcomes)[1].message

  def w_commit():
    w.receive(state["commit"], pair.now)

  for fn in (v_begin, w_receive, w_write, w_finish, draws, v_receive,
             v_validate, v_plan, settle, v_commit, w_commit):
    fn()
  commits = w.counters.events("commits")
  # The staged batch's verdict is the loose kernel's (numpy, unaudited).
  want = fmt.validate(state["stage"].rows, vocab=vocab)
  if not (np.array_equal(want.counts, np.asarray(state["verdict"].counts))
          and np.array_equal(want.codes, state["verdict"].codes)):
    raise RuntimeError("bench_host: the staged verdict differs from the "
                       "kernel's")
  message = state["message"]
  data = np.frombuffer(message, np.uint8)
  src = data[:len(data) // 4 * 4].view(np.int32)
  dst = np.empty_like(data)
  one = np.zeros(1, np.int32)
  stages = {"v_begin": v_begin, "w_receive": w_receive, "w_write": w_write,
            "w_finish": w_finish, "draws": draws, "v_receive": v_receive,
            "v_validate": v_validate, "v_plan": v_plan, "settle": settle,
            "v_commit": v_commit, "w_commit": w_commit,
            "numpy_pass": lambda: np.add.reduce(src),
            "memcpy": lambda: np.copyto(dst, data),
            "numpy_call": lambda: np.add(one, one)}
  samples = bench_bridge.interleaved(stages, rounds_n, warmup=warmup)
  del samples["draws"], samples["settle"]
  # Every COMMIT moved the worker's views, none resynced a view.
  if (w.counters.events("commits") - commits != requests * (warmup + rounds_n)
      or w.counters.events("resyncs") or w.counters.total_errors()):
    raise RuntimeError(f"bench_host: the worker's commits went wrong: "
                       f"{w.counters.snapshot()}")
  sizes = {"step_bytes": len(state["step"]), "reply_bytes": len(message),
           "q_bytes": int(sum(p.values.nbytes + p.ids.nbytes
                              for p in props))}
  return samples, sizes


def report(samples):
  """Per phase and per side: median us, and as multiples of the floors."""
  med = {name: float(np.median(s)) * 1e6 for name, s in samples.items()}
  floors = {f: med[f] for f in _FLOORS}

  def entry(us):
    return dict({"median_us": us}, **{f"x_{f}": us / floors[f]
                                      for f in _FLOORS})
  out = {"phases": {}, "sides": {}, "floors_us": floors}
  for name, s in samples.items():
    x = np.asarray(s) * 1e6
    out["phases"][name] = dict(entry(med[name]), p90_us=float(
        np.percentile(x, 90)), min_us=float(x.min()), n=int(x.size))
  for side, parts in _SIDES.items():
    us = sum(med[p] for p in parts)
    out["sides"][side] = dict(entry(us), parts=list(parts),
                              target_ms=_TARGET_MS,
                              share={p: med[p] / us for p in parts},
                              **{"pass": bool(us * 1e-3 <= _TARGET_MS)})
  return out


def main(argv):
  del argv
  quick = bench_bridge._QUICK.value   # pylint: disable=protected-access
  vocab = (2048 if quick and not flags.FLAGS["vocab"].present
           else bench_bridge._VOCAB.value)   # pylint: disable=protected-access
  rounds_n = (300 if quick and not flags.FLAGS["host_rounds"].present
              else _HOST_ROUNDS.value)
  # pylint: disable=protected-access
  requests, depth, k = (bench_bridge._REQUESTS.value,
                        bench_bridge._DEPTH.value, bench_bridge._K.value)
  seed, json_out = bench_bridge._SEED.value, bench_bridge._JSON_OUT.value
  # pylint: enable=protected-access
  start = time.perf_counter()
  print(f"bench_host: sparse k={k}, {requests} requests x depth {depth}, "
        f"V={vocab}, {rounds_n} rounds, "
        f"backend={jax.default_backend()} cpus={os.cpu_count()}")
  samples, sizes = phases(requests, depth, vocab, k,
                          np.random.default_rng(seed), rounds_n)
  rec = report(samples)
  f = rec["floors_us"]
  print(f"STEP {sizes['step_bytes']:,} B, answer {sizes['reply_bytes']:,} B"
        f" (q {sizes['q_bytes']:,} B); floors over the answer's bytes: "
        f"numpy_pass {f['numpy_pass']:.2f} us, memcpy {f['memcpy']:.2f} us, "
        f"numpy_call {f['numpy_call']:.2f} us")
  header = (f"  {'phase':<16} {'median us':>10} {'p90 us':>8} "
            f"{'x np pass':>10} {'x memcpy':>9} {'x np call':>10}")
  print(header + "\n  " + "-" * (len(header) - 2))
  for name, p in rec["phases"].items():
    if name in _FLOORS:
      continue
    print(f"  {name:<16} {p['median_us']:10.1f} {p['p90_us']:8.1f} "
          f"{p['x_numpy_pass']:10.1f} {p['x_memcpy']:9.1f} "
          f"{p['x_numpy_call']:10.1f}")
  for side, s in rec["sides"].items():
    share = ", ".join(f"{n} {x:.0%}" for n, x in s["share"].items())
    print(f"  [{'PASS' if s['pass'] else 'MISS'}] {side} host work "
          f"{s['median_us'] / 1e3:.3f} ms <= {_TARGET_MS} ms "
          f"({s['x_numpy_pass']:.0f}x numpy_pass, {s['x_numpy_call']:.0f} "
          f"numpy calls; {share})")
  wall = time.perf_counter() - start
  print(f"total wall time {wall:.1f} s")
  if json_out:
    record = {"config": {"vocab": vocab, "requests": requests,
                         "depth": depth, "k": k, "rounds": rounds_n,
                         "seed": seed,
                         "quick": quick, "backend": jax.default_backend(),
                         "cpus": os.cpu_count(),
                         "python": platform.python_version(),
                         "numpy": np.__version__, "jax": jax.__version__},
              "sizes": sizes, **rec, "wall_s": wall}
    assert all(math.isfinite(x) for x in bench_bridge._numbers(record))  # pylint: disable=protected-access
    with open(json_out, "w") as out:
      json.dump(record, out, indent=2)
    print(f"Wrote {json_out}")


if __name__ == "__main__":
  gc.collect()
  cli.run(main)
