"""A WorkerSession and a VerifierSession wired to each other in memory.

The protocol's two sans-I/O state machines (`dyadic_jax.bridge`) with no
socket, thread or clock between them: the caller is the network. Every
method that makes a session speak returns the messages, and the caller
decides what reaches the other side (delivered, dropped, duplicated, held
back, edited, forged); the clock is `now`, moved by the caller (or past the
deadline by `outcome`, when nothing is left to deliver). Only the
sessions' public methods are used, so what passes here passes a driver.

    pair = SessionPair(caps, secret=secret, proposer=draw)
    assert pair.open()                          # a real HELLO
    pair.verifier.add_request(0, [1], seed=7)
    plan = pair.run_round([0], depth=3)         # STEP, answer, validated
    results, commit = pair.commit(plan, [(1, 5)])
    pair.to_worker(commit)                      # the worker's view moves

A round with faults is the same steps apart: `begin` (the STEP),
`to_worker` (the answer's messages), the caller's edits, then `outcome`
(the verifier reads them until the round ends) or `to_verifier`, `poll`
and `validate` one at a time.

The proposer stands in for the worker's model: `proposer(proposals)` gets
one fresh answer's `bridge.Propose`s, writes each one's rows (tokens, n,
ids, values) and returns {Propose.entry: Code} of those it could not draw
(or None), as `WorkerSession.finish` takes them; or a pair (that, and
{Propose.entry: d} of those it drew d < depth rows of: `finish`'s
`lengths`, on a session that agreed on ADAPTIVE_DEPTH).

Used by the sessions fuzz target (tests/fuzz_sessions.py), the protocol
state machine (tests/bridge/test_state_machine.py) and
experiments/bench_bridge.py (with record=False: no copies).
"""

import collections
import os
import typing

from dyadic_jax.bridge import hello
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Plan, Propose, Stage, Verify
from dyadic_jax.bridge.verifier_session import RoundResult, VerifierSession
from dyadic_jax.bridge.worker_session import WorkerSession
from dyadic_jax.wire import auth

Failed = typing.Mapping[int, int] | None
Proposer = typing.Callable[[typing.Sequence[Propose]],
                           Failed | tuple[Failed, typing.Mapping[int, int]]]
# audit.proposal_draws's signature: (seeds, generations, rounds, anchors,
# depth) -> uint32[R, D].
DrawsFn = typing.Callable[..., typing.Any]
Entropy = typing.Callable[[int], bytes]

# The taggers a frame can be sealed with (`SessionPair.tagger`), in a fixed
# order (the fuzz target picks one by index).
TAGGERS = ("none", "hello_to_worker", "hello_to_verifier",
           "session_to_worker", "session_to_verifier", "crc32c")


