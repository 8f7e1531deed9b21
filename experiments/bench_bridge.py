"""Benchmark of the host bridge (wire v3): MAC, ZeroMQ, staging, validation.

    python -m experiments.bench_bridge --json_out /tmp/bench_bridge.json

Expected runtime: 40-60 s on a 2-core CPU with the defaults (V = 129280,
4 requests x depth 5, --repeats=60, --round_trips=1500, --full_rounds=200),
a few seconds of it importing JAX and compiling the kernels; `--quick`
(V = 2048, few repeats; what tests/experiments/test_bench_bridge.py runs) about 10 s.

Every figure is a median over repetitions, the stages interleaved within
each repetition so that machine noise hits them alike; what the targets
compare are ratios measured in the same run. Authentication (keyed BLAKE3)
is on unless a stage's name says otherwise. Each repetition serves new
rounds through the sessions' public methods (`Rounds`: the same q rows,
each round's tokens those its PROPOSAL draws pick, precomputed).

Dense rows (one request: D rows of V float32; one batch: R requests), in
the default form: one PACKED frame per batch, tagged with AES-256-GMAC:

  encode        the worker's side of a round after the draft: its rows
                written into the PACKED frame of its slot buffer (one copy
                of q, what the proposer's `out=` does), then `finish`: the
                records and the frame's MAC
  decode        the verifier's `VerifierSession.receive` of the reply
                message: split, header, the MAC checked, records compared,
                rows copied into the aligned staging slot
  plan          `VerifierSession.staged`: the audited verdicts, the Plan
  validate      the staged rows validated with the sampling audit
                (`qformats` dense: on CPU one compiled sweep that writes
                the counts and sums them exactly), blocked on
  validate_device  the same verdict in the accelerator's form (one jitted
                pass; what CPU ran before), for comparison
  audit         validate minus the same without the audit, and `draws`
                the PROPOSAL draws of a round (one jitted call, made while
                the worker drafts)
  send_tcp/ipc  the reply message from a ROUTER to a DEALER (zero-copy)
  send_curve    the same over tcp with ZeroMQ CURVE (`--encrypt`)
  naive         `wire.validate_q_row` (numpy) on every row
  objects       the whole host path in one piece through the real objects,
                no socket: `WorkerSession.receive` + rows written +
                `finish`, `VerifierSession.receive`, validate, `staged`

Floors in the same run: `memcpy` (np.copyto of the batch's q, interleaved,
as cold as the stages' bytes), `memcpy_hot` (back to back), `read` (a
fused jitted sum of the staged slot), `rowsum` (numpy's one-pass row sum
of the staged slot), `gmac` (AES-256-GMAC of the q bytes: the PACKED
frame's MAC pass), `blake3` (keyed BLAKE3 of the q bytes, one thread: the
MAC of every other frame and of sessions without GMAC; `blake3_threads`
with blake3's thread pool, which the wire no longer uses), `crc32c` and
`hmac_sha256` of the same bytes (the v2 check and the standard-library
MAC), and the seed's ideal: q bytes at
--link_gbps (40 Gb/s: 2.068 ms per batch at V = 129280).

Per side of a dense round (`sides`), each as a ratio to memcpy of its
bytes, to one GMAC pass, to one BLAKE3 pass, to the link's ideal and to
its own floor, with
its target:

  worker         encode; floor one write + one MAC (memcpy + gmac); target
                 <= 2.5x memcpy
  verifier_host  decode + plan; floor one MAC + the staging copy (gmac +
                 memcpy); target <= 2.5x memcpy
  validation     validate; floor `rowsum`; target <= 3x rowsum

The headline, "host work for a dense batch", is the three sides together
(both MACs included), against the targets <= the 40 Gb/s ideal and <= 4x
memcpy.

Sparse round trips (k = --k), tcp loopback, p50/p90/p99 in us:
`pyzmq_floor` (a raw pyzmq DEALER -> ROUTER -> DEALER echo of the same
bytes: the STEP message out, the reply message back, through a thread
that only forwards), `exchange` (a real `Worker.serve` loop in a thread
behind `Endpoint.bind` with a proposer that writes precomputed rows; the
verifier's session sends its STEPs, reads, validates and audits until the
round's Plan: everything but verification; PACKED answers, the default),
`exchange_frames` (the same with per-frame answers: a peer without the
PACKED_REPLY feature), `exchange_insecure` (CRC32C
tags) and `exchange_curve` (CURVE), and `round`, a whole `Verifier.round`
with a constant verify_fn (for information). Each timed round trip follows
an untimed one to the same server, so all are timed equally idle (a
server thread that slept through the other stages answers about 2.5x
slower). Target: exchange p50 <= 3x the pyzmq floor's p50. Every server
runs in a thread of this process; the garbage collector is off while
timing.

Two rounds in flight (`overlap_rounds`): two groups of --requests sparse
requests served by whole rounds through the real driver, the worker's
draft modelled as --draft_ms a batch and the verifier's verification as
--verify_ms a round (sleeps: in a deployment each side's model runs on
its own host). One leg keeps one round in flight, the other two
(`Verifier.start` / `finish`); the report gives each leg's round time,
per round each side's busy time and the wall against the busier side,
and the share of the worker's turn hidden (`experiments.in_flight`).
"""

import collections
import dataclasses
import gc
import hashlib
import hmac
import json
import logging
import math
import os
import platform
import shutil
import threading
import time

from absl import flags

