"""Atheris fuzz target: arbitrary frame SEQUENCES into both protocol sessions.

Each input drives one `WorkerSession` and one `VerifierSession` (sans I/O,
fixed secret, deterministic nonces, a fake proposer: no JAX), connected
after a real HELLO, through a sequence of operations decoded from the
input (atheris.FuzzedDataProvider):

  rounds          the verifier begins a round; the worker answers it; the
                  answer is delivered intact, mutated (bytes flipped,
                  inserted, cut; then maybe resealed with the right key so
                  the mutation gets past authentication), duplicated,
                  dropped or delayed; the verifier polls a fuzzed clock,
                  validates what it stages (numpy kernels) and commits
  forged frames   arbitrary bytes, framed (length fixed) and sealed with
                  the session or hello key of either direction or none,
                  alone or several in one message, into either session
  replays         earlier messages (any direction, any session) again
  local calls     reset, remove, re-add and reconnect, as a driver would

Any exception out of a session is a crash, and so is a broken invariant:
committed tokens change only through commits, tags only grow, at most
`max_views` worker views, a Stage only with framed rows, counters bounded
by what was fed. Every refusal must be counted (no silent drop of an
authenticated frame of the current exchange is checked by the round
outcome: every round ends verified or with a code).

    python tests/fuzz_sessions.py /tmp/corpus -max_len=4096

`run_fuzz` runs a fixed-seed, fixed-count campaign in a subprocess
(tests/system/test_fuzz_sessions.py runs 200,000 executions in CI).
"""

import collections
import contextlib
import logging
import pathlib
import shlex
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script: `tests` is not importable
  sys.path.insert(0, str(_ROOT))

import numpy as np  # pylint: disable=g-import-not-at-top

from tests import fuzz_run  # pylint: disable=g-import-not-at-top

# Coverage only for the protocol modules (see tests/fuzz_wire.py).
import dyadic_jax  # pylint: disable=g-import-not-at-top,unused-import
import dyadic_jax.qrows  # pylint: disable=g-import-not-at-top,unused-import

if __name__ == "__main__":
  import atheris  # pylint: disable=g-import-not-at-top
  assert "dyadic_jax.bridge" not in sys.modules
  # Coverage of the two sessions and the codec they call; the rest of
  # the package runs uninstrumented (tracing every line costs several
  # times the execution, and the row validators compare numpy rows, which
  # atheris 3.0 would leak).
  _TRACED = ("dyadic_jax.bridge.worker_session",
             "dyadic_jax.bridge.verifier_session", "dyadic_jax.wire.codec")
  _instrumented = atheris.instrument_imports(
      include=["dyadic_jax.bridge", "dyadic_jax.wire"], exclude=[
          f"dyadic_jax.{p}.{m}" for p, ms in (
              ("bridge", ("counters", "effects", "hello", "proposer",
                          "audit", "transport", "verifier", "digest",
                          "staging", "worker", "keys", "ranks")),
              ("wire", ("errors", "validate", "status", "qformats",
                        "qformats.base", "qformats.dense", "qformats.sparse",
                        "qformats.token", "layouts", "auth"))) for m in ms])
else:
  _instrumented = contextlib.nullcontext()

with _instrumented:
  # pylint: disable=g-import-not-at-top
  from dyadic_jax.bridge import hello
  from dyadic_jax.bridge.counters import Counters
  from dyadic_jax.bridge.effects import Stage, Verify
  from dyadic_jax.bridge.verifier_session import VerifierSession
  from dyadic_jax.bridge.worker_session import WorkerSession
  from dyadic_jax.wire import auth, layouts
  from dyadic_jax.wire.layouts import Mode, Representation

# Refusals are counted; their log lines would only slow the fuzzer down.
logging.getLogger("absl").setLevel(logging.ERROR)

SECRET = bytes(range(32))
M = 1 << 24
V, DEPTH, REQUESTS, K = 16, 3, 2, 4
CAPS = {
    "sparse": hello.Capabilities(vocab=V, max_depth=DEPTH,
                                 max_requests=REQUESTS, max_slots=2,
                                 representation=Representation.SPARSE,
                                 max_support=K),
    "dense": hello.Capabilities(vocab=V, max_depth=DEPTH,
                                max_requests=REQUESTS, max_slots=2,
                                representation=Representation.DENSE),
    "greedy": hello.Capabilities(mode=Mode.GREEDY, vocab=V,
                                 max_depth=DEPTH, max_requests=REQUESTS),
}
MAX_OPS = 6
_U64 = (1 << 64) - 1


