"""Soak: verifier -> fault-injecting proxy -> worker, every fault accounted.

Harness (`run_soak`): a worker (its own process, or a thread), the
loopback `Proxy` (dyadic_jax.testing.proxy) in front of it, and a real
`Verifier` driving batches of 4 requests at depth 4 with the toy bigram
models at V = 16 (target and draft logits divided by 4: a flat enough
bigram that every transition is seen), authenticated by a deployment
secret. With one round in flight one group of requests runs a round at
a time; with two (`in_flight=2`, HELLO's max_slots) two groups are
pipelined as `generate` runs them: a group's next round starts while the
other group's is out (`bridge_harness.drive`). Requests live for one
epoch of EPOCH rounds; each group's last round of an epoch is spared by
the proxy (`Proxy.spare`, named by its tags before its STEP leaves), so
that late and duplicated replies of the epoch are read (and counted)
before its requests retire. The proxy faults STEP and reply messages
(delay, drop, duplicate, reorder, truncate, corrupt, reset, and a benign
jitter), at most one fault per exchange, drawn per exchange (seed,
direction, tags), whatever the order two exchanges' messages cross it
in. It holds no key: every frame it damages fails authentication.

No outcome depends on the machine's speed: the verifier's deadline is
generous (DEADLINE_S, 60 s: no healthy exchange misses it, however loaded
the machine), and when the proxy loses an exchange (a fault in
`proxy.LOST`) it names it (`on_lost(tags)`), and the verifier
(`bridge_harness.ExpiringVerifier`) ends that exchange alone once its
socket is quiet, so it times out at once instead of after a wall-clock
wait, while the other exchange in flight keeps its deadline.

What a soak asserts, without re-deriving how the sessions classify a
message (the protocol's own objects classify; the soak checks outcomes):

(a) nothing lost or repeated: each request's tokens are its prompt followed
    by its RoundResults' `committed` tuples in order; every anchor is the
    previous anchor plus what the previous round committed; tags advance
    (round + 1, or generation + 1 and round 1 after a fallback); no
    (request, generation, round) tag repeats.
(b) every fault is accounted for, exchange by exchange: no exchange without
    a damaging fault falls back, except one in flight at a reset (a reset
    loses what the link carried for both exchanges: the proxy calls
    `on_lost(None)` and the verifier ends every exchange whose answer it
    had not read, `Soak.reset_lost`, which may fall back with TIMEOUT and
    nothing else); an exchange whose STEP or reply was
    dropped, delayed, cut, corrupted or lost in a reset falls back whole
    (TIMEOUT, or UNKNOWN_SESSION when the corruption hit the session id
    and the worker refused it), except that a cut of a whole frame leaves
    the other frames authentic (their requests may be verified); duplicates, jitter and a reordered STEP
    damage nothing; a reordered reply fails its requests with a sequencing
    code or leaves them verified. The counters, exactly: every fallback's
    code is counted, every TIMEOUT once per request; each damaged message
    is refused once where it arrives (AUTH_FAILED, a framing code, or
    UNKNOWN_SESSION, whose STEP the worker answers with a RESET of that
    other session, refused by the verifier); each duplicated or delayed
    reply and each duplicated STEP's second answer adds one
    STALE_GENERATION / DUPLICATE_ROUND per request, a delayed STEP one on
    the worker, a duplicated STEP one retry served per request, and an
    exchange a reset ended adds its requests' refusals when its answer
    still came (0 or 4 each); with two in flight the session counts one
    overlap per start but each epoch's first, less those where the other
    group's exchange had already ended (lost, or refused whole: it fell
    back whole). Each per-kind run faults every exchange but the drain
    rounds exactly once, except, with two in flight, one a reset ended
    before its message reached the proxy.
(c) the committed tokens follow the target: every committed token after
    token a is drawn from P(. | a) = P_a / T_a, the quantized target
    (`quantize_target(target_probs(logits))`, what the sampler reproduces
    to within 2^-64), whatever the mix of verified, bonus and target-only
    tokens. The transition counts (a -> y) are tested with a chi-square for
    Markov chains (conditional on the row totals): in each row, cells with
    expected count < 5 are pooled; level stats.ALPHA = 1e-7 with a fixed
    seed (the run is deterministic: fixed proxy seed, request seeds).

Power: a mutant `verify_fn` verifies against q' = q with a quarter of the
drafted token's count moved to the row's largest other entry (q'(x) = 3/4
q(x): drafted tokens are over-accepted; its output at a drafted position is
at total variation 0.06-0.17 from the target, mean 0.12, by row). Its
exact law there is computed in `_mutant_law`; run through the same harness
(MUTANT_ROUNDS = 400 rounds, same faults: about 6,200 transitions, df about
150) the pooled chi-square has noncentrality about 360 against it, so its
power at ALPHA is 1 - 3e-13 (the test recomputes this from the run's own
counts and requires at least stats.POWER = 1 - 1e-4).

Runtime on 2 shared CPU cores: the CI soaks (600 exchanges, worker
process, one and two rounds in flight) about 15 s and 10 s; the mutant
run and the 32 per-kind runs (16 per in-flight count) about half a
minute each; each slow soak (20,000 exchanges, sparse or dense q, one or
two in flight, worker process, `--runslow`) minutes (sparse, two in
flight: 100 s of soak on a loaded machine). `pytest -s` prints the
tables.
"""

import collections
import dataclasses
import functools
import itertools
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sp_stats

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import digest as digest_lib
from dyadic_jax.testing import proxy as proxy_lib
from dyadic_jax.models import toy_pair
from dyadic_jax.testing import stats
from dyadic_jax.wire.layouts import Representation
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness
from tests import no_leftovers