from experiments import cli
from experiments import in_flight as in_flight_lib
from experiments import run_folder

_VOCAB = flags.DEFINE_integer(
    "vocab", cli.DEFAULT_VOCAB, f"Vocabulary size V (dense row length), "
    f"2..{cli.MAX_VOCAB} (--quick: 2048 unless given).", lower_bound=2,
    upper_bound=cli.MAX_VOCAB)
_REQUESTS = flags.DEFINE_integer(
    "requests", 4, "Requests R in a batch (one exchange, one slot), >= 1.",
    lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 5, "Draft depth D: rows per request, "
                              "1..255.", lower_bound=1, upper_bound=255)
_K = flags.DEFINE_integer(
    "k", 32, "Support size of the sparse rows in the round-trip benchmark, "
    "in [1, V].", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
    "repeats", 60, "Timed repetitions of every dense stage (after warm-up), "
    ">= 1.", lower_bound=1)
_ROUND_TRIPS = flags.DEFINE_integer(
    "round_trips", 1500, "Timed sparse round trips of each kind, >= 1.",
    lower_bound=1)
_FULL_ROUNDS = flags.DEFINE_integer(
    "full_rounds", 200, "Timed whole Verifier.round calls (information), "
    ">= 1.", lower_bound=1)
_OVERLAP_ROUNDS = flags.DEFINE_integer(
    "overlap_rounds", 100, "Timed whole rounds of each overlap leg (one and "
    "two in flight), >= 2.", lower_bound=2)
_DRAFT_MS = flags.DEFINE_float(
    "draft_ms", 4.0, "The overlap rounds' modelled draft time per batch, "
    "ms, in [0, 1000].", lower_bound=0.0, upper_bound=1000.0)
_VERIFY_MS = flags.DEFINE_float(
    "verify_ms", 4.0, "The overlap rounds' modelled verification time per "
    "round, ms, in [0, 1000].", lower_bound=0.0, upper_bound=1000.0)
_TRANSPORTS = flags.DEFINE_list(
    "transports", ["tcp", "ipc"], "ZeroMQ transports of the dense send.")
_LINK_GBPS = flags.DEFINE_float(
    "link_gbps", 40.0, "Link rate of the seed's serialization ideal, > 0.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the benchmark data.")
_QUICK = flags.DEFINE_bool(
    "quick", False, "Small preset for tests: V=2048 unless --vocab is given, "
    "5 repeats, 50 round trips, 10 full rounds, 10 overlap rounds.")
_JSON_OUT = flags.DEFINE_string(
    "json_out", None, "Optional path for a JSON record of every figure.")

cli.check("link_gbps", lambda v: 0 < v < float("inf"),
          "--link_gbps must be a positive number")
cli.check("transports", lambda v: bool(v) and set(v) <= {"tcp", "ipc"},
          "--transports must be tcp and/or ipc")
cli.check(["k", "vocab", "quick"], lambda k, vocab, quick: k <= (
    2048 if quick and not flags.FLAGS["vocab"].present else vocab),
          "--k must be <= the vocabulary (--vocab; 2048 with --quick)")
cli.check_output_path("json_out")
cli.parse_flags_early(__name__)   # a bad flag exits here, before JAX

# pylint: disable=g-import-not-at-top,g-bad-import-order
import blake3
from cryptography.hazmat.primitives.ciphers import aead
import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import zmq

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import audit, keys, proposer as proposer_lib
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.testing import session_pair
from dyadic_jax.wire import codec, qformats, validate_q_row
from dyadic_jax.wire.qformats import kernels
from dyadic_jax.wire.layouts import Feature, Representation
# pylint: enable=g-import-not-at-top,g-bad-import-order

_M = dj.M
_WARMUP = 3
_MAX_X_MEMCPY = 4.0
_MAX_X_FLOOR = 3.0
_HEADLINE_PARTS = ("encode", "decode", "plan", "validate")
# Each side of a dense round, its stages, the floor it is held to (a stage
# or a sum of stages of the same run) and its target (x that floor's name).
_SIDES = {
    "worker": {"parts": ("encode",),
               "floor": ("memcpy", "gmac"),
               "about": "rows written into the PACKED frame, records, sealed",
               "target": ("memcpy", 2.5)},
    "verifier_host": {"parts": ("decode", "plan"),
                      "floor": ("gmac", "memcpy"),
                      "about": "received message authenticated, staged, "
                               "planned (validation apart)",
                      "target": ("memcpy", 2.5)},
    "validation": {"parts": ("validate",), "floor": ("rowsum",),
                   "about": "the staged batch validated with the audit",
                   "target": ("rowsum", 3.0)},
}
_SECRET = bytes(range(32))


# ---------------------------------------------------------------------------
# Timing.


def summarize(samples_s, unit=1e3):
  """median / p90 / p99 / min / mean of samples in seconds, scaled by unit."""
  x = np.asarray(samples_s, np.float64) * unit
  return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
          "p99": float(np.percentile(x, 99)), "min": float(x.min()),
          "mean": float(x.mean()), "n": int(x.size)}


def interleaved(stages, repeats, warmup=_WARMUP, prime=False):
  """{name: [seconds]}: each repetition runs every stage once, in order.

  prime: run each stage once, untimed, right before its timed run, so
  that every server thread is timed equally idle (a thread that slept
  through the other stages wakes several times slower, 44 vs 113 us for
  the raw pyzmq echo: the floor and the exchanges must not differ there).
  """
  for _ in range(warmup):
    for fn in stages.values():
      fn()
  samples = {name: [] for name in stages}
  gc.collect()
  gc.disable()
  try:
    for _ in range(repeats):
      for name, fn in stages.items():
        if prime:
          fn()
        start = time.perf_counter()
        fn()
        samples[name].append(time.perf_counter() - start)
  finally:
    gc.enable()
  return samples


