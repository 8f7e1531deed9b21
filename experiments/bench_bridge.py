"""Benchmark of the host bridge: encode, CRC32C, ZeroMQ, decode, stage, validate.

    python -m experiments.bench_bridge --json_out /tmp/bench_bridge.json

Expected runtime: 20-30 s on a 2-core CPU with the defaults (V = 129280,
4 requests x depth 5, --repeats=100, --round_trips=2000, --full_rounds=300),
a few seconds of it importing JAX and compiling `staging.dense_rows`;
`--quick` (V = 2048, few repeats; what tests/test_bench_bridge.py runs)
takes 3-5 s.

Dense rows (one request: D rows of V float32; one batch: R requests), each
stage timed --repeats times, the stages interleaved within each repetition
so that machine noise hits them alike; median and p90 in ms:

  encode       codec.encode of every REPLY row into the worker's
               preallocated buffer (`out=`), CRC32C of each frame included
  completion   what the worker adds per request: CRC32C over its D REPLY
               frames (COMPLETION `replies_crc`) and the COMPLETION encode
  checksum     codec.checksum of every REPLY frame alone (one CRC pass)
  send_tcp     one reply message (every REPLY + COMPLETION frame) from a
  send_ipc     ROUTER to a DEALER through `transport.Endpoint`, zero-copy
               frames, send until the DEALER holds it and ZeroMQ released
               the sender's buffers (tcp://127.0.0.1 and ipc://)
  decode       codec.decode(validate_rows=False) of every received frame:
               framing, bounds and CRC32C
  stage        `Verifier._stage` of every request: COMPLETION checks, its
               `replies_crc` recomputed over the raw frames, the rows copied
               into a `SlotPool` slot
  stage_copy   the copy of the rows into the slot alone (part of stage)
  validate     `staging.dense_rows` on the slot (what `_validate_dense`
               runs), counts and ok blocked on
  naive        the alternative a user would write: `wire.validate_q_row`
               (numpy) on every received row
  host_objects the same host work through the real objects, no socket:
               `Verifier._step` x R, `Worker.handle` (STEP decode, encode,
               COMPLETION), `Verifier._message` (decode, `_stage`) and
               `Verifier._validate_dense`

Floors measured in the same run: `memcpy` (np.copyto of the R*D*V float32
of q into a preallocated buffer, interleaved with the stages like them, so
its bytes are as cold as theirs; `memcpy_hot` is the same copy back to back,
for information), and `read` (one fused jitted jnp.sum of the staged slot,
read in place through dlpack); and the seed's ideal: q bytes at
--link_gbps (40 Gb/s: 0.517 ms per request, 2.068 ms per batch at
V = 129280). The headline, "host-side bridge work (all but the socket) for
a dense batch", is encode + completion + decode + stage + validate (sum of
the stage medians; `host_objects` is the same work measured in one piece),
against the targets <= the 40 Gb/s ideal and <= 5x memcpy.

Sparse rows (k = --k), round trips over tcp loopback, p50/p90/p99 in us,
--round_trips each, interleaved: `pyzmq_floor` (raw pyzmq DEALER->ROUTER
echo of one 1280-byte frame, the calibration floor), `transport` (the
bridge's message shapes through `Endpoint`: R STEP frames out, R x (D REPLY
+ COMPLETION) pre-encoded frames back from an echo server), `host` (the
real objects without a socket, as host_objects), and `exchange` (a real
`Worker.serve` loop in a thread behind `Endpoint.bind`, with a proposer
returning precomputed rows; the verifier sends its STEPs and runs
`Verifier._collect`: receive, decode, `_stage` with `validate_q_row` per
row); target p50 <= 250 us. `round` is a whole `Verifier.round` (STEP,
collect, verify with a constant verify_fn and target_fn, COMMIT) for
--full_rounds rounds, for information: it includes `dj.round_key` (eager
JAX) per request. Every server runs in a thread of this process (one GIL);
the garbage collector is off while timing.
"""

# The stages are timed one by one through the bridge's own private steps
# (Verifier._step, _message, _stage, _collect, _validate_dense).
# pylint: disable=protected-access