M = dj.M
V = 16
K = 8                   # sparse support
DEPTH = 4
REQUESTS = 4
SCALE = np.float32(0.25)  # logits / 4: exact in float32
CLOSENESS = 0.5
# The verifier's exchange deadline: generous, no healthy exchange misses it
# on a loaded machine. A lost exchange times out at once all the same: the
# proxy warps the verifier's clock past it (bridge_harness.WarpClock).
DEADLINE_S = bridge_harness.GENEROUS_S
JITTER_S = 0.025        # the benign jitter: held up to this long
START_S = 300.0         # a worker process's start and stop, at most
EPOCH = 200             # rounds per request lifetime (the last one clean)
SEED = 20261201
SECRET = bytes(range(32, 64))
RATE = 0.04             # per eligible message: ~8% of exchanges faulted
ROUNDS = 600
LONG_ROUNDS = 20_000
MUTANT_ROUNDS = 400
MUTANT_SHIFT = 4        # the mutant moves c_x // 4 away from the drafted x
SOAK_KINDS = proxy_lib.KINDS + proxy_lib.BENIGN

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top

# -- the models ---------------------------------------------------------------


def _toy():
  return toy_pair.make_toy(toy_pair.ToyConfig(vocab=V,
                                                  closeness=CLOSENESS))


_TOY = _toy()
# Target logits of every previous token, float32[V, V]: the target_fn reads
# rows of this table, so the chi-square's P is computed from the very same
# float32 rows the verifier samples from.
TARGET = np.asarray(toy_pair.target_logits(_TOY, jnp.arange(V))) * SCALE


def _target_fn(prefix, draft):
  return TARGET[np.concatenate([prefix[-1:], draft]).astype(np.int32)]


def _exact_target():
  """P(y | a) = P_ay / T_a, float64[V, V]."""
  probs, status = dj.target_probs(TARGET)
  assert not np.any(np.asarray(status))
  p, t = dj.quantize_target(probs)
  return np.asarray(p, np.float64) / np.asarray(t, np.float64)[:, None]


# The verifier's HELLO offer of answer forms (`bridge.Capabilities`): the
# soaks run the default (the PACKED reply and the PACKED_STEP frame: every
# STEP message and every answer one frame); the per-kind and scripted runs
# offer none, the per-frame STEP, REPLY + COMPLETION form whose frames
# their faults cut, swap and reorder (a one-frame message has nothing to
# reorder: the proxy corrupts it instead; the packed forms' record edits:
# tests/bridge/test_packed.py).
PER_FRAME = 0
# The fault kinds a soak of the default form draws and applies: all but
# reorder (test_each_fault_kind_is_accounted reorders per-frame messages).
PACKED_KINDS = frozenset(SOAK_KINDS) - {"reorder"}


def _caps(representation, features=None):
  kw = {} if features is None else {"features": features}
  return bridge.Capabilities(vocab=V, max_depth=DEPTH, max_requests=REQUESTS,
                             max_slots=2, representation=representation,
                             max_support=K, **kw)


@functools.cache
def _proposer(caps):
  # One proposer (one compile) per capabilities in a process.
  toy = _TOY
  return bridge.draft_proposer(
      lambda prev: toy_pair.draft_logits(toy, prev) * SCALE, caps)


# -- the worker (a thread, or this module run as a process) -------------------


def worker_main(representation):
  """Entry of the worker process: prints its address, serves until stdin
  closes, then prints its counters as JSON."""
  caps = _caps(Representation[representation])
  worker = bridge.Worker(caps, _proposer(caps), secret=SECRET)
  bridge_harness.serve_until_stdin_closes(worker)
  print("COUNTERS", json.dumps(worker.counters.snapshot()), flush=True)