# ---------------------------------------------------------------------------
# Benchmark data: valid dyadic rows whose tokens the PROPOSAL draws pick.


def proposals(rng, caps, depth, requests):
  """One proposal (`qformats.Rows`) of q rows per request, in the session's q format
  (`QFormat.put`): positive counts on a random support of the row width
  (all of the vocabulary for dense rows). Its tokens are a round's
  (`Rounds`), zero here."""
  fmt, w = caps.format, caps.width
  out = []
  for _ in range(requests):
    ids = np.sort(np.stack([rng.choice(caps.vocab, w, replace=False)
                            for _ in range(depth)]), -1).astype(np.int32)
    weights = rng.exponential(size=(depth, w))
    counts = 1 + np.floor(weights / weights.sum(-1, keepdims=True)
                          * (_M - w)).astype(np.int64)
    counts[np.arange(depth), counts.argmax(-1)] += _M - counts.sum(-1)
    rows = fmt.staging(1, depth, w)
    rows = qformats.Rows(*(None if a is None else a[0] for a in rows))
    fmt.put(rows, ids, counts)
    out.append(rows._replace(tokens=np.zeros(depth, np.int32)))
  return out


class Rounds:
  """The rows of `props` in every round of a run, passing the audit.

  Request r (seed r, prompt [1]) keeps its q rows in every round; rounds
  are begun and never committed, so round n is (generation 0, round n,
  anchor 1), and its tokens are those its PROPOSAL draws pick from the
  rows. Draws and tokens of rounds 1..`rounds` are computed here, so timed
  code only looks them up (no JAX call in a timed stage).
  """

  def __init__(self, props, depth, rounds):
    self.props = props
    self.requests = r = len(props)
    self.rounds = rounds
    n = r * rounds
    draws = audit.proposal_draws(
        np.tile(np.arange(r), rounds), np.zeros(n, np.int64),
        np.repeat(np.arange(1, rounds + 1), r), np.ones(n, np.int64), depth)
    self.draws = np.asarray(draws).reshape(rounds, r, depth)
    self.tokens = []              # per request: int32[rounds, depth]
    for i, p in enumerate(props):
      # q = c / M exactly: the counts back, then the first cumulative count
      # above each draw.
      cum = np.cumsum(np.rint(p.values.astype(np.float64) * _M).astype(
          np.int64), axis=-1)
      picks = np.stack([np.searchsorted(cum[d], self.draws[:, i, d], "right")
                        for d in range(depth)], axis=1)
      self.tokens.append((picks if p.ids is None else p.ids[
          np.arange(depth), picks]).astype(np.int32))

  def _round(self, round_id):
    if not 1 <= round_id <= self.rounds:
      raise RuntimeError(f"bench_bridge: round {round_id} was not "
                         f"precomputed ({self.rounds} were)")
    return round_id - 1

  def proposal(self, seed, round_id):
    """Request `seed`'s proposal in round `round_id`."""
    p = self.props[int(seed)]
    return p._replace(tokens=self.tokens[int(seed)][self._round(round_id)])

  def draws_of(self, seeds, generations, rounds, anchors, depth):
    """`audit.proposal_draws` of one round's requests, looked up."""
    del generations, anchors, depth
    return self.draws[self._round(int(rounds[0]))][np.asarray(seeds,
                                                              np.int64)]

  def __call__(self, props):
    """An in-memory pair's proposer: the rows of a fresh answer."""
    for p in props:
      proposer_lib.write(p.rows, self.proposal(p.seed, p.round))

  def propose(self, seed, generation, round_id, anchor, last_token, depth,
              out=None, *, request=0, context=None):
    """A `bridge.Worker` proposer writing the round's rows into `out`."""
    del generation, anchor, last_token, depth, request, context
    p = self.proposal(seed, round_id)
    if out is not None:
      proposer_lib.write(out, p)
    return p


# ---------------------------------------------------------------------------
# The real objects, without a socket.


def host_pair(caps, rounds):
  """An open in-memory session pair (dyadic_jax.testing.session_pair) with
  requests 0..R-1, serving `rounds`. Its session ids and nonces are
  counters: two such pairs say the same bytes in the same round."""
  pair = session_pair.SessionPair(
      caps, secret=_SECRET, proposer=rounds, timeout_s=1e9,
      worker_entropy=session_pair.CountingEntropy(1),
      verifier_entropy=session_pair.CountingEntropy(2), record=False)
  if not pair.open():
    raise RuntimeError("bench_bridge: HELLO failed")
  for rid in range(rounds.requests):
    pair.verifier.add_request(rid, [1], seed=rid)
  return pair


def _accepted(plan):
  if np.any(plan.codes):
    raise RuntimeError(f"bench_bridge: refused {plan.codes}")
  return plan


def round_trip(pair, rounds):
  """A whole round through the objects (STEP, rows, finish, receive,
  validate on device with the audit, staged), blocked on; a new round
  each call."""
  rids = list(range(rounds.requests))
  depth = pair.caps.max_depth

  def run():
    plan = pair.run_round(rids, depth, draws=rounds.draws_of, device=True)
    jax.block_until_ready(plan.counts)
    return _accepted(plan)
  return run