import gc
import json
import logging
import math
import os
import platform
import shutil
import tempfile
import threading
import time

from absl import app
from absl import flags
import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import zmq

import dyadic_jax as dj
from dyadic_jax.bridge import hello, staging
from dyadic_jax.bridge.proposer import Proposal
from dyadic_jax.bridge.transport import Endpoint
from dyadic_jax.bridge.verifier import Verifier
from dyadic_jax.bridge.worker import Worker
from dyadic_jax.wire import codec, validate_q_row
from dyadic_jax.wire.layouts import Kind, Representation

_VOCAB = flags.DEFINE_integer(
    "vocab", dj.DEFAULT_VOCAB, "Vocabulary size V (dense row length).")
_REQUESTS = flags.DEFINE_integer(
    "requests", 4, "Requests R in a batch (one exchange, one slot).")
_DEPTH = flags.DEFINE_integer(
    "depth", 5, "Draft depth D: REPLY rows per request.")
_K = flags.DEFINE_integer(
    "k", 32, "Support size of the sparse rows in the round-trip benchmark.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 100, "Timed repetitions of every dense stage (after warm-up).")
_ROUND_TRIPS = flags.DEFINE_integer(
    "round_trips", 2000, "Timed sparse round trips of each kind.")
_FULL_ROUNDS = flags.DEFINE_integer(
    "full_rounds", 300, "Timed whole Verifier.round calls (information).")
_TRANSPORTS = flags.DEFINE_list(
    "transports", ["tcp", "ipc"], "ZeroMQ transports of the dense send.")
_LINK_GBPS = flags.DEFINE_float(
    "link_gbps", 40.0, "Link rate of the seed's serialization ideal.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the benchmark data.")
_QUICK = flags.DEFINE_bool(
    "quick", False, "Small preset for tests: V=2048 unless --vocab is given, "
    "5 repeats, 50 round trips, 10 full rounds.")
_JSON_OUT = flags.DEFINE_string(
    "json_out", None, "Optional path for a JSON record of every figure.")

_M = dj.M
_WARMUP = 3
_SPARSE_TARGET_US = 250.0
_FLOOR_BYTES = 1280           # the seed's k=32 request: 5 x 32 x (4 + 4) B
_MAX_X_MEMCPY = 5.0
_DENSE_STAGES = ("encode", "completion", "checksum", "decode", "stage",
                 "stage_copy", "validate", "naive", "host_objects", "memcpy",
                 "read")
_HEADLINE_PARTS = ("encode", "completion", "decode", "stage", "validate")


# ---------------------------------------------------------------------------
# Timing.


def summarize(samples_s, unit=1e3):
  """median / p90 / p99 / min / mean of samples in seconds, scaled by unit."""
  x = np.asarray(samples_s, np.float64) * unit
  return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
          "p99": float(np.percentile(x, 99)), "min": float(x.min()),
          "mean": float(x.mean()), "n": int(x.size)}


def interleaved(stages, repeats, warmup=_WARMUP):
  """{name: [seconds]}: each repetition runs every stage once, in order."""
  for _ in range(warmup):
    for fn in stages.values():
      fn()
  samples = {name: [] for name in stages}
  gc.collect()
  gc.disable()
  try:
    for _ in range(repeats):
      for name, fn in stages.items():
        start = time.perf_counter()
        fn()
        samples[name].append(time.perf_counter() - start)
  finally:
    gc.enable()
  return samples


# ---------------------------------------------------------------------------
# Benchmark data: valid dyadic rows.


def dense_proposals(rng, requests, depth, vocab):
  """One dense Proposal per request: D valid rows, tokens with q > 0."""
  out = []
  for _ in range(requests):
    w = rng.exponential(size=(depth, vocab)) ** 4
    counts = np.floor(w / w.sum(-1, keepdims=True) * _M).astype(np.int64)
    top = counts.argmax(-1)
    counts[np.arange(depth), top] += _M - counts.sum(-1)
    values = (counts / _M).astype(np.float32)   # exact: counts <= 2^24
    out.append(Proposal(top.astype(np.int32), values, None,
                        np.full(depth, vocab, np.int32)))
  return out