class _ProcessWorker:
  """`worker_main` in a child process (always killed at the end)."""

  def __init__(self, representation):
    env = paths.subprocess_env(JAX_PLATFORMS="cpu")
    self.proc = subprocess.Popen(
        [sys.executable, "-c", "from tests.system.test_soak import "
         f"worker_main; worker_main({representation.name!r})"],
        cwd=_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    # The start (import, compile) bounded by its progress, not a fixed
    # deadline: a loaded machine only slows it.
    try:
      line = no_leftovers.wait_for_line(self.proc, self.proc.stdout,
                                        "READY ")
    except BaseException:
      self.proc.kill()
      self.proc.wait()
      raise
    self.address = line.split()[1]

  def stop(self):
    """The worker's counters snapshot."""
    try:
      out, _ = self.proc.communicate(input="", timeout=START_S)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait()
    lines = [l for l in out.splitlines() if l.startswith("COUNTERS ")]
    assert self.proc.returncode == 0 and lines, out[-2000:]
    return json.loads(lines[-1][len("COUNTERS "):])


class _ThreadWorker:
  """The worker loop in a thread of this process."""

  def __init__(self, representation):
    caps = _caps(representation)
    self.served = bridge_harness.serve(
        bridge.Worker(caps, _proposer(caps), secret=SECRET))
    self.address = self.served.address

  def stop(self):
    self.served.close()
    return self.served.worker.counters.snapshot()


# -- one soak -----------------------------------------------------------------


@dataclasses.dataclass
class Soak:
  """What a soak run left behind."""
  caps: bridge.Capabilities
  in_flight: int         # rounds in flight: 1, or 2 (two request groups)
  epochs: int
  exchanges: list        # per round: the RoundResults of the batch
  prompts: dict          # rid -> prompt
  requests: dict         # rid -> verifier Request (committed state)
  faults: list           # proxy Fault records
  reset_lost: list       # tag sets of the exchanges in flight at a reset
  ended_early: list      # tag sets: the other round had ended at a start
  spared: list           # tag sets of the drain rounds (never faulted)
  verifier: dict         # counters snapshots
  worker: dict
  proxy_summary: str
  wall_s: float


def run_soak(rounds, *, representation=Representation.SPARSE, rate=RATE,
             seed=SEED, kinds=SOAK_KINDS,
             directions=(proxy_lib.TO_WORKER, proxy_lib.TO_VERIFIER),
             process=False, in_flight=1,
             verify_fn=dj.verify_batch, epoch=EPOCH, deadline_s=DEADLINE_S,
             features=None):
  """Drives `rounds` rounds (whole epochs) of each request group through
  the proxy; see above. in_flight: 1 (one group of REQUESTS requests, a
  round at a time) or 2 (two groups, pipelined: a group's next round
  starts while the other group's is out). features: the verifier's offer
  (None: the default, packed answers)."""
  assert rounds % epoch == 0, (rounds, epoch)
  assert in_flight in (1, 2), in_flight
  caps = _caps(representation, features)
  worker = (_ProcessWorker if process else _ThreadWorker)(representation)
  proxy = verifier = None
  start = time.monotonic()
  try:
    # A lost exchange ends at once (the proxy names it; the verifier is
    # made after the proxy, before any exchange can be lost).
    proxy = proxy_lib.Proxy(
        "tcp://127.0.0.1:0", worker.address, rate=rate, seed=seed,
        deadline_s=deadline_s, jitter_s=JITTER_S, kinds=kinds,
        directions=directions,
        on_lost=lambda tags: verifier.expire(tags)).start()
    verifier = bridge_harness.ExpiringVerifier(
        caps, proxy.address, target_fn=_target_fn, verify_fn=verify_fn,
        timeout_s=deadline_s, secret=SECRET,
        clock=time.monotonic).open()
    _warm_verifier(caps, verify_fn)
    rng = np.random.default_rng(seed)
    exchanges, prompts, early, spared = [], {}, [], []
    for e in range(rounds // epoch):
      groups = [[REQUESTS * (in_flight * e + g) + i for i in range(REQUESTS)]
                for g in range(in_flight)]
      for rid in (r for group in groups for r in group):
        prompts[rid] = [int(rng.integers(V))]
        verifier.add_request(rid, prompts[rid], seed=seed + rid)
      exchanges += _epoch(verifier, proxy, groups, epoch, early, spared)
    # A barrier: the worker answers this HELLO only after it handled every
    # message before it (the last COMMITs), so nothing is in flight when
    # the proxy and the worker stop. One more session on both sides.
    verifier.reconnect()
    wall = time.monotonic() - start
  finally:
    if proxy is not None:
      proxy.stop()
    if verifier is not None:
      verifier.close()
    worker_counters = worker.stop()
  return Soak(caps, in_flight, rounds // epoch, exchanges, prompts,
              verifier.requests, list(proxy.faults), verifier.reset_lost,
              early, spared, verifier.counters.snapshot(), worker_counters,
              proxy.summary(), wall)


def _epoch(verifier, proxy, groups, epoch, early, spared):
  """`epoch` rounds of each group (`bridge_harness.drive`: with two groups
  a group's next round starts while the other group's is out); returns
  their RoundResults in the order they were finished. Appends to `early`
  the tags of another group's exchange that had ended (lost, or refused
  whole) when a round started: no overlap for the session then. Each
  group's last round is the drain round, spared by the proxy (its tags
  appended to `spared`): it reads the epoch's late replies before its
  requests retire."""

  def before_start(group, r, others):
    for flight in others:
      ex = flight.exchange
      if ex.key not in verifier.session.exchanges:
        early.append(frozenset((q,) + ex.tags[q] for q in ex.rids))
    if r == epoch - 1:
      reqs = verifier.requests
      tags = [(rid, reqs[rid].generation, reqs[rid].round + 1)
              for rid in group]
      proxy.spare(tags)
      spared.append(frozenset(tags))

  return bridge_harness.drive(verifier, groups, epoch, len(groups),
                              before_start)


def _warm_verifier(caps, verify_fn):
  """Compiles what the verifier runs, so that a first fallback does not
  stall the loop for a compile (a delayed message waits for the COMMIT)."""
  key = dj.round_key(0, 0, 0)
  dj.sample_target(TARGET[0], dj.draw_key(key, 1, dj.Domain.TARGET_ONLY))
  q = caps.format.example_q(DEPTH, V, caps.width)
  r = caps.max_requests       # the driver pads every round to this batch
  batch = lambda x: jnp.stack([x] * r)
  verify_fn(batch(TARGET[:DEPTH + 1]), jax.tree.map(batch, q),
            batch(np.zeros(DEPTH, np.int32)), batch(key), np.ones(r))


# -- (a) and (c): nothing lost, nothing repeated ------------------------------


def check_commits(soak):
  by_rid = collections.defaultdict(list)
  for batch in soak.exchanges:
    for res in batch:
      by_rid[res.rid].append(res)
  assert set(by_rid) == set(soak.prompts)
  for rid, results in by_rid.items():
    tokens = list(soak.prompts[rid])
    tag = (0, 0)
    for res in results:
      assert res.anchor == len(tokens), (rid, res)
      want = (tag[0], tag[1] + 1)
      assert (res.generation, res.round) == want, (rid, res, want)
      tag = (res.generation + 1, 0) if res.fallback else want
      if res.fallback:
        assert len(res.committed) == 1 and res.accepted == 0, res
        assert res.code is not None, res
      else:
        assert res.code is None and len(res.committed) == res.accepted + 1
        assert 0 <= res.accepted <= DEPTH, res
      assert all(0 <= t < V for t in res.committed), res
      tokens.extend(res.committed)
    assert soak.requests[rid].tokens == tokens, rid
    digest = digest_lib.of(soak.prompts[rid])
    for res in results:
      digest = digest_lib.extend(digest, res.committed)
    assert soak.requests[rid].digest == digest, rid
  tags = [(r.rid, r.generation, r.round) for b in soak.exchanges for r in b]
  assert len(set(tags)) == len(tags)


# -- (b): every fault accounted for -------------------------------------------

# Faults after which the worker never answered the exchange's STEP, or the
# verifier never read an authentic reply in time.
_LOST = {"drop", "reset", "delay", "corrupt", "truncate"}
# How a message that does not arrive intact is refused where it arrives
# (UNKNOWN_SESSION: the bit hit its session id).
_FRAMING = (Code.AUTH_FAILED, Code.TRUNCATED, Code.UNEXPECTED_SIZE,
            Code.BAD_MAGIC, Code.UNSUPPORTED_VERSION, Code.UNKNOWN_KIND,
            Code.ABSURD_LENGTH, Code.UNKNOWN_SESSION)
# Codes a reordered reply may fail a request with (its frames authenticate
# one by one, but no longer sit where their COMPLETION says).
_SEQUENCE = {Code.BAD_SEQUENCE, Code.CHECKSUM_MISMATCH, Code.UNEXPECTED_SIZE,
             Code.DUPLICATE_ROUND}


def _frame_removed(fault):
  """A truncation that cut a whole frame (about 1 in 350 of them): what
  arrives is authentic, one frame short."""
  return fault.kind == "truncate" and fault.detail["kept"] == 0


def _allowed(fault):
  """(outcomes allowed per request, None = verified) of one exchange."""
  if fault is None or fault.kind in ("jitter", "duplicate"):
    return {None}
  if _frame_removed(fault):
    # The other requests' frames still verify. A reply one REPLY frame
    # short fails its request (its COMPLETION names rows that never came);
    # one without a COMPLETION, or a STEP one request short, times that
    # request out (the worker serves what it was asked).
    return {None, Code.TIMEOUT} | (
        _SEQUENCE if fault.direction == proxy_lib.TO_VERIFIER else
        {Code.UNKNOWN_SESSION})
  if fault.kind == "reorder":
    return ({None} if fault.direction == proxy_lib.TO_WORKER
            else {None} | _SEQUENCE)
  if fault.direction == proxy_lib.TO_WORKER and fault.kind in (
      "corrupt", "truncate"):
    return {Code.TIMEOUT, Code.UNKNOWN_SESSION}
  return {Code.TIMEOUT}


def check_accounting(soak):
  """(b): per exchange, then the counters. Returns tables for the report."""
  by_tags = {}
  for batch in soak.exchanges:
    by_tags[frozenset((r.rid, r.generation, r.round) for r in batch)] = batch
  exchange_of = {tag: key for key in by_tags for tag in key}
  faults = {}
  for f in soak.faults:
    # A message of one exchange (its answer to a STEP one frame short
    # carries part of its tags).
    keys = {exchange_of.get(tuple(tag)) for tag in f.tags}
    assert len(keys) == 1 and None not in keys, f"fault of no exchange: {f}"
    key = keys.pop()
    assert key not in faults, f"two faults on one exchange: {f}"
    faults[key] = f
  in_reset = set(soak.reset_lost)
  # A reset's collateral only with another exchange in flight.
  assert soak.in_flight == 2 or not in_reset, in_reset
  assert not in_reset or any(f.kind == "reset" for f in soak.faults)
  codes_by_kind = collections.defaultdict(collections.Counter)
  damaged = collections.Counter()
  for key, batch in by_tags.items():
    fault = faults.get(key)
    allowed = _allowed(fault)
    label = "none" if fault is None else f"{fault.direction}/{fault.kind}"
    if key in in_reset:
      # In the link when another exchange's reset cut it: what it carried
      # may be lost, so the proxy ended it too (TIMEOUT), unless the
      # verifier had read its answer already.
      allowed = allowed | {Code.TIMEOUT}
      label += " (in flight at a reset)"
    codes = [r.code for r in batch]
    assert set(codes) <= allowed, (
        "an exchange outcome the fault cannot explain (without a fault: a "
        "natural timeout, i.e. an overloaded machine, or a bridge bug)",
        fault, batch)
    if (fault is not None and fault.kind in _LOST
        and not _frame_removed(fault)):
      # Nothing of the exchange arrived intact: it falls back whole.
      assert all(c is not None for c in codes), (fault, batch)
    if any(c is not None for c in codes):
      damaged[label] += 1
    for code in codes:
      codes_by_kind[label][code.name if code else "verified"] += 1
  results = [r for b in soak.exchanges for r in b]
  fallbacks = collections.Counter(r.code for r in results if r.fallback)
  errors = collections.Counter({Code[k]: n for k, n in
                                soak.verifier["errors"].items()})
  # Every fallback's code counted (a message-level refusal once for all
  # the requests it fails); TIMEOUT exactly once per request it discards.
  for code in fallbacks:
    assert errors[code] > 0, (code, errors)
  assert errors[Code.TIMEOUT] == fallbacks[Code.TIMEOUT], (errors, fallbacks)
  # Every damaged message was refused once where it arrived (AUTH_FAILED
  # or a framing code, before anything of it was used); a STEP whose
  # session id was hit is answered by a RESET of that other session,
  # refused as such by the verifier.
  w_errors = collections.Counter({Code[k]: n for k, n in
                                  soak.worker["errors"].items()})
  n = lambda kinds, direction: sum(
      f.kind in kinds and f.direction == direction and not _frame_removed(f)
      for f in soak.faults)
  framing = lambda e: sum(e[c] for c in _FRAMING)
  unknown = w_errors[Code.UNKNOWN_SESSION]
  assert framing(errors) == n(("corrupt", "truncate"),
                              proxy_lib.TO_VERIFIER) + unknown, errors
  assert framing(w_errors) == n(("corrupt", "truncate"),
                                proxy_lib.TO_WORKER), w_errors
  # Late and duplicated messages: one refusal per request they carry. A
  # duplicated STEP is answered twice (from the worker's cache), a delayed
  # one reaches the worker after its round's COMMIT. An exchange a reset
  # ended early adds its answer when that answer still came.
  late = errors[Code.STALE_GENERATION] + errors[Code.DUPLICATE_ROUND] - (
      REQUESTS * (n(("duplicate",), proxy_lib.TO_VERIFIER)
                  + n(("duplicate",), proxy_lib.TO_WORKER)
                  + n(("delay",), proxy_lib.TO_VERIFIER)))
  assert late % REQUESTS == 0 and 0 <= late <= REQUESTS * len(in_reset), (
      errors, late)
  assert soak.worker["events"].get("retries_served", 0) == REQUESTS * n(
      ("duplicate",), proxy_lib.TO_WORKER), soak.worker
  late_steps = w_errors[Code.DUPLICATE_ROUND] + w_errors[
      Code.STALE_GENERATION] - REQUESTS * n(("delay",), proxy_lib.TO_WORKER)
  assert late_steps % REQUESTS == 0 and 0 <= late_steps <= REQUESTS * len(
      in_reset), (w_errors, late_steps)
  v_events = soak.verifier["events"]
  # Every start but each epoch's first overlaps the other group's round,
  # unless that round had ended already: refused whole or lost, so it
  # fell back whole.
  for key in soak.ended_early:
    assert all(r.fallback for r in by_tags[key]), by_tags[key]
  overlaps = (len(soak.exchanges) - soak.epochs - len(soak.ended_early)
              if soak.in_flight == 2 else 0)
  assert v_events.get("overlapped", 0) == overlaps, (v_events, overlaps)
  assert v_events["rounds"] == len(results)
  assert v_events["tokens"] == sum(len(r.committed) for r in results)
  assert v_events.get("fallbacks", 0) == sum(fallbacks.values())
  assert soak.worker["events"]["commits"] <= len(results)
  assert damaged["none"] == 0, "an exchange without a fault fell back"
  return codes_by_kind, damaged, collections.Counter()


# -- (d): the committed tokens follow the target ------------------------------


def transitions(soak):
  """counts[a, y] of committed y after a; drafted[a] of those at drafted
  positions (accepted or corrected), the rest bonus or target-only."""
  counts = np.zeros((V, V), np.int64)
  drafted = np.zeros(V, np.int64)
  for rid, prompt in soak.prompts.items():
    tokens = np.asarray(soak.requests[rid].tokens)
    np.add.at(counts, (tokens[len(prompt) - 1:-1], tokens[len(prompt):]), 1)
  for batch in soak.exchanges:
    for res in batch:
      if res.fallback:
        continue
      prev = [soak.requests[res.rid].tokens[res.anchor - 1]] + list(
          res.committed[:-1])
      n_drafted = len(res.committed) - (res.accepted == DEPTH)
      np.add.at(drafted, prev[:n_drafted], 1)
  return counts, drafted


def _bins(expected_row):
  """Pooled bins of one row: lists of cells, each with expected >= 5."""
  order = np.argsort(expected_row)
  bins, pool = [], []
  for cell in order:
    if expected_row[cell] >= 5:
      bins.append([int(cell)])
    else:
      pool.append(int(cell))
  if pool and sum(expected_row[pool]) < 5:
    if not bins:
      return []
    bins[0] = bins[0] + pool     # the smallest large bin absorbs the rest
  elif pool:
    bins.append(pool)
  return bins if len(bins) > 1 else []


def chi_square(counts, probs):
  """(statistic, df, p-value, bins) of transition counts against probs."""
  stat, df, layout = 0.0, 0, []
  for a in range(V):
    n = counts[a].sum()
    if np.any(counts[a][probs[a] == 0]):
      return np.inf, 1, 0.0, layout
    bins = _bins(n * probs[a])
    layout.append(bins)
    for cells in bins:
      e = n * probs[a][cells].sum()
      stat += (counts[a][cells].sum() - e) ** 2 / e
    df += max(len(bins) - 1, 0)
  return stat, df, float(sp_stats.chi2.sf(stat, df)), layout


def _report(name, counts, probs, stat, df, pvalue):
  print(f"\n{name}: {counts.sum()} transitions chi2={stat:.1f} df={df} "
        f"p={pvalue:.3g} alpha={stats.ALPHA:g}")
  for a in range(V):
    n = counts[a].sum()
    worst = np.argmax(np.abs(counts[a] - n * probs[a]))
    print(f"  after {a:2d}: N={n:6d}  largest gap at {worst:2d}: expected "
          f"{n * probs[a][worst]:8.1f} observed {counts[a][worst]:6d}")


# -- the mutant ---------------------------------------------------------------


def _shifted(counts, x, shift=MUTANT_SHIFT):
  """Counts with c_x // shift moved from x to the largest other entry (the
  first of equals); unchanged when shift is None or x is alone."""
  counts = np.array(counts, copy=True)
  others = counts.astype(np.int64)
  others[x] = -1
  j = int(np.argmax(others))
  h = 0 if shift is None else counts[x] // shift
  if others[j] > 0:
    counts[x] -= h
    counts[j] += h
  return counts


def mutant_verify(target_logits, q, draft_tokens, keys, anchors):
  """verify_batch against q' (see the module docstring): biased."""
  draft = np.asarray(draft_tokens)
  if isinstance(q, dj.DenseQ):
    c = np.asarray(q.counts).copy()
    for (b, i), x in np.ndenumerate(draft):
      c[b, i] = _shifted(c[b, i], x)
    q = dj.DenseQ(c)
  else:
    ids, c, n = (np.asarray(a).copy() for a in q)
    for (b, i), x in np.ndenumerate(draft):
      live = slice(0, int(n[b, i]))
      hit = np.nonzero(ids[b, i, live] == x)[0]
      if len(hit):
        c[b, i, live] = _shifted(c[b, i, live], int(hit[0]))
    q = dj.SparseQ(ids, c, n)
  return dj.verify_batch(target_logits, q, draft, keys, anchors)


def _mutant_law(shift=MUTANT_SHIFT):
  """float64[V, V]: the mutant's exact law of a token at a drafted position
  after token a (the draft's sparse q rows, verified against q'); with
  shift=None the standard rule's, which must be the target P / T."""
  draft = np.asarray(toy_pair.draft_logits(_TOY, jnp.arange(V))) * SCALE
  w, _ = dj.draft_weights(draft)
  ids, counts, n, _ = dj.allocate_sparse(w, K)
  p_fixed, t = (np.asarray(a, np.float64) for a in dj.quantize_target(
      dj.target_probs(TARGET)[0]))
  law = np.zeros((V, V))
  for a in range(V):
    c = np.zeros(V, np.int64)
    c[np.asarray(ids)[a, :int(n[a])]] = np.asarray(counts)[a, :int(n[a])]
    p, total = p_fixed[a], t[a]
    for x in np.nonzero(c)[0]:
      c2 = _shifted(c, x, shift)
      accept = min(1.0, p[x] * M / (total * c2[x]))
      residual = np.maximum(p * M - c2 * total, 0)
      if residual.sum() == 0:
        residual = p * M
      law[a, x] += c[x] / M * accept
      law[a] += c[x] / M * (1 - accept) * residual / residual.sum()
  assert np.allclose(law.sum(1), 1)
  return law


def mutant_power(counts, drafted, probs, layout, df):
  """Power of the pooled chi-square against the mutant at these counts."""
  law = _mutant_law()
  lam = 0.0
  for a in range(V):
    n = counts[a].sum()
    mixed = (drafted[a] * law[a] + (n - drafted[a]) * probs[a])
    for cells in layout[a]:
      e0 = n * probs[a][cells].sum()
      lam += (mixed[cells].sum() - e0) ** 2 / e0
  crit = sp_stats.chi2.isf(stats.ALPHA, df)
  return lam, float(sp_stats.ncx2.sf(crit, df, lam))


# -- the table ----------------------------------------------------------------


def _table(name, soak, codes_by_kind, damaged, notes):
  results = [r for b in soak.exchanges for r in b]
  faulted = len(soak.faults)
  print(f"\n== {name}: {len(soak.exchanges)} rounds x {REQUESTS} requests "
        f"({len(results)} results) in {soak.wall_s:.1f} s; {faulted} faults "
        f"({faulted / len(soak.exchanges):.1%} of exchanges), "
        f"{sum(damaged.values())} exchanges damaged")
  print(soak.proxy_summary)
  print(f"{'fault':24s} outcomes per request")
  for label in sorted(codes_by_kind):
    print(f"  {label:22s} {dict(sorted(codes_by_kind[label].items()))}")
  print(f"{soak.in_flight} in flight: overlapped "
        f"{soak.verifier['events'].get('overlapped', 0)}, the other round "
        f"ended before a start {len(soak.ended_early)}, in flight at a "
        f"reset {len(soak.reset_lost)}")
  print(f"verifier: {soak.verifier}")
  print(f"worker:   {soak.worker}")
  for note, n in sorted(notes.items()):
    print(f"{note}: {n}")
  held = [f.detail.get("released_s", 0) for f in soak.faults
          if f.kind == "delay"]
  resets = [f.detail.get("reset_s", 0) for f in soak.faults
            if f.kind == "reset"]
  print(f"delays held {max(held, default=0):.3f} s at most; resets took "
        f"{max(resets, default=0):.3f} s at most")


def _soak_and_check(name, rounds, **kwargs):
  soak = run_soak(rounds, **kwargs)
  check_commits(soak)
  codes_by_kind, damaged, notes = check_accounting(soak)
  _table(name, soak, codes_by_kind, damaged, notes)
  return soak, damaged


# -- tests --------------------------------------------------------------------


def test_exact_laws():
  probs = _exact_target()
  # Every transition has a cell to count: no row is near-deterministic.
  assert np.allclose(probs.sum(1), 1) and probs.min() > 1e-4
  # The standard rule's law at a drafted position, computed like the
  # mutant's, is the target: this checks `_mutant_law` itself.
  np.testing.assert_allclose(_mutant_law(shift=None), probs, atol=1e-12)
  tv = 0.5 * np.abs(_mutant_law() - probs).sum(1)
  print(f"mutant TV by row: min {tv.min():.3f} mean {tv.mean():.3f} max "
        f"{tv.max():.3f}")
  assert 0.05 < tv.min() and tv.max() < 0.2, tv


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("direction", [proxy_lib.TO_WORKER,
                                       proxy_lib.TO_VERIFIER])
@pytest.mark.parametrize("kind", SOAK_KINDS)
def test_each_fault_kind_is_accounted(kind, direction, in_flight):
  # Every exchange but the drain rounds gets this one fault: 2 epochs of
  # 4 rounds, 3 faulted rounds each, per group.
  soak, damaged = _soak_and_check(
      f"{direction}/{kind}, {in_flight} in flight", 8, rate=1.0,
      kinds=(kind,), directions=(direction,), epoch=4, in_flight=in_flight,
      seed=SEED + SOAK_KINDS.index(kind), features=PER_FRAME)
  # Exactly one fault per exchange that is not a drain round, except one
  # that a reset lost before its message of this direction reached the
  # proxy (with two in flight: the other group's).
  faulted = {frozenset(f.tags) for f in soak.faults}
  unreached = set(soak.reset_lost) - faulted - set(soak.spared)
  assert len(soak.faults) + len(unreached) == 6 * in_flight
  assert not unreached or (kind == "reset" and in_flight == 2), unreached
  assert all(f.kind == kind and f.direction == direction
             for f in soak.faults)
  harmless = kind in ("jitter", "duplicate") or (
      kind == "reorder" and direction == proxy_lib.TO_WORKER)
  assert (sum(damaged.values()) == 0) == harmless, damaged


@pytest.mark.long
@pytest.mark.parametrize("in_flight", [1, 2])
def test_soak_ci_worker_process(in_flight):
  # As many exchanges either way: ROUNDS of one group, or ROUNDS / 2 of
  # each of two groups, pipelined.
  soak, damaged = _soak_and_check(
      f"CI soak (worker process, sparse q, {in_flight} in flight)",
      ROUNDS // in_flight, process=True, in_flight=in_flight,
      epoch=EPOCH // in_flight)
  assert len(soak.exchanges) == ROUNDS
  assert sum(damaged.values()) > 0
  kinds = collections.Counter(f.kind for f in soak.faults)
  assert set(kinds) == PACKED_KINDS, kinds
  probs = _exact_target()
  counts, _ = transitions(soak)
  stat, df, pvalue, _ = chi_square(counts, probs)
  _report("CI soak transitions", counts, probs, stat, df, pvalue)
  assert pvalue > stats.ALPHA


def test_mutant_is_rejected_by_the_same_harness():
  soak, _ = _soak_and_check("mutant soak (q' = q with c_x / 4 moved)",
                            MUTANT_ROUNDS, verify_fn=mutant_verify,
                            epoch=100)
  probs = _exact_target()
  counts, drafted = transitions(soak)
  stat, df, pvalue, layout = chi_square(counts, probs)
  _report("mutant transitions", counts, probs, stat, df, pvalue)
  lam, power = mutant_power(counts, drafted, probs, layout, df)
  print(f"mutant: noncentrality {lam:.0f}, df {df}, power at alpha "
        f"{stats.ALPHA:g}: 1 - {1 - power:.3g}")
  assert power >= stats.POWER
  assert pvalue < stats.ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("representation", [Representation.SPARSE,
                                            Representation.DENSE],
                         ids=["sparse", "dense"])
def test_soak_long(representation, in_flight):
  soak, damaged = _soak_and_check(
      f"long soak (worker process, {representation.name.lower()} q, "
      f"{in_flight} in flight)", LONG_ROUNDS // in_flight, process=True,
      representation=representation, seed=SEED + 1, in_flight=in_flight,
      epoch=EPOCH // in_flight)
  assert len(soak.faults) >= 0.05 * LONG_ROUNDS
  assert sum(damaged.values()) >= 0.04 * LONG_ROUNDS
  probs = _exact_target()
  counts, _ = transitions(soak)
  stat, df, pvalue, _ = chi_square(counts, probs)
  _report("long soak transitions", counts, probs, stat, df, pvalue)
  assert pvalue > stats.ALPHA


# -- scripted exchanges: regression tests of the bugs this soak found -------


class _Scripted(proxy_lib.Proxy):
  """Forwards everything; the i-th reply message goes through script[i]
  and the i-th STEP message through steps[i] (frames -> frames to deliver,
  or None: pass it untouched). An edit that loses its exchange (`_lost`)
  names it to `on_lost` once it is delivered (a STEP's: once the worker's
  answer to it passed), so that the verifier times it out."""

  def __init__(self, *args, script, steps=(), **kwargs):
    super().__init__(*args, rate=0.0, seed=0, deadline_s=DEADLINE_S,
                     **kwargs)
    self.script = {proxy_lib.TO_VERIFIER: list(script),
                   proxy_lib.TO_WORKER: list(steps)}
    self._lost_on_answer = None

  def _maybe_fault(self, direction, frames):
    edit = self.script[direction].pop(0) if self.script[direction] else None
    self._send(direction, edit(list(frames)) if edit else frames)
    if getattr(edit, "lost", False):
      if direction == proxy_lib.TO_VERIFIER:
        self.lost(proxy_lib.message_tags(frames))
      else:
        self._lost_on_answer = proxy_lib.message_tags(frames)

  def _send(self, direction, frames):
    super()._send(direction, frames)
    if direction == proxy_lib.TO_VERIFIER and self._lost_on_answer:
      tags, self._lost_on_answer = self._lost_on_answer, None
      self.lost(tags)


def _lost(edit):
  edit.lost = True
  return edit


def _swap(i, j):
  def edit(frames):
    frames[i], frames[j] = frames[j], frames[i]
    return frames
  return edit


def _flip(i, byte):
  @_lost
  def edit(frames):
    frame = bytearray(frames[i])
    frame[byte] ^= 1
    frames[i] = bytes(frame)
    return frames
  return edit


def _without(first, stop):
  return _lost(lambda frames: frames[:first] + frames[stop:])


def _scripted_rounds(script, rounds, before=None, steps=(),
                     representation=Representation.SPARSE):
  """Rounds of requests 0 and 1 through a `_Scripted` proxy: results and
  the verifier's and the worker's counters. before(verifier, i) runs
  before round i."""
  worker = _ThreadWorker(representation)
  proxy = _Scripted("tcp://127.0.0.1:0", worker.address, script=script,
                    steps=steps,
                    on_lost=lambda tags: verifier.expire(tags)).start()
  verifier = bridge_harness.ExpiringVerifier(
      _caps(representation, PER_FRAME), proxy.address, target_fn=_target_fn,
      timeout_s=DEADLINE_S, secret=SECRET,
      clock=time.monotonic).open()
  _warm_verifier(verifier.caps, dj.verify_batch)
  results = []
  try:
    for rid in (0, 1):
      verifier.add_request(rid, [rid], seed=rid)
    for i in range(rounds):
      if before:
        before(verifier, i)
      results.append(verifier.round([0, 1], DEPTH))
  finally:
    proxy.stop()
    verifier.close()
    worker_counters = worker.stop()
  return results, verifier.counters.snapshot(), worker_counters


def _require(condition, what):
  # A scenario that did not set up as planned is an error (RuntimeError),
  # told apart from a failure of the property checked (AssertionError).
  if not condition:
    raise RuntimeError(f"precondition: {what}")


# Reply frames of a batch of requests 0 and 1: request 0's REPLY is frame 0,
# its COMPLETION 1; request 1's REPLY 2, COMPLETION 3.


def test_step_of_a_foreign_session_is_answered_by_reset():
  # The soak's corrupt STEPs rarely hit the session bytes (16-23) of the
  # first frame: this path, scripted. Round 2's STEP claims another
  # session: the worker answers RESET(UNKNOWN_SESSION) for that session,
  # which is not the verifier's (counted there, dropped): the batch times
  # out, and round 3 is verified in the same session (no new HELLO).
  results, v, w = _scripted_rounds([], 3, steps=[None, _flip(0, 16)])
  assert [r.code for r in results[0] + results[2]] == [None] * 4
  assert [r.code for r in results[1]] == [Code.TIMEOUT] * 2
  assert v["errors"] == {"UNKNOWN_SESSION": 1, "TIMEOUT": 2}, v
  assert v["events"]["hellos"] == 1 and w["events"]["hellos"] == 1
  assert w["errors"] == {"UNKNOWN_SESSION": 1}, w
  assert w["events"]["commits_unserved"] == 2


def test_a_reply_that_fails_authentication_changes_nothing():
  # Round 2: one bit of request 0's REPLY flipped (rows, then header): the
  # message cannot be authenticated, so it is dropped and counted, and the
  # batch times out: no request is failed for what unauthenticated bytes
  # claim. Dense and sparse.
  for representation in (Representation.SPARSE, Representation.DENSE):
    results, counters, _ = _scripted_rounds(
        [None, _flip(0, 70), _flip(0, 26)], 4,
        representation=representation)
    assert [r.code for r in results[1] + results[2]] == [Code.TIMEOUT] * 4
    assert not any(r.fallback for r in results[0] + results[3])
    assert counters["errors"] == {"AUTH_FAILED": 2, "TIMEOUT": 4}, counters


def test_swapped_answers_fail_both_requests():
  # Round 2: request 1's REPLY before request 0's: each COMPLETION follows
  # another request's rows.
  results, counters, _ = _scripted_rounds([None, _swap(0, 2)], 3)
  assert [r.code for r in results[1]] == [Code.BAD_SEQUENCE] * 2
  assert not any(r.fallback for r in results[0] + results[2])
  assert counters["errors"] == {"BAD_SEQUENCE": 2}, counters


def test_a_reply_one_frame_short_fails_only_its_request():
  # The soak's truncation that cuts a whole frame, scripted (the long soak
  # met one at its 6,916th exchange). Round 2: request 1's REPLY is gone;
  # the message is authentic, so request 0 is verified and request 1's
  # COMPLETION, which names rows that never came, fails it.
  results, counters, _ = _scripted_rounds(
      [None, lambda frames: frames[:2] + frames[3:]], 3)
  assert [r.code for r in results[1]] == [None, Code.BAD_SEQUENCE]
  assert not any(r.fallback for r in results[0] + results[2])
  assert counters["errors"] == {"BAD_SEQUENCE": 1}, counters


def test_round_after_verifier_reset_is_served():
  # A regression test: before 845ff8d Worker._reset kept the old round, so
  # the first STEP of the new generation was refused (DUPLICATE_ROUND) and
  # the whole batch timed out.
  def reset_1(verifier, i):
    if i == 1:
      verifier.reset(1)
  results, _, _ = _scripted_rounds([], 3, before=reset_1)
  _require(not any(r.fallback for r in results[0]), results[0])
  assert not any(r.fallback for r in results[1] + results[2]), results


def test_every_timeout_fallback_is_counted():
  # A regression test: a batch that times out falls back whole; TIMEOUT was
  # counted only for the requests never answered.
  # Round 2: request 1's REPLY and COMPLETION never arrive.
  results, counters, _ = _scripted_rounds([None, _without(2, 4)], 2)
  _require([r.code for r in results[1]] == [Code.TIMEOUT] * 2, results[1])
  assert counters["errors"] == {"TIMEOUT": 2}, counters


def test_no_resync_without_faults_when_a_digest_ends_in_nul():
  # A regression test: before 845ff8d the worker read the STEP's 32-byte
  # digest through numpy's S32, which drops trailing NUL bytes, and
  # resynced twice per such digest (about 1 STEP in 256).
  prompt = next(list(p) for p in itertools.product(range(V), repeat=3)
                if digest_lib.of(list(p)).endswith(b"\0"))
  caps = _caps(Representation.SPARSE)
  worker = _ThreadWorker(Representation.SPARSE)
  verifier = bridge.Verifier(caps, worker.address, target_fn=_target_fn,
                             timeout_s=DEADLINE_S, secret=SECRET).open()
  try:
    verifier.add_request(0, prompt, seed=0)
    for _ in range(3):
      verifier.round([0], DEPTH)
  finally:
    verifier.close()
    counters = worker.stop()
  assert counters["events"].get("resyncs", 0) == 0, counters


if __name__ == "__main__":
  worker_main(sys.argv[1])