class CountingEntropy:
  """Deterministic 'random' bytes: call n returns the counter n, repeated.

  For reproducible session ids and nonces (a fuzz input, a benchmark's
  byte-for-byte comparison); never for a deployment.
  """

  def __init__(self, seed: int):
    self.n = seed

  def __call__(self, size: int) -> bytes:
    self.n += 1
    return (self.n.to_bytes(8, "little") * (size // 8 + 1))[:size]


def proposal_draws(seeds: typing.Any, generations: typing.Any,
                   rounds: typing.Any, anchors: typing.Any,
                   depth: int) -> typing.Any:
  """`bridge.audit.proposal_draws` (JAX), imported on the first call."""
  from dyadic_jax.bridge import audit  # pylint: disable=g-import-not-at-top
  return audit.proposal_draws(seeds, generations, rounds, anchors, depth)


class SessionPair:
  """A worker session and a verifier session, and the messages between.

  Attributes:
    caps: the Capabilities both sides use.
    worker, verifier: the sessions (`restart_worker` replaces the worker).
    now: the time passed to the sessions; the caller moves it.
    sent: with record=True, every message the pair's sessions produced
      through it, in order (HELLOs, STEPs, answers, COMMITs, RESETs), as
      bytes: what a test replays.
    worker_received: with record=True, every message delivered to the
      worker (`to_worker`), as bytes.
  """

  def __init__(self, caps: hello.Capabilities, *, secret: bytes | None,
               proposer: Proposer | None = None, timeout_s: float = 2.0,
               max_views: int = 4096,
               worker_entropy: Entropy = os.urandom,
               verifier_entropy: Entropy = os.urandom,
               record: bool = True, wants_context: bool = False,
               context_budget: int = 1 << 22, wants_adaptive: bool = False):
    """Builds both sessions; nothing is sent (`open` does the HELLO).

    Args:
      caps: both sides' Capabilities.
      secret: the deployment secret (32 bytes), or None (`--insecure`).
      proposer: draws a fresh answer's proposals (see the module
        docstring); None for a pair that only shakes hands (a fresh
        proposal then raises).
      timeout_s: the verifier's exchange deadline.
      max_views: the worker's bound on request views.
      worker_entropy, verifier_entropy: n -> n random bytes (nonces,
        session ids); `CountingEntropy` for reproducible runs.
      record: keep every message (`sent`, `worker_received`) and return
        answers as bytes. False: nothing is kept and the worker's answers
        are views of its slot buffers, valid until it reuses that slot
        (`caps.max_slots` fresh answers later): no copy, for benchmarks.
      wants_context, context_budget: the worker's (CONTEXT frames).
      wants_adaptive: the worker's (ADAPTIVE_DEPTH: short answers).
    """
    self.caps = caps
    self.proposer = proposer
    self.record = record
    self.now = 0.0
    self.sent: list[bytes] = []
    self.worker_received: list[bytes] = []
    self._secret = secret
    self._max_views = max_views
    self._context = (bool(wants_context), int(context_budget))
    self._adaptive = bool(wants_adaptive)
    self._worker_entropy = worker_entropy
    self._hello_keys: auth.Keys | None = None
    self._crc = auth.Crc32cTag()
    self.worker = self._new_worker(worker_entropy)
    self.verifier = VerifierSession(
        caps, secret=secret, timeout_s=timeout_s, entropy=verifier_entropy,
        counters=Counters("verifier", log=False))

  def _new_worker(self, entropy):
    return WorkerSession(self.caps, secret=self._secret, entropy=entropy,
                         max_views=self._max_views,
                         counters=Counters("worker", log=False),
                         wants_context=self._context[0],
                         context_budget=self._context[1],
                         wants_adaptive=self._adaptive)

  def _sent(self, message):
    if self.record:
      message = bytes(message)
      self.sent.append(message)
    return message

  # -- the two sides -----------------------------------------------------------

  def to_worker(self, message: typing.Any) -> list[typing.Any]:
    """Delivers `message` to the worker, as its driver would.

    The worker receives it, the proposer draws any fresh proposals, the
    answer is finished (sealed), and its slot is released at once (the
    message has left). Returns the answer's messages, in order (none for a
    refused or ignored message).
    """
    if self.record:
      self.worker_received.append(bytes(message))
    answer = self.worker.receive(message, self.now)
    failed: typing.Any = None
    lengths: typing.Mapping[int, int] = {}
    if answer.propose:
      if self.proposer is None:
        raise RuntimeError("to_worker: a STEP to draw, and no proposer")
      failed = self.proposer(answer.propose)
      if isinstance(failed, tuple):
        failed, lengths = failed
    out = []
    for send in self.worker.finish(answer, dict(failed or {}),
                                   dict(lengths)):
      out.append(self._sent(send.message))
      if send.slot is not None:
        self.worker.released(send.slot)
    return out

  def to_verifier(self, message: typing.Any) -> list[Stage | Verify]:
    """Delivers `message` to the verifier: [], [Stage] or [Verify].

    A view of a worker's slot (what `to_worker` returns; the slot is
    already released) is copied first, as a link would: the verifier
    reads a PACKED answer's rows in place until its Verify.
    """
    if isinstance(message, memoryview):
      message = bytes(message)
    return self.verifier.receive(message, self.now)

  def poll(self) -> list[Stage | Verify]:
    """The verifier's watchdog at `now`: [] or [Verify] (timed out)."""
    return self.verifier.poll(self.now)

  # -- the session -------------------------------------------------------------

  def hello(self) -> typing.Any:
    """The verifier's HELLO (a new session unless one is opening)."""
    return self._sent(self.verifier.hello(self.now).message)

  def open(self, attempts: int = 3, duplicate_answers: bool = False) -> bool:
    """HELLO to the worker, its answers back, up to `attempts` times.

    duplicate_answers: deliver each answer twice (a retried read).
    Returns whether the verifier's session is open.
    """
    for _ in range(attempts):
      for answer in self.to_worker(self.hello()):
        for _ in range(2 if duplicate_answers else 1):
          self.verifier.receive(answer, self.now)
      if self.verifier.is_open:
        return True
    return False

  def restart_worker(self, entropy: Entropy | None = None) -> None:
    """A restarted worker process: a new session, no views, no key; the
    verifier learns it from the next STEP (UNKNOWN_SESSION).

    entropy: the new worker's random bytes (default: the pair's).
    """
    self.worker = self._new_worker(entropy or self._worker_entropy)

  def worker_knows_verifier(self) -> bool:
    """Whether the worker holds the verifier's open session with its keys
    (a replayed HELLO can leave a pending session of the same id with other
    keys), established or pending."""
    v = self.verifier
    if not v.is_open or v.keys is None:
      return False
    probe = bytes(64)
    want = v.keys.send.tag(probe)
    return any(s is not None and s.id == v.session
               and s.keys.recv.tag(probe) == want
               for s in (self.worker.established, self.worker.pending))

  def tagger(self, name: str) -> auth.Tagger | None:
    """A tagger to seal a forged or edited frame with (`TAGGERS`).

    "hello_*": the deployment secret's hello keys (verifier HELLOs,
    worker refusals); "session_*": the verifier's open session (None when
    none is open); "crc32c": the insecure check; "none": None.
    """
    keys: auth.Keys | None
    if name.startswith("hello_"):
      if self._hello_keys is None:
        self._hello_keys = auth.hello_keys(self._secret, auth.VERIFIER)
      keys = self._hello_keys
    elif name.startswith("session_"):
      keys = self.verifier.keys
      if keys is None:
        return None
    elif name == "crc32c":
      return self._crc
    elif name == "none":
      return None
    else:
      raise ValueError(f"tagger: {name!r} is none of {TAGGERS}")
    if name.endswith("_to_worker"):
      return keys.send
    if name.endswith("_to_verifier"):
      return keys.recv
    raise ValueError(f"tagger: {name!r} is none of {TAGGERS}")

  # -- one round ---------------------------------------------------------------

  def begin(self, rids: typing.Sequence[int], depth: int) -> typing.Any:
    """The verifier begins a round of `rids`; returns its STEP message."""
    return self._sent(self.verifier.begin(rids, depth, self.now)[0].message)

  def validate(self, stage: Stage, draws: typing.Any = None,
               device: bool = False) -> Verify:
    """A Stage's rows validated by the q format (audited against `draws`,
    uint32[R, D], unless None), then handed to `VerifierSession.staged`.
    device: the jitted path, as `bridge.verifier.Validator` takes it."""
    verdict = self.caps.format.validate(stage.rows, vocab=self.caps.vocab,
                                        draws=draws, device=device)
    return self.verifier.staged(verdict, stage.key)

  def outcome(self, inbox: collections.deque, *,
              draws: DrawsFn | None = proposal_draws,
              device: bool = False) -> Plan:
    """The Plan of the round in flight: what the verifier makes of `inbox`.

    Messages are taken from the left of `inbox` until the round ends (the
    rest stay in it); when it runs dry first, the clock moves past the
    deadline (a lost exchange times out, costing no wall time). A Stage is
    validated (`validate`), audited with draws(*draw_inputs, depth) unless
    draws is None (`proposal_draws`, or a benchmark's precomputed table).
    """
    v = self.verifier
    if v.exchange is None:
      raise RuntimeError("outcome: no round in flight (begin first)")
    effects: list[Stage | Verify] = []
    while v.exchanges and not effects:
      if inbox:
        effects = self.to_verifier(inbox.popleft())
      else:
        self.now += v.timeout_s
        effects = self.poll()
    if not effects:
      raise RuntimeError("outcome: the round ended without an outcome")
    effect = effects[0]
    if isinstance(effect, Stage):
      audit_draws = None if draws is None else draws(
          *v.draw_inputs(effect.key), effect.rows.tokens.shape[-1])
      effect = self.validate(effect, audit_draws, device)
    return effect.plan

  def run_round(self, rids: typing.Sequence[int], depth: int, *,
                draws: DrawsFn | None = proposal_draws,
                device: bool = False) -> Plan:
    """One round over a perfect network: STEP, answer, Plan (not yet
    committed: `commit` it, or begin the next round without)."""
    inbox = collections.deque(self.to_worker(self.begin(rids, depth)))
    return self.outcome(inbox, draws=draws, device=device)

  def commit(self, plan: Plan, outcomes: typing.Sequence[typing.Sequence[int]]
             ) -> tuple[list[RoundResult], typing.Any]:
    """`VerifierSession.commit`: (results, the COMMIT message or None)."""
    results, send = self.verifier.commit(plan, outcomes)
    return results, None if send is None else self._sent(send.message)

  def reset(self, rid: int | None = None) -> typing.Any:
    """`VerifierSession.reset`: the RESET message, or None."""
    send = self.verifier.reset(rid)
    return None if send is None else self._sent(send.message)

  def remove(self, rid: int) -> typing.Any:
    """`VerifierSession.remove_request`: the RESET message, or None."""
    send = self.verifier.remove_request(rid)
    return None if send is None else self._sent(send.message)
