"""Atheris fuzz target: arbitrary frame SEQUENCES into both protocol sessions.

Each input drives one `WorkerSession` and one `VerifierSession` (sans I/O,
a sparse, dense or greedy session answering with PACKED frames, or a
sparse or dense one with per-frame REPLY + COMPLETION answers; the
sparse, greedy and per-frame dense ones agree on CONTEXT frames, with a
small context budget; the dense and per-frame sparse ones on
ADAPTIVE_DEPTH, the fake proposer giving each proposal a fuzzed length,
0 and depth + 1 included;
`dyadic_jax.testing.session_pair`: fixed secret, deterministic nonces, a
fake proposer: no JAX), the verifier's session opened by a real HELLO and
the worker then restarted (see `Pair`), through a sequence of operations
decoded from the input (atheris.FuzzedDataProvider):

  rounds          the verifier begins a round, or two in flight (the
                  second before the first is answered); the worker
                  answers each; they are delivered in either order,
                  each intact, mutated (bytes flipped,
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
`max_views` worker views, a Stage only with framed rows, a plan's
lengths in [1, D] (all D without ADAPTIVE_DEPTH), counters bounded
by what was fed, a proposal's context (when handed one) of the STEP's
length and last token, the worker's contexts within their budget. Every refusal must be counted (no silent drop of an
authenticated frame of the current exchange is checked by the round
outcome: every round ends verified or with a code).

    python tests/fuzz_sessions.py /tmp/corpus -max_len=4096

`run_fuzz` runs a fixed-seed, fixed-count campaign in a subprocess
(tests/system/test_fuzz_sessions.py: the saved corpus and a bounded run by
default, the 200,000-execution campaign under --runslow).
"""

import contextlib
import dataclasses
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
  from dyadic_jax.bridge.effects import Stage, Verify
  from dyadic_jax.testing import session_pair
  from dyadic_jax.wire import auth, layouts
  from dyadic_jax.wire.layouts import Feature, Mode, Representation

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
# The sessions above agree on PACKED replies and PACKED_STEP frames (the
# default); these speak the per-frame v3 form (a STEP frame, a REPLY and a
# COMPLETION per request).
CAPS.update({f"{name}.frames": dataclasses.replace(CAPS[name], features=0)
             for name in ("dense", "sparse")})
# Sessions whose worker wants CONTEXT frames: each form (packed, per
# frame) with and without them, with the same input bytes as before.
CONTEXT_NAMES = frozenset({"sparse", "greedy", "dense.frames"})
# Sessions that agree on ADAPTIVE_DEPTH (short answers), one per form,
# with the same input bytes as before.
ADAPTIVE_NAMES = frozenset({"dense", "sparse.frames"})
CAPS.update({name: dataclasses.replace(
    CAPS[name], features=CAPS[name].features | Feature.ADAPTIVE_DEPTH)
             for name in ADAPTIVE_NAMES})
CONTEXT_BUDGET = 16
MAX_OPS = 6
_U64 = (1 << 64) - 1


def fake_propose(fdp, p):
  """Fills a Propose's rows: a valid dyadic draw, or fuzzed bytes."""
  if p.context is not None:    # the worker hands only the STEP's prefix
    assert len(p.context) == p.anchor and p.context[-1] == p.last_token
    assert not p.context.flags.writeable
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


def _proposer(fdp):
  """The pair's proposer: rows drawn from the input, then some proposals
  failed (PROPOSER_FAILED, as the worker driver reports a raising one);
  on an ADAPTIVE_DEPTH session each with a fuzzed length in [0, depth +
  1] (those outside [1, depth] the worker must refuse itself)."""
  def draw(proposals):
    lengths = {}
    for p in proposals:
      fake_propose(fdp, p)
      if p.adaptive:
        lengths[p.entry] = fdp.ConsumeIntInRange(0, p.depth + 1)
    failed = {p.entry: 31 for p in proposals
              if fdp.ConsumeIntInRange(0, 15) == 0}
    return failed, lengths
  return draw