# ---------------------------------------------------------------------------
# Dense stages.


def _ideal_ms(nbytes):
  return nbytes / (_LINK_GBPS.value * 1e9 / 8) * 1e3


def _link(address, curve_keys=None):
  """(router, dealer, peer) connected; CURVE when keys are given."""
  wc = vc = None
  if curve_keys is not None:
    wc, vc = curve_keys
  router = bridge.Endpoint.bind(address, max_message=1 << 30, curve=wc)
  dealer = bridge.Endpoint.connect(router.address, max_message=1 << 30,
                                   curve=vc)
  dealer.send(b"hi")
  got = router.recv(10.0)
  if got is None:
    raise RuntimeError(f"bench_bridge: no connection at {address}")
  return router, dealer, got[0]


def dense_scale(requests, depth, vocab, rng, transports, tmpdir, repeats,
                curve_keys):
  """Every dense stage for one batch of `requests`; returns its record."""
  # The default answer: one PACKED frame, tagged with AES-256-GMAC.
  caps = bridge.Capabilities(vocab=vocab, max_depth=depth,
                             max_requests=requests, max_slots=2,
                             representation=Representation.DENSE)
  props = proposals(rng, caps, depth, requests)
  # Each repetition begins two rounds (`start`, `objects`); one more checks.
  rounds = Rounds(props, depth, 2 * (_WARMUP + repeats) + 2)
  pair = host_pair(caps, rounds)
  v, w = pair.verifier, pair.worker
  if not (v.bounds.packed and caps.features & Feature.GMAC):
    raise RuntimeError("bench_bridge: the dense session is not PACKED + GMAC")
  rids = list(range(requests))
  state = {}

  def start():     # untimed: a fresh round up to the worker's fresh answer
    state["answer"] = w.receive(pair.begin(rids, depth), pair.now)
    state["draws"] = rounds.draws_of(*v.draw_inputs(), depth)

  def encode():
    # The rows written into the PACKED frame (what the proposer's `out=`
    # does), then `finish`: the records and the frame's MAC.
    answer = state["answer"]
    rounds(answer.propose)
    sent = w.finish(answer, {})[-1]
    state["message"] = sent.message
    # Read by `decode` before the next `start` can take the slot again:
    # let it go, as the driver does once the transport has sent it.
    w.released(sent.slot)

  def decode():
    state["effects"] = v.receive(state["message"], pair.now)

  def validate(audit_on=True):
    def run():
      stage = state["effects"][0]
      verdict = caps.format.validate(
          stage.rows, vocab=vocab,
          draws=state["draws"] if audit_on else None, device=True)
      jax.block_until_ready(verdict.counts)
      state["verdict", audit_on] = verdict
    return run

  def validate_device():   # the accelerator's form on this CPU (before)
    stage = state["effects"][0]
    out = kernels.dense_verdict(stage.rows.values, stage.rows.tokens,
                                state["draws"], host=False)
    jax.block_until_ready(out)

  def plan():      # the audited verdicts staged: the round's Plan
    state["plan"] = v.staged(state["verdict", True]).plan

  def settle():    # untimed: the Plan checked
    _accepted(state["plan"])

  start()
  encode()
  # The same round served through `to_worker`, in a pair that says the
  # same bytes.
  twin = host_pair(caps, rounds)
  reference = twin.to_worker(twin.begin(rids, depth))[-1]
  if bytes(reference) != bytes(state["message"]):
    raise RuntimeError("bench_bridge: the staged encode differs from finish")
  message = state["message"]
  draw_inputs = v.draw_inputs()

  def draws():
    return audit.proposal_draws(*draw_inputs, depth)

  decode()
  validate()()
  if np.any(state["verdict", True].codes):
    raise RuntimeError("bench_bridge: benchmark rows must validate")
  rows = state["effects"][0].rows

  def naive():
    return [validate_q_row(rows.values[r, i], None, vocab_size=vocab,
                           token=int(rows.tokens[r, i]))
            for r in range(requests) for i in range(depth)]

  want = np.stack(naive()).reshape(requests, depth, vocab)
  if not np.array_equal(np.asarray(state["verdict", True].counts), want):
    raise RuntimeError("bench_bridge: validate != validate_q_row")
  plan()
  settle()

  q = np.stack([p.values for p in props])
  q_bytes = q.tobytes()
  copy_dst = np.empty_like(q)
  read = jax.jit(jnp.sum)
  with jax.enable_x64(True):
    slot_view = jax.dlpack.from_dlpack(rows.values)
  mac_key = bytes(32)
  gmac = aead.AESGCM(mac_key)

  links = {}
  for name in transports:
    address = ("tcp://127.0.0.1:0" if name == "tcp" else
               f"ipc://{tmpdir}/dense-{requests}.ipc")
    links[name] = _link(address)
  links["curve"] = _link("tcp://127.0.0.1:0", curve_keys)

  def send(name):
    router, dealer, peer = links[name]

    def run():
      _, tracker = router.send(message, peer)
      got = dealer.recv(30.0)
      if got is None or len(got[1]) != len(message):
        raise RuntimeError(f"bench_bridge: {name} message lost")
      if tracker is not None:
        tracker.wait(30)
    return run

  stages = {"start": start, "encode": encode, "decode": decode, "validate": validate(True),
            "validate_no_audit": validate(False),
            "validate_device": validate_device, "plan": plan,
            "settle": settle,
            "draws": draws, "naive": naive,
            "objects": round_trip(pair, rounds),
            "memcpy": lambda: np.copyto(copy_dst, q),
            "read": lambda: read(slot_view).block_until_ready(),
            # The validation's floor: numpy's one-pass row sum of the slot.
            "rowsum": lambda: state["effects"][0].rows.values.sum(-1),
            "gmac": lambda: gmac.encrypt(bytes(12), b"", q_bytes),
            "blake3": lambda: blake3.blake3(q_bytes, key=mac_key).digest(16),
            "blake3_threads": lambda: blake3.blake3(
                q_bytes, key=mac_key,
                max_threads=blake3.blake3.AUTO).digest(16),
            "crc32c": lambda: crc32c.crc32c(q_bytes),
            "hmac_sha256": lambda: hmac.new(mac_key, q_bytes,
                                            hashlib.sha256).digest()}
  stages.update({f"send_{name}": send(name) for name in links})
  try:
    samples = interleaved(stages, repeats)
    samples.update(interleaved(
        {"memcpy_hot": lambda: np.copyto(copy_dst, q)}, repeats))
  finally:
    for router, dealer, _ in links.values():
      dealer.close()
      router.close()
  del samples["start"], samples["settle"]

  nbytes = q.nbytes
  ideal = _ideal_ms(nbytes)
  figures = {name: summarize(s) for name, s in samples.items()}
  memcpy, floor = figures["memcpy"]["median"], figures["read"]["median"]
  result = {}
  for name, fig in figures.items():
    med = fig["median"]
    result[name] = {"median_ms": med, "p90_ms": fig["p90"],
                    "min_ms": fig["min"], "mean_ms": fig["mean"],
                    "x_memcpy": med / memcpy, "x_read": med / floor,
                    "x_ideal": med / ideal,
                    "gb_per_s": nbytes / (med * 1e-3) / 1e9}
  audit_ms = max(figures["validate"]["median"]
                 - figures["validate_no_audit"]["median"], 0.0)
  host = sum(figures[name]["median"] for name in _HEADLINE_PARTS)
  headline = {
      "ms": host, "x_memcpy": host / memcpy, "x_read": host / floor,
      "x_ideal": host / ideal, "ideal_ms": ideal, "memcpy_ms": memcpy,
      "x_memcpy_hot": host / figures["memcpy_hot"]["median"],
      "objects_ms": figures["objects"]["median"],
      "objects_x_memcpy": figures["objects"]["median"] / memcpy,
      "audit_ms": audit_ms, "draws_ms": figures["draws"]["median"],
      "mac_share": 2 * figures["gmac"]["median"] / host,
      "share": {name: figures[name]["median"] / host
                for name in _HEADLINE_PARTS},
      "parts": list(_HEADLINE_PARTS),
      "curve_over_clear": (figures["send_curve"]["median"]
                           / figures["send_tcp"]["median"]
                           if "send_tcp" in figures else None)}
  return {"requests": requests, "depth": depth, "rows": requests * depth,
          "q_bytes": nbytes, "message_bytes": len(message),
          "frames": 1, "ideal_ms": ideal, "stages": result,
          "headline": headline, "sides": sides(figures, ideal)}