def sparse_proposals(rng, requests, depth, vocab, k):
  """One sparse Proposal per request: D rows of k ascending ids, q > 0."""
  out = []
  for _ in range(requests):
    ids = np.sort(np.stack([rng.choice(vocab, k, replace=False)
                            for _ in range(depth)]), -1).astype(np.int32)
    w = rng.exponential(size=(depth, k))
    counts = 1 + np.floor(w / w.sum(-1, keepdims=True) * (_M - k)).astype(
        np.int64)
    top = counts.argmax(-1)
    counts[np.arange(depth), top] += _M - counts.sum(-1)
    values = (counts / _M).astype(np.float32)
    tokens = ids[np.arange(depth), top]
    out.append(Proposal(tokens.astype(np.int32), values, ids,
                        np.full(depth, k, np.int32)))
  return out


def proposer_of(proposals):
  """A proposer that returns request `seed`'s precomputed proposal."""
  def propose(seed, generation, round_id, anchor, last_token, depth):
    del generation, round_id, anchor, last_token, depth
    return proposals[int(seed)]
  return propose


# ---------------------------------------------------------------------------
# The real objects, without a socket.


class HostPair:
  """A Worker and a Verifier in one session, exchanging frames in memory."""

  def __init__(self, caps, proposals):
    self.caps = caps
    self.worker = Worker(caps, proposer_of(proposals))
    self.verifier = Verifier(caps, "tcp://127.0.0.1:9", target_fn=None)
    self.verifier.pool = staging.SlotPool(caps, time.monotonic)
    for rid, p in enumerate(proposals):
      self.verifier.add_request(rid, [int(p.tokens[0])], seed=rid)
    reply = self.worker.handle([hello.hello_frame(caps,
                                                  self.verifier.session)])
    assert codec.peek(reply[0])[0] == Kind.HELLO, "worker refused HELLO"
    self.reqs = list(self.verifier.requests.values())
    self.index = {req.rid: i for i, req in enumerate(self.reqs)}

  def steps(self):
    """STEP frames of a new round of every request, and the round's tags."""
    for req in self.reqs:
      req.round += 1
    tags = {req.rid: (req.generation, req.round) for req in self.reqs}
    return [self.verifier._step(req, i, self.caps.max_depth)
            for i, req in enumerate(self.reqs)], tags

  def receive(self, frames, tags):
    """Verifier side of one reply message: decode, stage, validate."""
    v, depth = self.verifier, self.caps.max_depth
    slot = v.pool.acquire(tags, 60.0)
    outcome = {}
    try:
      v._message(frames, slot, self.reqs, tags, depth, self.index, outcome)
      dense = v._validate_dense(slot, self.reqs, depth, outcome)
      jax.block_until_ready(dense)
    finally:
      v.pool.discard(slot)
    bad = {rid: code for rid, code in outcome.items() if code is not None}
    if bad or len(outcome) != len(self.reqs):
      raise RuntimeError(f"bench_bridge: exchange refused: {outcome}")
    return dense

  def round_trip(self):
    steps, tags = self.steps()
    return self.receive(self.worker.handle(steps), tags)


# ---------------------------------------------------------------------------
# Dense stages.


def _ideal_ms(nbytes):
  return nbytes / (_LINK_GBPS.value * 1e9 / 8) * 1e3