def _forge(fdp, pair):
  """Arbitrary frames: fuzz bytes, framed, sealed with some key or none."""
  frames = []
  for _ in range(fdp.ConsumeIntInRange(1, 3)):
    kind = fdp.ConsumeIntInRange(0, 8)
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
        (pair.verifier.session or 0) if fdp.ConsumeBool() else
        fdp.ConsumeIntInRange(0, _U64),
        fdp.ConsumeIntInRange(0, 3) if fdp.ConsumeBool() else
        fdp.ConsumeIntInRange(0, (1 << 32) - 1),
        fdp.ConsumeIntInRange(0, 3) if fdp.ConsumeBool() else
        fdp.ConsumeIntInRange(0, (1 << 32) - 1), bytes(16))
    tagger = pair.tagger(session_pair.TAGGERS[fdp.ConsumeIntInRange(0, 5)])
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
    tagger = pair.tagger("session_to_verifier" if to_verifier
                         else "session_to_worker")
    if tagger is not None:
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


_ANSWERS = {}


def _hello_answer(name):
  """A worker's answer to the HELLO that opens every input's verifier:
  the same bytes each time (nonces are counters), so made once."""
  if name not in _ANSWERS:
    pair = session_pair.SessionPair(
        CAPS[name], secret=SECRET, proposer=None,
        worker_entropy=session_pair.CountingEntropy(1),
        verifier_entropy=session_pair.CountingEntropy(2),
        wants_context=name in CONTEXT_NAMES,
        wants_adaptive=name in ADAPTIVE_NAMES)
    (_ANSWERS[name],) = pair.to_worker(pair.hello())
  return _ANSWERS[name]


class Pair(session_pair.SessionPair):
  """One input's two sessions (dyadic_jax.testing.session_pair), driven by
  the input, and the invariants checked on what they do.

  Every input starts from the same state, built anew through the sessions'
  public methods: the verifier's session open (its HELLO answered by the
  recorded `_hello_answer`), and a fresh worker that never saw that HELLO
  (as after a worker restart: the first round meets UNKNOWN_SESSION and
  the verifier opens another session). Session ids and nonces are
  counters, so no input's run depends on another's: a crash file
  reproduces on its own.
  """

  def __init__(self, name, fdp):
    super().__init__(CAPS[name], secret=SECRET, proposer=_proposer(fdp),
                     timeout_s=1.0, max_views=4,
                     worker_entropy=session_pair.CountingEntropy(3),
                     verifier_entropy=session_pair.CountingEntropy(2),
                     wants_context=name in CONTEXT_NAMES,
                     context_budget=CONTEXT_BUDGET,
                     wants_adaptive=name in ADAPTIVE_NAMES)
    self.fdp = fdp
    self.hello()
    self.to_verifier(_hello_answer(name))
    assert self.verifier.is_open
    self.sent.clear()         # replays are of what the input made happen
    self.tags = {}            # rid -> last (generation, round) committed

  def deliver(self, message):
    """`message` to the verifier; what it asks for is done."""
    self.effects(self.to_verifier(message))

  def effects(self, effects):
    fdp = self.fdp
    for effect in effects:
      if isinstance(effect, Stage):
        assert effect.key in self.verifier.exchanges
        assert effect.pending.any()
        effect = self.validate(effect, None if not fdp.ConsumeBool() else
                               np.zeros(effect.rows.tokens.shape, np.uint32))
      assert isinstance(effect, Verify)
      plan = effect.plan
      assert np.all((plan.lengths >= 1)
                    & (plan.lengths <= plan.rows.tokens.shape[1]))
      if not self.verifier.adaptive:
        assert np.all(plan.lengths == plan.rows.tokens.shape[1])
      outcomes = []
      for i in range(len(plan.rids)):
        accepted = 0 if plan.codes[i] else fdp.ConsumeIntInRange(
            0, int(plan.lengths[i]))
        outcomes.append((accepted, fdp.ConsumeIntInRange(0, V - 1)))
      before = {int(r): list(self.verifier.requests[int(r)].tokens)
                for r in plan.rids}
      results, commit = self.commit(plan, outcomes)
      for res in results:
        tokens = self.verifier.requests[res.rid].tokens
        assert tokens == before[res.rid] + list(res.committed)
        assert (res.generation, res.round) > self.tags.get(res.rid, (-1, -1))
        self.tags[res.rid] = (res.generation, res.round)
      if commit is not None and fdp.ConsumeBool():
        self.to_worker(commit)