def sides(figures, ideal):
  """Per side of the round: its time, as a ratio to memcpy of its bytes,
  to one BLAKE3 pass, to the link's ideal and to its own floor (all
  measured in this run), and its target."""
  med = {name: f["median"] for name, f in figures.items()}
  out = {}
  for side, spec in _SIDES.items():
    ms = sum(med[p] for p in spec["parts"])
    floor = sum(med[p] for p in spec["floor"])
    against, most = spec["target"]
    x = ms / med[against]
    out[side] = {"ms": ms, "parts": list(spec["parts"]),
                 "about": spec["about"], "x_memcpy": ms / med["memcpy"],
                 "x_mac": ms / med["gmac"], "x_blake3": ms / med["blake3"],
                 "x_link": ms / ideal,
                 "floor": list(spec["floor"]), "floor_ms": floor,
                 "x_floor": ms / floor, "target": f"<= {most:g}x {against}",
                 "target_x": x, "pass": bool(x <= most)}
  return out


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


def _exchange_setup(caps, rounds, secret, curve=None):
  """A real Worker loop (thread) and a verifier session on a DEALER (the
  answers' form is what `caps.features` agree on)."""
  worker = bridge.Worker(caps, rounds.propose, secret=secret,
                         counters=Counters(log=False))
  endpoint = bridge.Endpoint.bind(
      "tcp://127.0.0.1:0", max_message=worker.max_message,
      curve=None if curve is None else curve[0])
  server = _Server(lambda stop: worker.serve(endpoint, stop, idle_s=0.01))
  vs = bridge.VerifierSession(caps, secret=secret, timeout_s=10.0,
                              counters=Counters(log=False))
  client = bridge.Endpoint.connect(
      endpoint.address, max_message=caps.max_reply_bytes + 4096,
      curve=None if curve is None else curve[1])
  client.send(vs.hello().message)
  got = client.recv(10.0)
  if got is None:
    raise RuntimeError("bench_bridge: no HELLO answer")
  vs.receive(got[1])
  rids = list(range(rounds.requests))
  for rid in rids:
    vs.add_request(rid, [1], seed=rid)

  def exchange():   # a new round each call, its draws looked up
    client.send(vs.begin(rids, caps.max_depth, 0.0)[0].message)
    while True:
      got = client.recv(10.0)
      if got is None:
        raise RuntimeError("bench_bridge: exchange lost")
      effects = vs.receive(got[1], 0.0)
      if effects:
        break
    stage = effects[0]
    verdict = caps.format.validate(
        stage.rows, vocab=caps.vocab, device=True,   # as Verifier.validate
        draws=rounds.draws_of(*vs.draw_inputs(), caps.max_depth))
    _accepted(vs.staged(verdict).plan)

  def close():
    server.close()
    client.close()
    endpoint.close()
  return exchange, close