class Entropy:
  """Deterministic 'random' bytes (a counter), for reproducible runs."""

  def __init__(self, seed):
    self.n = seed

  def __call__(self, size):
    self.n += 1
    return (self.n.to_bytes(8, "little") * (size // 8 + 1))[:size]


def fake_propose(caps, fdp, p):
  """Fills a Propose's rows: a valid dyadic draw, or fuzzed bytes."""
  rows = p.rows
  if fdp.ConsumeBool():           # valid rows, tokens drawn from them
    for i in range(p.depth):
      if rows.values is None:
        rows.tokens[i] = fdp.ConsumeIntInRange(0, V - 1)
        rows.n[i] = 0
        continue
      w = rows.values.shape[1]
      rows.values[i] = 0
      rows.values[i, 0] = 0.5
      rows.values[i, 1] = 0.5
      rows.n[i] = w
      if rows.ids is not None:
        rows.ids[i] = np.arange(w)
      rows.tokens[i] = fdp.ConsumeIntInRange(0, 1)
  else:
    raw = fdp.ConsumeBytes(rows.tokens.nbytes + rows.n.nbytes)
    raw = raw.ljust(rows.tokens.nbytes + rows.n.nbytes, b"\0")
    rows.tokens[:] = np.frombuffer(raw[:rows.tokens.nbytes], "<i4")
    rows.n[:] = np.frombuffer(raw[rows.tokens.nbytes:], "<i4")
    for a in (rows.ids, rows.values):
      if a is not None:
        raw = fdp.ConsumeBytes(a.nbytes).ljust(a.nbytes, b"\0")
        a.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, np.uint8)


def _forge(fdp, pair):
  """Arbitrary frames: fuzz bytes, framed, sealed with some key or none."""
  frames = []
  for _ in range(fdp.ConsumeIntInRange(1, 3)):
    kind = fdp.ConsumeIntInRange(0, 7)
    size = fdp.ConsumeIntInRange(0, 400)
    body = fdp.ConsumeBytes(size)
    fixed = layouts.FIXED_BYTES.get(kind)
    if fixed is not None and fdp.ConsumeBool():
      body = body.ljust(fixed - layouts.HEADER_BYTES, b"\0")[
          :fixed - layouts.HEADER_BYTES]
    buf = bytearray(layouts.HEADER_BYTES) + bytearray(body)
    layouts.HEADER_STRUCT.pack_into(
        buf, 0, layouts.MAGIC if fdp.ConsumeIntInRange(0, 9) else b"XQ24",
        layouts.WIRE_VERSION if fdp.ConsumeIntInRange(0, 9) else 2, kind,
        len(buf), 0,
        pair.session_id() if fdp.ConsumeBool() else fdp.ConsumeIntInRange(
            0, _U64),
        fdp.ConsumeIntInRange(0, 3) if fdp.ConsumeBool() else
        fdp.ConsumeIntInRange(0, (1 << 32) - 1),
        fdp.ConsumeIntInRange(0, 3) if fdp.ConsumeBool() else
        fdp.ConsumeIntInRange(0, (1 << 32) - 1), bytes(16))
    tagger = pair.tagger(fdp.ConsumeIntInRange(0, 5))
    if tagger is not None:
      auth.seal(buf, tagger)
    frames.append(bytes(buf))
  return b"".join(frames)


def _mutate(fdp, message, pair, to_verifier):
  """Bytes flipped, inserted or cut; maybe each frame resealed."""
  buf = bytearray(message)
  for _ in range(fdp.ConsumeIntInRange(0, 3)):
    if not buf:
      break
    op = fdp.ConsumeIntInRange(0, 3)
    at = fdp.ConsumeIntInRange(0, len(buf) - 1)
    if op == 0:
      buf[at] ^= 1 << fdp.ConsumeIntInRange(0, 7)
    elif op == 1:
      buf[at:at] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
    elif op == 2:
      del buf[at:]
    else:
      buf[at:at + 4] = fdp.ConsumeIntInRange(0, (1 << 32) - 1).to_bytes(
          4, "little")
  if fdp.ConsumeBool():       # reseal every frame that still parses
    keys = pair.link_keys()
    if keys is not None:
      tagger = keys[1] if to_verifier else keys[0]
      offset = 0
      while offset + layouts.HEADER_BYTES <= len(buf):
        length = int.from_bytes(buf[offset + 8:offset + 12], "little")
        if length < layouts.HEADER_BYTES or offset + length > len(buf):
          break
        view = memoryview(buf)[offset:offset + length]
        auth.seal(view, tagger)
        view.release()
        offset += length
  return bytes(buf)


def _template(name):
  """A worker and a verifier session after a real HELLO (built once)."""
  caps = CAPS[name]
  worker = WorkerSession(caps, secret=SECRET, entropy=Entropy(1),
                         max_views=4, counters=Counters(log=False))
  verifier = VerifierSession(caps, secret=SECRET, timeout_s=1.0,
                             entropy=Entropy(2),
                             counters=Counters(log=False))
  for send in worker.finish(worker.receive(verifier.hello().message)):
    verifier.receive(bytes(send.message))
  assert verifier.is_open
  return dict(vars(worker)), dict(vars(verifier))


_TEMPLATES = {}


def _fresh(cls, template, **fresh):
  obj = object.__new__(cls)
  vars(obj).update(template)
  vars(obj).update(fresh)
  return obj


class Pair:
  """A worker session and a verifier session, and what they said.

  Each input starts from the same freshly opened session (a copy of a
  template's state: no HELLO, no allocation per input).
  """

  def __init__(self, name):
    if name not in _TEMPLATES:
      _TEMPLATES[name] = _template(name)
    w, v = _TEMPLATES[name]
    self.caps = CAPS[name]
    self.worker = _fresh(
        WorkerSession, w, views=collections.OrderedDict(), pending=None,
        counters=Counters(log=False), _epoch=list(w["_epoch"]),
        _busy=[False] * len(w["_busy"]), _entropy=Entropy(3))
    self.verifier = _fresh(
        VerifierSession, v, requests={}, _retired={}, exchange=None,
        counters=Counters(log=False), _entropy=Entropy(4))
    self.now = 0.0
    self.sent = []            # every message either side sent (replays)
    self.tags = {}            # rid -> last (generation, round) committed

  def session_id(self):
    return self.verifier.session or 0

  def link_keys(self):
    keys = self.verifier.keys
    return None if keys is None else (keys.send, keys.recv)

  def tagger(self, which):
    keys = self.verifier.keys
    options = [None, _HELLO.send, _HELLO.recv,
               None if keys is None else keys.send,
               None if keys is None else keys.recv, _CRC]
    return options[which]

  def to_worker(self, message, fdp):
    answer = self.worker.receive(message, self.now)
    for p in answer.propose:
      fake_propose(self.caps, fdp, p)
    failed = {p.entry: 31 for p in answer.propose if fdp.ConsumeIntInRange(
        0, 15) == 0}
    out = []
    for send in self.worker.finish(answer, failed):
      data = bytes(send.message)
      if send.slot is not None:
        self.worker.released(send.slot)
      out.append(data)
      self.sent.append(data)
    return out

  def to_verifier(self, message, fdp):
    effects = self.verifier.receive(message, self.now)
    self.effects(effects, fdp)

  def effects(self, effects, fdp):
    for effect in effects:
      if isinstance(effect, Stage):
        assert self.verifier.exchange is not None
        assert effect.pending.any()
        verdict = self.caps.format.validate(
            effect.rows, vocab=V, draws=None if not fdp.ConsumeBool() else
            np.zeros(effect.rows.tokens.shape, np.uint32))
        effect = self.verifier.staged(verdict)
      assert isinstance(effect, Verify)
      plan = effect.plan
      outcomes = []
      for i in range(len(plan.rids)):
        accepted = 0 if plan.codes[i] else fdp.ConsumeIntInRange(
            0, plan.draft.shape[1])
        outcomes.append((accepted, fdp.ConsumeIntInRange(0, V - 1)))
      before = {int(r): list(self.verifier.requests[int(r)].tokens)
                for r in plan.rids}
      results, send = self.verifier.commit(plan, outcomes)
      for res in results:
        tokens = self.verifier.requests[res.rid].tokens
        assert tokens == before[res.rid] + list(res.committed)
        assert (res.generation, res.round) > self.tags.get(res.rid, (-1, -1))
        self.tags[res.rid] = (res.generation, res.round)
      if send is not None:
        self.sent.append(bytes(send.message))
        if fdp.ConsumeBool():
          self.to_worker(bytes(send.message), fdp)

  def open(self, fdp):
    for _ in range(2):
      hello_message = bytes(self.verifier.hello(self.now).message)
      self.sent.append(hello_message)
      for answer in self.to_worker(hello_message, fdp):
        self.verifier.receive(answer, self.now)
      if self.verifier.is_open:
        return


_HELLO = auth.hello_keys(SECRET, auth.VERIFIER)
_CRC = auth.Crc32cTag()


def _round(pair, fdp):
  v = pair.verifier
  if not v.is_open:
    pair.open(fdp)
    if not v.is_open:
      return
  rids = sorted(v.requests)[:REQUESTS]
  if not rids:
    return
  if len(rids) > 1 and fdp.ConsumeBool():
    rids = rids[:1]
  depth = fdp.ConsumeIntInRange(1, DEPTH)
  step = bytes(v.begin(rids, depth, pair.now).message)
  pair.sent.append(step)
  if fdp.ConsumeIntInRange(0, 3):
    step = step if fdp.ConsumeBool() else _mutate(fdp, step, pair, False)
    answers = pair.to_worker(step, fdp)
  else:
    answers = []
  for answer in answers:
    fate = fdp.ConsumeIntInRange(0, 5)
    if fate == 0:
      continue                                    # dropped
    message = answer if fate > 2 else _mutate(fdp, answer, pair, True)
    for _ in range(2 if fate == 5 else 1):        # maybe duplicated
      if v.exchange is None:
        break
      pair.to_verifier(message, fdp)
  while v.exchange is not None:   # time moves: the deadline comes
    pair.now += 0.5 + fdp.ConsumeIntInRange(0, 1) * 0.5
    pair.effects(v.poll(pair.now), fdp)
    if fdp.ConsumeIntInRange(0, 7) == 0 and v.exchange is not None:
      pair.to_verifier(_forge(fdp, pair), fdp)


def run_ops(data):
  """Runs one input's operation sequence; raises on a crash."""
  import atheris  # pylint: disable=g-import-not-at-top
  fdp = atheris.FuzzedDataProvider(data)
  pair = Pair(fdp.PickValueInList(sorted(CAPS)))
  v, w = pair.verifier, pair.worker
  for rid in range(3):
    v.add_request(rid, [rid + 1], seed=rid)
  for _ in range(fdp.ConsumeIntInRange(1, MAX_OPS)):
    op = fdp.ConsumeIntInRange(0, 9)
    if op <= 1:
      _round(pair, fdp)
    elif op == 4:
      pair.to_worker(_forge(fdp, pair), fdp)
    elif op == 5:
      pair.to_verifier(_forge(fdp, pair), fdp)
    elif op in (2, 3):
      pair.to_worker(_forge(fdp, pair), fdp)
    elif op == 6 and pair.sent:
      message = pair.sent[fdp.ConsumeIntInRange(0, len(pair.sent) - 1)]
      if fdp.ConsumeBool():
        pair.to_worker(message, fdp)
      else:
        pair.to_verifier(message, fdp)
    elif op == 7:
      rid = fdp.ConsumeIntInRange(0, 3)
      send = None
      if rid in v.requests and fdp.ConsumeBool():
        send = v.remove_request(rid)
      elif rid not in v.requests:
        v.add_request(rid, [rid], seed=rid)
      elif v.exchange is None:
        send = v.reset(rid)
      if send is not None:
        pair.sent.append(bytes(send.message))
        pair.to_worker(bytes(send.message), fdp)
    elif op == 8 and v.exchange is None:
      v.reconnect()
      pair.open(fdp)
    elif op == 9:
      pair.now += 10.0
      pair.effects(v.poll(pair.now), fdp)
    assert len(w.views) <= w.max_views
    for rid, req in v.requests.items():
      assert 0 <= req.generation < 1 << 32 and 0 <= req.round < 1 << 32


def TestOneInput(data):  # pylint: disable=invalid-name
  run_ops(data)


def run_fuzz(corpus_dirs=(), *, runs=200_000, seed=1, artifact_dir=None,
             extra_args=(), timeout=None):
  """A fixed-seed, fixed-count campaign of this target (tests/fuzz_run.py)."""
  return fuzz_run.run(__file__, corpus_dirs, runs=runs, seed=seed,
                      max_len=4096, artifact_dir=artifact_dir,
                      extra_args=extra_args, timeout=timeout)


if __name__ == "__main__":
  _argv0 = " ".join(shlex.quote(a) for a in (sys.executable, __file__))
  atheris.Setup([_argv0, *sys.argv[1:]], TestOneInput)
  atheris.Fuzz()