def _round(pair, fdp):
  """One round, or two in flight at once (disjoint groups of requests:
  the second begun before the first's answer is delivered), their
  answers delivered in a fuzzed order and fate."""
  v = pair.verifier
  if not v.is_open:
    pair.open(attempts=2)
    if not v.is_open:
      return
  rids = sorted(v.requests)[:REQUESTS]
  if not rids:
    return
  if len(rids) > 1 and fdp.ConsumeBool():
    rids = rids[:1]
  groups = [rids]
  if len(rids) > 1 and fdp.ConsumeBool():
    groups = [rids[:1], rids[1:]]
  inbox = []
  for group in groups:
    depth = fdp.ConsumeIntInRange(1, DEPTH)
    step = pair.begin(group, depth)
    if fdp.ConsumeIntInRange(0, 3):
      step = step if fdp.ConsumeBool() else _mutate(fdp, step, pair, False)
      inbox += pair.to_worker(step)
  if len(inbox) > 1 and fdp.ConsumeBool():
    inbox.reverse()                               # the later round first
  for answer in inbox:
    fate = fdp.ConsumeIntInRange(0, 5)
    if fate == 0:
      continue                                    # dropped
    message = answer if fate > 2 else _mutate(fdp, answer, pair, True)
    for _ in range(2 if fate == 5 else 1):        # maybe duplicated
      if not v.exchanges:
        break
      pair.deliver(message)
  while v.exchanges:   # time moves: the deadlines come
    pair.now += 0.5 + fdp.ConsumeIntInRange(0, 1) * 0.5
    pair.effects(pair.poll())
    if fdp.ConsumeIntInRange(0, 7) == 0 and v.exchanges:
      pair.deliver(_forge(fdp, pair))


def run_ops(data):
  """Runs one input's operation sequence; raises on a crash."""
  import atheris  # pylint: disable=g-import-not-at-top
  fdp = atheris.FuzzedDataProvider(data)
  pair = Pair(fdp.PickValueInList(sorted(CAPS)), fdp)
  v, w = pair.verifier, pair.worker
  for rid in range(3):
    v.add_request(rid, [rid + 1], seed=rid)
  for _ in range(fdp.ConsumeIntInRange(1, MAX_OPS)):
    op = fdp.ConsumeIntInRange(0, 9)
    if op <= 1:
      _round(pair, fdp)
    elif op in (2, 3, 4):
      pair.to_worker(_forge(fdp, pair))
    elif op == 5:
      pair.deliver(_forge(fdp, pair))
    elif op == 6 and pair.sent:
      message = pair.sent[fdp.ConsumeIntInRange(0, len(pair.sent) - 1)]
      if fdp.ConsumeBool():
        pair.to_worker(message)
      else:
        pair.deliver(message)
    elif op == 7:
      rid = fdp.ConsumeIntInRange(0, 3)
      reset = None
      if rid in v.requests and fdp.ConsumeBool():
        reset = pair.remove(rid)
      elif rid not in v.requests:
        v.add_request(rid, [rid], seed=rid)
      elif not v.exchanges:
        reset = pair.reset(rid)
      if reset is not None:
        pair.to_worker(reset)
    elif op == 8 and not v.exchanges:
      v.reconnect()
      pair.open(attempts=2)
    elif op == 9:
      pair.now += 10.0
      pair.effects(pair.poll())
    assert len(w.views) <= w.max_views
    held = sum(view.context.n for view in w.views.values()
               if view.context is not None)
    assert w.context_tokens == held <= w.context_budget
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