def sparse_round_trips(requests, depth, vocab, k, rng, round_trips,
                       full_rounds, curve_keys):
  """p50/p90/p99 (us) of the sparse round trips, pyzmq floor included."""
  caps = bridge.Capabilities(vocab=vocab, max_depth=depth,
                             max_requests=requests, max_slots=2,
                             representation=Representation.SPARSE,
                             max_support=k)
  props = proposals(rng, caps, depth, requests)
  # Every exchange begins warm-up + twice the timed rounds (each timed one
  # primed); the host pair one more.
  rounds = Rounds(props, depth, 20 + 2 * round_trips + 2)
  pair = host_pair(caps, rounds)
  step_bytes = bytes(pair.begin(list(range(requests)), depth))
  reply_bytes = bytes(pair.to_worker(step_bytes)[-1])
  _accepted(pair.outcome(collections.deque([reply_bytes]),
                         draws=rounds.draws_of, device=True))
  servers, closers = [], []
  try:
    # Raw pyzmq echo of the same bytes: STEP out, reply back.
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
        if router.poll(10):
          peer, _ = router.recv_multipart()
          router.send_multipart([peer, reply_bytes])

    servers.append(_Server(echo))

    def floor():
      dealer.send(step_bytes)
      if not dealer.poll(10_000):
        raise RuntimeError("bench_bridge: pyzmq echo lost")
      dealer.recv()

    exchange, close = _exchange_setup(caps, rounds, _SECRET)
    closers.append(close)
    frames, close = _exchange_setup(
        dataclasses.replace(caps, features=0), rounds, _SECRET)
    closers.append(close)
    insecure, close = _exchange_setup(caps, rounds, None)
    closers.append(close)
    curved, close = _exchange_setup(caps, rounds, _SECRET, curve_keys)
    closers.append(close)
    samples = interleaved({"pyzmq_floor": floor, "exchange": exchange,
                           "exchange_frames": frames,
                           "exchange_insecure": insecure,
                           "exchange_curve": curved,
                           "host": round_trip(pair, rounds)},
                          round_trips, warmup=20, prime=True)

    # Whole rounds (information): a real Verifier driver.
    verifier, close = _round_driver(caps, _AnyRound(rounds), requests)
    closers.append(close)

    def full_round():
      results = verifier.round(list(range(requests)))
      if any(res.fallback for res in results):
        raise RuntimeError(f"bench_bridge: round fell back: {results}")

    samples.update(interleaved({"round": full_round}, full_rounds, warmup=5))
  finally:
    for server in servers:
      server.close()
    for close in reversed(closers):
      close()
  out = {name: dict(summarize(s, 1e6)) for name, s in samples.items()}
  out = {name: {"p50_us": f["median"], "p90_us": f["p90"],
                "p99_us": f["p99"], "min_us": f["min"], "mean_us": f["mean"],
                "n": f["n"]} for name, f in out.items()}
  floor_p50 = out["pyzmq_floor"]["p50_us"]
  for f in out.values():
    f["x_floor_p50"] = f["p50_us"] / floor_p50
  return {"k": k, "requests": requests, "depth": depth,
          "rows": requests * depth, "step_bytes": len(step_bytes),
          "reply_bytes": len(reply_bytes), "reply_frames": len(codec.split(
              reply_bytes, max_frames=2 * requests, max_bytes=1 << 40)),
          "max_x_floor": _MAX_X_FLOOR, "round_trips": out}


def _round_driver(caps, proposer, requests, verify_s=0.0):
  """A real `Verifier` driver, open, with `requests` requests (ids 0..,
  prompt [1]), on a `Worker.serve` thread answering with `proposer`;
  constant target rows, and a verify_fn that takes `verify_s` (a sleep)
  and accepts nothing. Returns (verifier, close)."""
  worker = bridge.Worker(caps, proposer, secret=_SECRET,
                         counters=Counters(log=False))
  endpoint = bridge.Endpoint.bind("tcp://127.0.0.1:0",
                                  max_message=worker.max_message)
  server = _Server(lambda stop: worker.serve(endpoint, stop, idle_s=0.01))
  fixed_logits = np.zeros((caps.max_depth + 1, caps.vocab), np.float32)

  def verify_fn(logits, q, draft, keys_, anchors):
    del logits, q, keys_, anchors
    if verify_s:
      time.sleep(verify_s)
    return (np.zeros(len(draft), np.int32), np.asarray(draft)[:, 0],
            np.zeros(len(draft), np.int32))

  verifier = bridge.Verifier(
      caps, endpoint.address, timeout_s=10.0, secret=_SECRET,
      sampling_audit=False, counters=Counters("verifier", log=False),
      target_fn=lambda prefix, draft: fixed_logits[:len(draft) + 1],
      verify_fn=verify_fn)

  def close():
    verifier.close()
    server.close()
    endpoint.close()

  try:
    verifier.open()
    for rid in range(requests):
      verifier.add_request(rid, [1], seed=rid)
  except BaseException:
    close()
    raise
  return verifier, close