def dense_scale(requests, depth, vocab, rng, transports, tmpdir, repeats):
  """Every dense stage for one batch of `requests`; returns its record."""
  caps = hello.Capabilities(vocab=vocab, max_depth=depth,
                            max_requests=requests, max_slots=2,
                            representation=Representation.DENSE)
  proposals = dense_proposals(rng, requests, depth, vocab)
  pair = HostPair(caps, proposals)
  v = pair.verifier
  bounds = caps.bounds

  # One real reply message: the worker's frames for a fresh round.
  steps, tags = pair.steps()
  frames = pair.worker.handle(steps)
  per_request = depth + 1
  reply_frames = [frames[r * per_request:r * per_request + depth]
                  for r in range(requests)]
  completions = [frames[r * per_request + depth] for r in range(requests)]
  first = codec.decode(frames[0], bounds, validate_rows=False)
  header = dict(session=int(first.header["session"]),
                generation=int(first.header["generation"]),
                round_id=int(first.header["round"]), version=caps.mode)
  anchors = [req.anchor for req in pair.reqs]
  buffers = [bytearray(caps.max_reply_bytes // requests)
             for _ in range(requests)]

  def encode():
    out = []
    for r, p in enumerate(proposals):
      buf, offset = memoryview(buffers[r]), 0
      rows = []
      for i in range(depth):
        frame = codec.encode(
            Kind.REPLY, body={"request": r, "position": i,
                              "token": int(p.tokens[i]), "mass": _M},
            values=p.values[i], out=buf[offset:], **header)
        rows.append(frame)
        offset += len(frame)
      out.append(rows)
    return out

  encoded = encode()
  assert all(bytes(a) == bytes(b) for rows, ref in zip(encoded, reply_frames)
             for a, b in zip(rows, ref)), "encode differs from the worker's"

  def completion():
    out = []
    for r, rows in enumerate(encoded):
      crc = 0
      for frame in rows:
        crc = crc32c.crc32c(frame, crc)
      out.append(codec.encode(Kind.COMPLETION, body={
          "request": r, "depth": depth, "status": 0, "replies_crc": crc,
          "reply_bytes": sum(len(f) for f in rows), "anchor": anchors[r],
          "context_version": 0}, **header))
    return out

  assert [bytes(c) for c in completion()] == [bytes(c) for c in completions]

  def checksum():
    return [codec.checksum(f) for rows in encoded for f in rows]

  # The reply message as the worker sends it, in buffers of this benchmark
  # (the worker reuses its own for host_objects): REPLY rows in `buffers`
  # (rewritten, identically, by encode), then the COMPLETION frames.
  message = []
  for rows, done in zip(encoded, completions):
    message.extend(rows)
    message.append(bytes(done))

  # Transport: ROUTER (worker) -> DEALER (verifier), zero-copy frames.
  received = {"frames": [bytes(f) for f in message]}
  links = {}
  for name in transports:
    address = ("tcp://127.0.0.1:0" if name == "tcp" else
               f"ipc://{tmpdir}/dense-{requests}.ipc")
    router = Endpoint.bind(address)
    dealer = Endpoint.connect(router.address)
    dealer.send([b"hi"])
    got = router.recv(10.0)
    if got is None:
      raise RuntimeError(f"bench_bridge: no {name} connection")
    links[name] = (router, dealer, got[0])

  def send(name):
    router, dealer, peer = links[name]

    def run():
      tracker = router.send(message, peer)
      got = dealer.recv(10.0)
      if got is None:
        raise RuntimeError(f"bench_bridge: {name} message lost")
      if tracker is not None:
        tracker.wait()
      received["frames"] = got[1]
    return run

  def decode():
    received["decoded"] = [codec.decode(f, bounds, validate_rows=False)
                           for f in received["frames"]]
    return received["decoded"]

  def groups():
    """(decoded frames, raw frames) of each request, from the last decode."""
    decoded, raw = received["decoded"], received["frames"]
    return [(decoded[r * per_request:(r + 1) * per_request],
             raw[r * per_request:(r + 1) * per_request])
            for r in range(requests)]

  decode()
  slot = v.pool.acquire(tags, 1e9)

  def stage():
    for r, (group, raw) in enumerate(groups()):
      v._stage(group, raw, slot, r, r, tags[r], depth)

  def stage_copy():
    for r, (group, _) in enumerate(groups()):
      for pos, row in enumerate(group[:-1]):
        slot.values[r, pos] = row.values

  def validate():
    counts, ok = staging.dense_rows(slot.values, slot.tokens)
    ok = np.asarray(ok)
    return jax.block_until_ready(counts), ok

  def naive():
    return [validate_q_row(row.values, None, vocab_size=vocab,
                           token=int(row.body["token"]))
            for group, _ in groups() for row in group[:-1]]

  stage()
  counts, ok = validate()
  naive_counts = naive()
  assert ok.all(), "benchmark rows must validate"
  assert np.array_equal(np.asarray(counts).reshape(-1, vocab),
                        np.stack(naive_counts)), "dense_rows != validate_q_row"
  assert np.array_equal(np.asarray(pair.round_trip()), np.asarray(counts))

  q = np.stack([p.values for p in proposals])
  copy_dst = np.empty_like(q)
  read = jax.jit(jnp.sum)
  with jax.enable_x64(True):
    slot_view = jax.dlpack.from_dlpack(slot.values)

  stages = {"encode": encode, "completion": completion,
            "checksum": checksum}
  stages.update({f"send_{name}": send(name) for name in transports})
  stages.update({"decode": decode, "stage": stage, "stage_copy": stage_copy,
                 "validate": validate, "naive": naive,
                 "host_objects": pair.round_trip,
                 "memcpy": lambda: np.copyto(copy_dst, q),
                 "read": lambda: read(slot_view).block_until_ready()})
  try:
    samples = interleaved(stages, repeats)
    # memcpy again, back to back (its bytes stay in cache): the hot floor.
    samples.update(interleaved(
        {"memcpy_hot": lambda: np.copyto(copy_dst, q)}, repeats))
  finally:
    for router, dealer, _ in links.values():
      dealer.close()
      router.close()
    v.pool.discard(slot)

  q_bytes = q.nbytes
  frame_bytes = sum(len(f) for f in message)
  ideal = _ideal_ms(q_bytes)
  figures = {name: summarize(s) for name, s in samples.items()}
  memcpy, floor = figures["memcpy"]["median"], figures["read"]["median"]
  result = {}
  for name, fig in figures.items():
    med = fig["median"]
    result[name] = {"median_ms": med, "p90_ms": fig["p90"],
                    "min_ms": fig["min"], "mean_ms": fig["mean"],
                    "x_memcpy": med / memcpy, "x_read": med / floor,
                    "x_ideal": med / ideal,
                    "gb_per_s": q_bytes / (med * 1e-3) / 1e9}
  result["validate"]["naive_over_validate"] = (
      figures["naive"]["median"] / figures["validate"]["median"])
  copy_validate = figures["stage_copy"]["median"] + figures["validate"][
      "median"]
  result["validate"]["naive_over_copy_and_validate"] = (
      figures["naive"]["median"] / copy_validate)
  host = sum(figures[name]["median"] for name in _HEADLINE_PARTS)
  headline = {
      "ms": host, "x_memcpy": host / memcpy, "x_read": host / floor,
      "x_ideal": host / ideal, "ideal_ms": ideal, "memcpy_ms": memcpy,
      "x_memcpy_hot": host / figures["memcpy_hot"]["median"],
      "objects_ms": figures["host_objects"]["median"],
      "objects_x_memcpy": figures["host_objects"]["median"] / memcpy,
      "share": {name: figures[name]["median"] / host
                for name in _HEADLINE_PARTS},
      "parts": list(_HEADLINE_PARTS)}
  return {"requests": requests, "depth": depth, "rows": requests * depth,
          "q_bytes": q_bytes, "frame_bytes": frame_bytes,
          "frames": len(message), "ideal_ms": ideal, "stages": result,
          "headline": headline}


# ---------------------------------------------------------------------------
# Sparse round trips.


class _Server:
  """A loop `fn(stop)` in a daemon thread, stopped and joined on close."""

  def __init__(self, fn):
    self.stop = threading.Event()
    self.thread = threading.Thread(target=fn, args=(self.stop,), daemon=True)
    self.thread.start()

  def close(self):
    self.stop.set()
    self.thread.join(5.0)


def sparse_round_trips(requests, depth, vocab, k, rng, round_trips,
                       full_rounds):
  """p50/p90/p99 (us) of the sparse round trips, pyzmq floor included."""
  caps = hello.Capabilities(vocab=vocab, max_depth=depth,
                            max_requests=requests, max_slots=2,
                            representation=Representation.SPARSE,
                            max_support=k)
  proposals = sparse_proposals(rng, requests, depth, vocab, k)
  pair = HostPair(caps, proposals)
  servers, closers = [], []
  try:
    # Raw pyzmq echo of one 1280-byte frame: the floor.
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    closers += [dealer.close, router.close]

    def echo(stop):
      while not stop.is_set():
        if router.poll(50):
          router.send_multipart(router.recv_multipart())

    servers.append(_Server(echo))
    payload = bytes(rng.integers(0, 256, _FLOOR_BYTES, np.uint8))

    def floor():
      dealer.send(payload)
      if not dealer.poll(10_000):
        raise RuntimeError("bench_bridge: pyzmq echo lost")
      dealer.recv()

    # The bridge's message shapes through Endpoint, pre-encoded replies.
    steps, tags = pair.steps()
    reply = [bytes(f) for f in pair.worker.handle(steps)]
    pair.receive(reply, tags)
    shapes = Endpoint.bind("tcp://127.0.0.1:0")
    closers.append(shapes.close)

    def answer(stop):
      while not stop.is_set():
        got = shapes.recv(0.05)
        if got is not None:
          shapes.send(reply, got[0])

    servers.append(_Server(answer))
    client = Endpoint.connect(shapes.address)
    closers.append(client.close)
    step_bytes = [bytes(f) for f in steps]

    def transport():
      client.send(step_bytes)
      got = client.recv(10.0)
      if got is None or len(got[1]) != len(reply):
        raise RuntimeError("bench_bridge: transport reply lost")

    # The real Worker loop in a thread; the verifier's collect path.
    worker_end = Endpoint.bind("tcp://127.0.0.1:0")
    closers.append(worker_end.close)
    worker = Worker(caps, proposer_of(proposals))
    servers.append(_Server(lambda stop: worker.serve(worker_end, stop)))
    fixed_logits = np.zeros((depth + 1, vocab), np.float32)
    verifier = Verifier(
        caps, worker_end.address, timeout_s=10.0,
        target_fn=lambda prefix, draft: fixed_logits[:len(draft) + 1],
        verify_fn=lambda logits, q, draft, key, anchor: (0, int(draft[0]),
                                                         0))
    closers.append(verifier.close)
    verifier.open()
    for rid, p in enumerate(proposals):
      verifier.add_request(rid, [int(p.tokens[0])], seed=rid)
    reqs = list(verifier.requests.values())

    def exchange():
      for req in reqs:
        req.round += 1
      tags = {req.rid: (req.generation, req.round) for req in reqs}
      slot = verifier.pool.acquire(tags, verifier.timeout_s)
      try:
        verifier.endpoint.send([verifier._step(req, i, depth)
                                for i, req in enumerate(reqs)])
        outcome = verifier._collect(slot, reqs, tags, depth)
      finally:
        verifier.pool.discard(slot)
      if any(code is not None for code in outcome.values()):
        raise RuntimeError(f"bench_bridge: sparse exchange refused {outcome}")

    samples = interleaved({"pyzmq_floor": floor, "transport": transport,
                           "host": pair.round_trip, "exchange": exchange},
                          round_trips, warmup=20)

    # Whole rounds (information): new requests, so that the exchanges above
    # leave no state behind; each round commits one token per request.
    rids = [requests + r for r in range(requests)]
    for r in rids:
      verifier.add_request(r, [int(proposals[0].tokens[0])], seed=0)

    def full_round():
      results = verifier.round(rids)
      if any(res.fallback for res in results):
        raise RuntimeError(f"bench_bridge: round fell back: {results}")

    samples.update(interleaved({"round": full_round}, full_rounds, warmup=5))
  finally:
    for server in servers:
      server.close()
    for close in reversed(closers):
      close()
  rows = requests * depth
  out = {name: dict(summarize(s, 1e6), unit="us") for name, s in
         samples.items()}
  out = {name: {"p50_us": f["median"], "p90_us": f["p90"],
                "p99_us": f["p99"], "min_us": f["min"], "mean_us": f["mean"],
                "n": f["n"]} for name, f in out.items()}
  floor_p50 = out["pyzmq_floor"]["p50_us"]
  for f in out.values():
    f["x_floor_p50"] = f["p50_us"] / floor_p50
  return {"k": k, "requests": requests, "depth": depth, "rows": rows,
          "step_bytes": sum(len(f) for f in step_bytes),
          "reply_bytes": sum(len(f) for f in reply),
          "reply_frames": len(reply), "floor_bytes": _FLOOR_BYTES,
          "target_p50_us": _SPARSE_TARGET_US, "round_trips": out}


# ---------------------------------------------------------------------------


def _print_dense(title, rec, transports):
  print(f"\n{title}: {rec['requests']} request(s) x depth {rec['depth']} = "
        f"{rec['rows']} rows, q {rec['q_bytes']:,} B, {rec['frames']} "
        f"frames {rec['frame_bytes']:,} B; 40 Gb/s ideal "
        f"{rec['ideal_ms']:.3f} ms")
  header = (f"  {'stage':<13} {'median ms':>10} {'p90 ms':>8} "
            f"{'x memcpy':>9} {'x read':>7} {'x ideal':>8} {'GB/s':>7}")
  print(header + "\n  " + "-" * (len(header) - 2))
  order = (["encode", "completion", "checksum"]
           + [f"send_{t}" for t in transports]
           + ["decode", "stage", "stage_copy", "validate", "naive",
              "host_objects", "memcpy", "memcpy_hot", "read"])
  for name in order:
    s = rec["stages"][name]
    print(f"  {name:<13} {s['median_ms']:10.3f} {s['p90_ms']:8.3f} "
          f"{s['x_memcpy']:9.2f} {s['x_read']:7.2f} {s['x_ideal']:8.2f} "
          f"{s['gb_per_s']:7.1f}")
  h = rec["headline"]
  share = ", ".join(f"{n} {h['share'][n]:.0%}" for n in h["parts"])
  print(f"  host work (all but the socket) = {' + '.join(h['parts'])} = "
        f"{h['ms']:.3f} ms = {h['x_memcpy']:.1f}x memcpy = "
        f"{h['x_ideal']:.2f}x ideal ({share}); {h['x_memcpy_hot']:.1f}x "
        f"the hot memcpy; through the objects {h['objects_ms']:.3f} ms")
  val = rec["stages"]["validate"]
  print(f"  naive validate_q_row / dense_rows = "
        f"{val['naive_over_validate']:.2f}x; / (stage copy + dense_rows) = "
        f"{val['naive_over_copy_and_validate']:.2f}x")


def main(argv):
  del argv
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  quick = _QUICK.value
  vocab = (2048 if quick and not flags.FLAGS["vocab"].present
           else _VOCAB.value)
  repeats = 5 if quick and not flags.FLAGS["repeats"].present else (
      _REPEATS.value)
  round_trips = 50 if quick and not flags.FLAGS["round_trips"].present else (
      _ROUND_TRIPS.value)
  full_rounds = 10 if quick and not flags.FLAGS["full_rounds"].present else (
      _FULL_ROUNDS.value)
  requests, depth, k = _REQUESTS.value, _DEPTH.value, _K.value
  transports = [t.strip() for t in _TRANSPORTS.value if t.strip()]
  if any(t not in ("tcp", "ipc") for t in transports):
    raise app.UsageError("--transports: tcp and/or ipc")
  if not 1 <= k <= vocab or min(requests, depth, repeats, round_trips,
                                full_rounds) < 1:
    raise app.UsageError("need 1 <= k <= V and positive counts")
  wall_start = time.perf_counter()
  print(f"bench_bridge: V={vocab} requests={requests} depth={depth} k={k} "
        f"repeats={repeats} round_trips={round_trips} backend="
        f"{jax.default_backend()} cpus={os.cpu_count()} "
        f"libzmq={zmq.zmq_version()} crc32c hardware="
        f"{getattr(crc32c, 'hardware_based', '?')}")
  rng = np.random.default_rng(_SEED.value)
  tmpdir = tempfile.mkdtemp(prefix="bench_bridge_")
  try:
    dense = {"request": dense_scale(1, depth, vocab, rng, transports, tmpdir,
                                    repeats),
             "batch": dense_scale(requests, depth, vocab, rng, transports,
                                  tmpdir, repeats)}
  finally:
    shutil.rmtree(tmpdir, ignore_errors=True)
  sparse = sparse_round_trips(requests, depth, vocab, k, rng, round_trips,
                              full_rounds)

  _print_dense("dense request", dense["request"], transports)
  _print_dense("dense batch", dense["batch"], transports)
  rt = sparse["round_trips"]
  print(f"\nsparse k={k} round trips over tcp loopback: {requests} STEP "
        f"frames ({sparse['step_bytes']:,} B) out, {sparse['reply_frames']} "
        f"frames ({sparse['reply_bytes']:,} B) back")
  header = (f"  {'round trip':<12} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8}"
            f" {'x floor':>8}")
  print(header + "\n  " + "-" * (len(header) - 2))
  for name in ("pyzmq_floor", "transport", "host", "exchange", "round"):
    f = rt[name]
    print(f"  {name:<12} {f['p50_us']:8.1f} {f['p90_us']:8.1f} "
          f"{f['p99_us']:8.1f} {f['x_floor_p50']:8.2f}")

  h = dense["batch"]["headline"]
  ex = rt["exchange"]
  verdicts = [
      (f"dense {requests}-request batch host work <= 40 Gb/s ideal "
       f"({h['ideal_ms']:.3f} ms)", h["ms"] <= h["ideal_ms"],
       f"{h['ms']:.3f} ms, {h['x_ideal']:.2f}x"),
      (f"dense {requests}-request batch host work <= {_MAX_X_MEMCPY:g}x "
       "memcpy", h["x_memcpy"] <= _MAX_X_MEMCPY,
       f"{h['x_memcpy']:.1f}x of {h['memcpy_ms']:.3f} ms"),
      (f"sparse k={k} exchange p50 <= {_SPARSE_TARGET_US:g} us",
       ex["p50_us"] <= _SPARSE_TARGET_US,
       f"p50 {ex['p50_us']:.1f} us, p99 {ex['p99_us']:.1f} us, floor p50 "
       f"{rt['pyzmq_floor']['p50_us']:.1f} us"),
  ]
  print()
  for text, ok, detail in verdicts:
    print(f"  [{'PASS' if ok else 'MISS'}] {text} ({detail})")
  wall = time.perf_counter() - wall_start
  print(f"\ntotal wall time {wall:.1f} s")

  if _JSON_OUT.value:
    record = {
        "config": {"vocab": vocab, "requests": requests, "depth": depth,
                   "k": k, "repeats": repeats, "round_trips": round_trips,
                   "full_rounds": full_rounds, "transports": transports,
                   "link_gbps": _LINK_GBPS.value, "quick": quick,
                   "seed": _SEED.value, "backend": jax.default_backend(),
                   "cpus": os.cpu_count(), "python": platform.python_version(),
                   "jax": jax.__version__, "pyzmq": zmq.__version__,
                   "libzmq": zmq.zmq_version(),
                   "crc32c_hardware": bool(getattr(crc32c, "hardware_based",
                                                   False))},
        "dense": dense, "sparse": sparse,
        "headline": dict(h, name="host-side bridge work (all but the socket) "
                         f"for a dense {requests}-request batch"),
        "targets": [{"target": t, "pass": bool(ok), "detail": d}
                    for t, ok, d in verdicts],
        "wall_s": wall}
    assert all(math.isfinite(x) for x in _numbers(record))
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=2)
    print(f"Wrote {_JSON_OUT.value}")


def _numbers(obj):
  if isinstance(obj, dict):
    for value in obj.values():
      yield from _numbers(value)
  elif isinstance(obj, (list, tuple)):
    for value in obj:
      yield from _numbers(value)
  elif isinstance(obj, float):
    yield obj


if __name__ == "__main__":
  app.run(main)