def overlap_rounds(requests, depth, vocab, k, rng, rounds, draft_ms,
                   verify_ms):
  """Whole rounds of two request groups, with one round in flight and
  with two (`Verifier.start` / `finish`), the sides' work modelled.

  The worker's proposer waits --draft_ms per batch and the verifier's
  verify_fn --verify_ms per round (sleeps: the two sides' models run on
  their own hosts, so neither takes this process's CPU), around the real
  sessions, ZeroMQ link and driver of `round`. With one in flight a
  round costs both; with two the worker's turn hides behind the other
  group's verification. Returns each leg and `in_flight.overlap`, per
  round (of one group)."""
  caps = bridge.Capabilities(vocab=vocab, max_depth=depth,
                             max_requests=requests, max_slots=2,
                             representation=Representation.SPARSE,
                             max_support=k)
  props = proposals(rng, caps, depth, requests)
  source = _AnyRound(Rounds(props, depth, 2), delay_s=draft_ms / 1e3 /
                     requests)
  verifier, close = _round_driver(caps, source, 2 * requests,
                                  verify_s=verify_ms / 1e3)
  groups = [list(range(g * requests, (g + 1) * requests)) for g in (0, 1)]
  legs = {}
  try:
    for in_flight in (1, 2, 1, 2):      # the first two warm up
      flying = collections.deque()
      waited, start = verifier.waited_s, time.perf_counter()
      for r in range(rounds):
        group = groups[r % 2]
        flying.append(verifier.start(group))
        if len(flying) == in_flight:
          results = verifier.finish(flying.popleft())
          if any(res.fallback for res in results):
            raise RuntimeError(f"bench_bridge: round fell back: {results}")
      while flying:
        verifier.finish(flying.popleft())
      legs[in_flight] = {"units": rounds,
                         "wall_s": time.perf_counter() - start,
                         "waited_s": verifier.waited_s - waited}
  finally:
    close()
  return {"rounds": rounds, "requests": requests, "draft_ms": draft_ms,
          "verify_ms": verify_ms, "one": legs[1], "two": legs[2],
          "round_ms": {n: 1e3 * legs[n]["wall_s"] / rounds for n in (1, 2)},
          "overlap": in_flight_lib.overlap(legs[1], legs[2])}


class _AnyRound:
  """A proposer for whole rounds (any tag): round 1's rows every time, not
  audited (the round benchmark runs with the audit off and a constant
  verify_fn)."""

  def __init__(self, rounds, delay_s=0.0):
    self.rounds = rounds
    self.delay_s = delay_s    # a modelled draft's time per proposal

  def __call__(self, seed, generation, round_id, anchor, last_token, depth,
               out=None, *, request=0, context=None):
    del generation, round_id, anchor, last_token, depth, request, context
    if self.delay_s:
      time.sleep(self.delay_s)
    p = self.rounds.proposal(int(seed) % self.rounds.requests, 1)
    if out is not None:
      proposer_lib.write(out, p)
    return p


# ---------------------------------------------------------------------------


def _print_dense(title, rec):
  print(f"\n{title}: {rec['requests']} request(s) x depth {rec['depth']} = "
        f"{rec['rows']} rows, q {rec['q_bytes']:,} B, message "
        f"{rec['message_bytes']:,} B in {rec['frames']} frames; 40 Gb/s "
        f"ideal {rec['ideal_ms']:.3f} ms")
  header = (f"  {'stage':<18} {'median ms':>10} {'p90 ms':>8} "
            f"{'x memcpy':>9} {'x read':>7} {'x ideal':>8} {'GB/s':>7}")
  print(header + "\n  " + "-" * (len(header) - 2))
  for name, s in rec["stages"].items():
    print(f"  {name:<18} {s['median_ms']:10.3f} {s['p90_ms']:8.3f} "
          f"{s['x_memcpy']:9.2f} {s['x_read']:7.2f} {s['x_ideal']:8.2f} "
          f"{s['gb_per_s']:7.1f}")
  print(f"  {'side':<14} {'ms':>7} {'x memcpy':>9} {'x gmac':>7} "
        f"{'x blake3':>9} {'x link':>7} {'x floor':>8}  floor; target")
  for side, f in rec["sides"].items():
    print(f"  {side:<14} {f['ms']:7.3f} {f['x_memcpy']:9.2f} "
          f"{f['x_mac']:7.2f} {f['x_blake3']:9.2f} {f['x_link']:7.2f} "
          f"{f['x_floor']:8.2f}  "
          f"{' + '.join(f['floor'])} {f['floor_ms']:.3f} ms; "
          f"{f['target']}: {f['target_x']:.2f} "
          f"[{'PASS' if f['pass'] else 'MISS'}]")
  h = rec["headline"]
  share = ", ".join(f"{n} {h['share'][n]:.0%}" for n in h["parts"])
  print(f"  host work = {' + '.join(h['parts'])} = {h['ms']:.3f} ms = "
        f"{h['x_memcpy']:.1f}x memcpy = {h['x_ideal']:.2f}x ideal ({share});"
        f" two MAC passes alone {h['mac_share']:.0%} of it; through the "
        f"objects {h['objects_ms']:.3f} ms; audit {h['audit_ms']:.3f} ms + "
        f"draws {h['draws_ms']:.3f} ms per round; CURVE send "
        f"{h['curve_over_clear'] or 0:.1f}x the clear tcp send")


def main(argv):
  del argv
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  logging.getLogger("absl").setLevel(logging.ERROR)
  quick = _QUICK.value
  vocab = (2048 if quick and not flags.FLAGS["vocab"].present
           else _VOCAB.value)
  repeats = 5 if quick and not flags.FLAGS["repeats"].present else (
      _REPEATS.value)
  round_trips = 50 if quick and not flags.FLAGS["round_trips"].present else (
      _ROUND_TRIPS.value)
  full_rounds = 10 if quick and not flags.FLAGS["full_rounds"].present else (
      _FULL_ROUNDS.value)
  overlap_n = 10 if quick and not flags.FLAGS["overlap_rounds"].present else (
      _OVERLAP_ROUNDS.value)
  requests, depth, k = _REQUESTS.value, _DEPTH.value, _K.value
  transports = [t.strip() for t in _TRANSPORTS.value if t.strip()]
  wall_start = time.perf_counter()
  print(f"bench_bridge: V={vocab} requests={requests} depth={depth} k={k} "
        f"repeats={repeats} round_trips={round_trips} backend="
        f"{jax.default_backend()} cpus={os.cpu_count()} "
        f"libzmq={zmq.zmq_version()} blake3={blake3.__version__}")
  rng = np.random.default_rng(_SEED.value)
  tmpdir = run_folder.make("bench_bridge_")   # its keys: reaped if killed
  try:
    keys.make(tmpdir, force=True)
    curve_keys = (keys.load(tmpdir, "worker", encrypt=True).curve,
                  keys.load(tmpdir, "verifier", encrypt=True).curve)
    dense = {"request": dense_scale(1, depth, vocab, rng, transports, tmpdir,
                                    repeats, curve_keys),
             "batch": dense_scale(requests, depth, vocab, rng, transports,
                                  tmpdir, repeats, curve_keys)}
    sparse = sparse_round_trips(requests, depth, vocab, k, rng, round_trips,
                                full_rounds, curve_keys)
    overlap = overlap_rounds(requests, depth, vocab, k, rng, overlap_n,
                             _DRAFT_MS.value, _VERIFY_MS.value)
  finally:
    shutil.rmtree(tmpdir, ignore_errors=True)

  _print_dense("dense request", dense["request"])
  _print_dense("dense batch", dense["batch"])
  rt = sparse["round_trips"]
  print(f"\nsparse k={k} round trips over tcp loopback: STEP message "
        f"{sparse['step_bytes']:,} B out, reply message "
        f"{sparse['reply_bytes']:,} B ({sparse['reply_frames']} frames) back")
  header = (f"  {'round trip':<18} {'p50 us':>8} {'p90 us':>8} "
            f"{'p99 us':>8} {'x floor':>8}")
  print(header + "\n  " + "-" * (len(header) - 2))
  for name in ("pyzmq_floor", "exchange", "exchange_frames",
               "exchange_insecure", "exchange_curve", "host", "round"):
    f = rt[name]
    print(f"  {name:<18} {f['p50_us']:8.1f} {f['p90_us']:8.1f} "
          f"{f['p99_us']:8.1f} {f['x_floor_p50']:8.2f}")

  ms = overlap["round_ms"]
  print(f"\ntwo request groups of {requests}, sparse k={k}, the draft "
        f"modelled as {overlap['draft_ms']:g} ms a batch and verification "
        f"as {overlap['verify_ms']:g} ms a round: a round {ms[1]:.2f} ms "
        f"with one in flight, {ms[2]:.2f} ms with two")
  print("  " + in_flight_lib.line(overlap["overlap"], "round"))

  h = dense["batch"]["headline"]
  ex = rt["exchange"]
  verdicts = [
      (f"dense {requests}-request batch {side} {f['target']}", f["pass"],
       f"{f['ms']:.3f} ms = {f['target_x']:.2f}x")
      for side, f in dense["batch"]["sides"].items()] + [
      (f"dense {requests}-request batch host work <= 40 Gb/s ideal "
       f"({h['ideal_ms']:.3f} ms)", h["ms"] <= h["ideal_ms"],
       f"{h['ms']:.3f} ms, {h['x_ideal']:.2f}x"),
      (f"dense {requests}-request batch host work <= {_MAX_X_MEMCPY:g}x "
       "memcpy", h["x_memcpy"] <= _MAX_X_MEMCPY,
       f"{h['x_memcpy']:.1f}x of {h['memcpy_ms']:.3f} ms"),
      (f"sparse k={k} exchange p50 <= {_MAX_X_FLOOR:g}x the pyzmq round "
       "trip of the same bytes", ex["x_floor_p50"] <= _MAX_X_FLOOR,
       f"p50 {ex['p50_us']:.1f} us = {ex['x_floor_p50']:.2f}x, floor p50 "
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
                   "full_rounds": full_rounds, "overlap_rounds": overlap_n,
                   "transports": transports,
                   "link_gbps": _LINK_GBPS.value, "quick": quick,
                   "seed": _SEED.value, "backend": jax.default_backend(),
                   "cpus": os.cpu_count(), "python": platform.python_version(),
                   "jax": jax.__version__, "pyzmq": zmq.__version__,
                   "libzmq": zmq.zmq_version(),
                   "blake3": blake3.__version__},
        "dense": dense, "sparse": sparse, "overlap": overlap,
        "headline": dict(h, name="host work for a dense "
                         f"{requests}-request batch"),
        "sides": dense["batch"]["sides"],
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
  cli.run(main)
