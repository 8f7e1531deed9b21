"""The verifier driver: rounds of a `VerifierSession` over a ZeroMQ DEALER.

The protocol lives in `verifier_session.VerifierSession` (sans I/O); this
driver moves bytes, keeps time, and does the numeric work the session asks
for:

* `Stage`: the q format validates the staged rows (the dense batch in one
  jitted pass on the staging slot) and audits every drafted token against
  the PROPOSAL draws (`audit.proposal_draws`, computed while the worker
  drafts);
* `Verify`: the plan is shared with the other ranks (the plan sharer), then
  run by the round engine (`engine.Engine`, what `generate.Local` runs
  too): the requests whose q validated are verified together, one
  `verify_fn` call per round on their exact q, and each request whose
  proposal the plan discarded gets one token from `sample_fn` (the target
  alone, TARGET_ONLY key); `verify_fn` returning a refusal status makes
  that request a counted fallback too.

The link heals itself. When libzmq gives the socket's connection up for
good (`transport.Endpoint.broken`: a protocol error such as a squatter's
part over ZMQ_MAXMSGSIZE, or a failed handshake, after which it never
reconnects), the exchange in flight ends at once and the next round
closes the socket, makes a new one and opens a new session (new HELLO,
new keys: no frame of the old one counts; the lost exchange fell back, so
its requests are in a new generation already). A round that merely heard
nothing keeps the session: a lost message and a dead link look alike from
inside a round, and the session's late-reply and retry accounting needs
the same session (a restarted worker answers its next STEP with a refusal,
which closes the session). While no worker answers a HELLO, reopening
backs off: after n failed HELLOs in a row, min(2^(n-1),
MAX_BACKOFF_ROUNDS) - 1 rounds fall back at once before the next.

What a deployment changes is passed in as components, never overridden:
a `Validator` (the q format's kernel and the audit, or the rank links'
collective check), a plan sharer (`ranks.PlanBroadcast`, or the rank
links' leader) and `RoundHook`s (called as each round begins and around
its exchange: the rank links' announcement, a run's timing).

`verify_fn` and `sample_fn` are the engine's (`engine.VerifyFn`,
`engine.SampleFn`). The target is a `dyadic_jax.models.TargetModel`
(`target=`), whose handle (a KV cache) the engine keeps per request and
drops with the request, or a stateless `target_fn(prefix, draft)`:
either returns the target logits float32[len(draft) + 1, V] after the
committed `prefix` and the drafted tokens, with the target's processors
applied.
"""

import contextlib
import time
import typing

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax import models, verification
from dyadic_jax.bridge import audit as audit_lib
from dyadic_jax.bridge import engine as engine_lib
from dyadic_jax.bridge import hello, transport
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.deadline import AdaptiveDeadline
from dyadic_jax.bridge.effects import Plan, Send, Stage, Verify
from dyadic_jax.bridge.exchange import Exchange
from dyadic_jax.bridge.ledger import Request, RoundResult
from dyadic_jax.bridge.verifier_session import VerifierSession
from dyadic_jax.wire import qformats
from dyadic_jax.wire.refusals import Code, ProtocolError

# Rounds between reopening attempts grow to at most this while no worker
# answers: a worker that is back is heard again within this many rounds.
MAX_BACKOFF_ROUNDS = 8
# The most messages one `finish` reads: its answer, the other round in
# flight's, late answers of rounds that fell back, a retried HELLO's, a
# refusal (one message each). A peer that streams junk or replays stale
# answers costs a round this many reads at most; then it ends as at its
# deadline (counted: "read_bound").
MAX_READS = 64

__all__ = ["InFlight", "PlanSharer", "Request", "RoundHook", "RoundResult",
           "Validator", "Verifier"]


class Validator:
  """Judges a round's answer: the q format's kernel on the staged rows (the
  dense batch in one jitted pass) and the sampling audit. overlaps:
  whether it judges rounds whose exchanges overlap (two in flight; the
  rank links' check does too: the leader announces each round's begin
  and finish to the other ranks)."""

  overlaps = True

  def __init__(self, caps: hello.Capabilities) -> None:
    self.caps = caps

  def warmup(self, rows: qformats.Rows, draws: np.ndarray | None) -> None:
    """Compiles the kernel for a full batch (rows: a staging slot's)."""
    self.caps.format.validate(rows, vocab=self.caps.vocab, draws=draws,
                              device=True)

  def example_q(self, depth: int) -> qformats.Q:
    """A valid q of a full batch ([max_requests, depth, ...]) as the rounds
    hand it to `verify_fn`, for compile warm-up: the q format's
    `example_q`, once per request (None: a format without q)."""
    caps = self.caps
    q = caps.format.example_q(depth, caps.vocab, caps.max_support)
    return jax.tree.map(lambda x: jnp.stack([x] * caps.max_requests), q)

  def validate(self, effect: Stage | Verify, draws: np.ndarray | None,
               exchange: Exchange) -> qformats.Verdict | None:
    """The verdict of a Stage's rows (counts as the format's fast path
    gives them: a JAX array, or a host one that `to_q` reads without a
    copy back); None for a Verify (the exchange failed before its rows
    could be judged). draws: the audit's PROPOSAL draws, or None."""
    del exchange
    if not isinstance(effect, Stage):
      return None
    return self.caps.format.validate(effect.rows, vocab=self.caps.vocab,
                                     draws=draws, device=True)


class PlanSharer(typing.Protocol):
  """Shares each round's plan with the other ranks (`ranks.PlanBroadcast`).
  On a follower, `share(None)` returns the leader's next plan."""

  def share(self, plan: Plan | None) -> Plan: ...

  def stop(self) -> None: ...


class RoundHook:
  """Told of each round (no-ops here; pass instances as `hooks`)."""

  def begin(self, exchange: Exchange | None) -> None:
    """A round begins: its STEP is made, not yet sent (None: a round
    without an exchange, every request falls back)."""

  def finishing(self, exchange: Exchange | None) -> None:
    """A round's finish begins (`Verifier.finish`), before its answer is
    awaited (None: the round has no exchange, it falls back whole)."""

  def begin_round(self, key: int, exchange: Exchange | None) -> None:
    """`begin`, told the round's number in its session (`InFlight.key`:
    every round has one, a round without an exchange too)."""
    del key
    self.begin(exchange)

  def finish_round(self, key: int, exchange: Exchange | None) -> None:
    """`finishing`, told the round's number (as `begin_round`)."""
    del key
    self.finishing(exchange)

  def around_exchange(self) -> contextlib.AbstractContextManager[None]:
    """The context each exchange runs in: STEP out to its verdict."""
    return contextlib.nullcontext()


class InFlight(typing.NamedTuple):
  """A round `Verifier.start` began, for `Verifier.finish`: its exchange
  (None: a round without one, whose `plan` falls back whole), the
  audit's PROPOSAL draws, when its STEP went out, and its number in the
  session (`key`: its exchange's, or its fallback plan's)."""
  exchange: Exchange | None
  plan: Plan | None = None
  draws: np.ndarray | None = None
  begun: float = 0.0
  key: int = 0


class Verifier:
  """Drives rounds against one worker; owns the requests' committed state."""

  def __init__(
      self, caps: hello.Capabilities, address: str | None, *,
      target_fn: engine_lib.TargetFn | None = None,
      target: models.TargetModel | None = None,
      secret: bytes | None,
      verify_fn: engine_lib.VerifyFn = verification.verify_batch,
      sample_fn: engine_lib.SampleFn = verification.sample_target,
      timeout_s: float = 2.0, counters: Counters | None = None,
      clock: typing.Callable[[], float] = time.monotonic,
      sharer: PlanSharer | None = None,
      request_factory: typing.Callable[
          [int], tuple[typing.Sequence[int], int]] | None = None,
      sampling_audit: bool = True, curve: transport.Curve | None = None,
      connect: typing.Callable[[str | None, int], transport.Endpoint]
      | None = None,
      deadline: AdaptiveDeadline | None = None,
      validator: Validator | None = None,
      hooks: typing.Iterable[RoundHook] = ()) -> None:
    """secret: the deployment secret (32 bytes; `bridge.keys`), or None
    (`--insecure`). sampling_audit: recompute every drafted token from its
    q and the PROPOSAL key (off: `--no_sampling_audit`). curve: CURVE keys
    (`--encrypt`). sharer: a `PlanSharer`, shares each round's plan with
    the other ranks (`bridge.ranks.PlanBroadcast`); request_factory(rid)
    -> (prompt, seed) lets a follower rank create the leader's requests.
    validator: a `Validator`, judges each exchange (default: the q
    format's); hooks: `RoundHook`s, called in order. connect: the
    endpoint factory `(address, max_message) -> Endpoint` (tests).
    timeout_s: the deadline of a HELLO and, without `deadline`, of every
    exchange; deadline: an `AdaptiveDeadline` that sets each exchange's
    deadline from the measured round time instead."""
    self.caps = caps
    self.address = address
    if target is not None and target_fn is not None:
      raise ValueError("Verifier: give target= or target_fn=, not both")
    # The numeric half of every round (target handles per request).
    self.engine = engine_lib.Engine(
        caps, target or models.Stateless(target_fn or _no_target,
                                         caps.vocab),
        verify_fn=verify_fn, sample_fn=sample_fn)
    self.timeout_s = timeout_s
    self.deadline = deadline
    self.clock = clock
    self.sharer = sharer
    self.validator = validator or Validator(caps)
    self.hooks = tuple(hooks)
    self.request_factory = request_factory
    self.curve = curve
    self.session = VerifierSession(caps, secret=secret, timeout_s=timeout_s,
                                   audit=sampling_audit, counters=counters)
    self._connect = connect or self._zmq_connect
    self.endpoint: transport.Endpoint | None = None
    self._bound = 0
    self._warm = False
    self._lost = False       # the link must be replaced before a round
    self._failures = 0       # HELLOs in a row that got no session
    self._skip = 0           # rounds left before the next HELLO
    # Per exchange: seconds from its STEP to its answer (or its deadline),
    # before validation: what the link took (with two in flight, what it
    # took until this side came to read it).
    self.seconds: list[float] = []
    # Seconds this side spent blocked on the worker's answers (the rest
    # of a run's wall is its own work: what two in flight overlaps).
    self.waited_s = 0.0
    # Effects of exchanges that ended while another was awaited, by key.
    self._ended: dict[int, Stage | Verify] = {}

  # -- plumbing --------------------------------------------------------------

  @property
  def counters(self) -> Counters:
    return self.session.counters

  @property
  def in_flight(self) -> int:
    """How many rounds may be in flight at once (`start`): the session's
    `max_slots`, 1 under a validator that judges one at a time."""
    return self.caps.max_slots if self.validator.overlaps else 1

  @property
  def requests(self) -> dict[int, Request]:
    return self.session.requests

  def _zmq_connect(self, address: str | None,
                   max_message: int) -> transport.Endpoint:
    if address is None:
      raise ValueError("Verifier: no worker address (a follower rank never "
                       "connects)")
    return transport.Endpoint.connect(address, max_message=max_message,
                                      curve=self.curve,
                                      counters=self.counters)

  def _endpoint(self, max_message: int) -> transport.Endpoint:
    if self.endpoint is None or self._bound < max_message:
      if self.endpoint is not None:
        self.endpoint.close()
      self.endpoint = self._connect(self.address, max_message)
      self._bound = max_message
    return self.endpoint

  def _drop_link(self) -> None:
    """Replaces a lost link: closes the socket; the next HELLO goes out on
    a new one, in a new session. Between rounds no key is in flight (the
    lost exchange fell back: its requests are in a new generation), and
    no frame of the old session authenticates in the new one, so the
    requests keep their tags: they only ever grow."""
    self._lost = False
    if self.endpoint is not None:
      self.endpoint.close()
      self.endpoint = None
    self.session.close()
    self.counters.event("reconnects")

  def _send(self, send: Send | None, wait_s: float = 0.0) -> bool:
    if send is None or self.endpoint is None:
      return False
    sent, _ = self.endpoint.send(send.message, wait_s=max(wait_s, 0.0))
    return sent

  # -- session ---------------------------------------------------------------

  def open(self, attempts: int = 50) -> "Verifier":
    """Negotiates a session (HELLO both ways); returns self.

    Raises ProtocolError: IDENTITY_MISMATCH (the worker or this side
    refused the other's capabilities), or TIMEOUT after `attempts`
    deadlines without an answer (a wrong key or a mismatched --insecure is
    this: a worker never answers a HELLO it cannot authenticate).
    """
    session = self.session
    # Before a session is open only HELLO-sized messages are accepted.
    endpoint = self._endpoint(transport.HELLO_MESSAGE)
    for _ in range(attempts):
      if endpoint.broken():         # libzmq gave this socket up
        endpoint.close()
        self.endpoint = None
        endpoint = self._endpoint(transport.HELLO_MESSAGE)
      self._send(session.hello(self.clock()))
      deadline = self.clock() + self.timeout_s
      while (left := deadline - self.clock()) > 0:
        got = endpoint.recv(left)
        if got is None:
          continue
        session.receive(got[1], self.clock())
        if session.refused is not None:
          raise ProtocolError(session.refused, "the session was refused")
        if session.is_open:
          # Now the negotiated bound: a new socket (libzmq reads
          # ZMQ_MAXMSGSIZE when it connects).
          self._endpoint(session.max_message)
          self._warm_validator()
          if self.deadline is not None:
            self.deadline.new_session()
          return self
      self.counters.reject(Code.TIMEOUT, "no HELLO answer")
    raise ProtocolError(Code.TIMEOUT, f"no worker answered at {self.address}"
                        " (wrong key, or --insecure on one side only?)")

  def warmup(self, prefix: typing.Sequence[int],
             say: typing.Callable[[str], None] = lambda _: None) -> None:
    """Compiles (and runs once) what a round calls, before the first one,
    so that compilation is not spent inside a round: the target on a fresh
    handle, on a handle that holds the prefix (a round after a rejection)
    and on the fallback's single row, `verify_fn` on a full batch of
    the validator's `example_q` (the session's q format's), `sample_fn`.

    prefix: a committed prefix of the rounds' shape (a prompt); say: told
    what compiles next (a progress line). On a
    multi-rank verifier every rank calls it, in the same order as its
    other collectives: the sharded functions (and a rank validator's
    example q) are collectives. The validator's own kernel compiles when a
    session opens, on a staging slot.
    """
    self.engine.warmup(prefix, self.validator.example_q, say)

  def _warm_validator(self) -> None:
    """Compiles the validator for a full batch at the maximal depth (once),
    so that a first round does not spend its deadline compiling."""
    if self._warm or self.session.slots is None:
      return
    self._warm = True
    r, d = self.caps.max_requests, self.caps.max_depth
    draws = None
    if self.session.audit:
      draws = audit_lib.proposal_draws(np.zeros(r), np.zeros(r),
                                       np.zeros(r), np.zeros(r), d)
    self.validator.warmup(self.session.slots[0].rows(r, d), draws)

  def reconnect(self) -> "Verifier":
    """New socket and session; invalidates every in-flight key."""
    if self.endpoint is not None:
      self.endpoint.close()
      self.endpoint = None
    self.session.reconnect()
    return self.open()

  def close(self) -> None:
    if self.endpoint is not None:
      self.endpoint.close()
      self.endpoint = None

  def add_request(self, rid: int, prompt: typing.Sequence[int],
                  seed: int) -> None:
    self.session.add_request(rid, prompt, seed)

  def remove_request(self, rid: int) -> None:
    """Forgets request `rid` on both sides."""
    self.engine.drop(rid)
    self._send(self.session.remove_request(rid))

  def reset(self, rid: int | None = None) -> None:
    """Cancels request `rid` (all when None): new generation, RESET sent."""
    self._send(self.session.reset(rid))

  # -- one round -------------------------------------------------------------

  def round(self, rids: typing.Sequence[int],
            depth: int | None = None) -> list[RoundResult]:
    """Runs one round for requests `rids`; returns their RoundResults."""
    return self.finish(self.start(rids, depth))

  def start(self, rids: typing.Sequence[int],
            depth: int | None = None) -> InFlight:
    """Begins a round of requests `rids`: its STEP goes out now, and the
    worker drafts while this side does other work (verifies another
    round); `finish` waits for its answer, verifies and commits it.

    At most `caps.max_slots` rounds are in flight (the HELLO's; 1 keeps
    one exchange at a time), each on requests of no other; rounds are
    finished in the order they were started. A round that finds no open
    session (and cannot open one) falls back whole, as `round` does.
    """
    depth = self.caps.max_depth if depth is None else int(depth)
    if not 1 <= depth <= self.caps.max_depth:    # refused as `generate` does
      raise ValueError(f"start: depth {depth} outside [1, "
                       f"{self.caps.max_depth}]")
    if len(self.session.exchanges) >= self.in_flight:
      raise RuntimeError(f"start: {self.in_flight} rounds in flight already "
                         "(finish one first)")
    if self._lost or (self.endpoint is not None and self.endpoint.broken()):
      self._drop_link()
    if not self.session.is_open:
      code = Code.TIMEOUT
      if self._skip:              # backing off: no HELLO this round
        self._skip -= 1
        self.counters.event("backoff_rounds")
      else:
        try:
          self.open(attempts=1)
          self._failures = 0
        except ProtocolError as e:
          code = e.code
          self._failures += 1
          self._skip = min(2 ** (self._failures - 1), MAX_BACKOFF_ROUNDS) - 1
          self._lost = True           # a new socket for the next attempt
    if not self.session.is_open:
      bare = self.session.fallback(rids, code)
      for hook in self.hooks:
        hook.begin_round(bare.key, None)
      return InFlight(None, bare.plan, key=bare.key)
    session = self.session
    begun = self.clock()
    send, exchange = session.begin(
        rids, depth, begun, timeout_s=None if self.deadline is None
        else self.deadline.seconds())
    for hook in self.hooks:
      hook.begin_round(exchange.key, exchange)
    # A worker busy with the other round may leave its queue full: the
    # STEP waits for room until its deadline (never past it), as its
    # answer would.
    if not self._send(send, exchange.deadline - self.clock()):
      session.expire(exchange.key)     # never left: it falls back now
    draws = None
    if session.audit:     # computed while the worker drafts
      draws = audit_lib.proposal_draws(*session.draw_inputs(exchange.key),
                                       depth, pad_to=self.caps.max_requests)
    return InFlight(exchange, None, draws, begun, exchange.key)

  def finish(self, flight: InFlight) -> list[RoundResult]:
    """Waits for the answer of a round `start` began (never past its
    deadline), judges it (the validator), verifies and commits it;
    returns its RoundResults. Answers of other rounds in flight that
    arrive meanwhile are kept for their own `finish`."""
    for hook in self.hooks:
      hook.finish_round(flight.key, flight.exchange)
    if flight.plan is not None:
      return self.execute(flight.plan)
    with contextlib.ExitStack() as scope:
      for hook in self.hooks:
        scope.enter_context(hook.around_exchange())
      verify = self._judge(flight)
    return self.execute(verify.plan)

  def _judge(self, flight: InFlight) -> Verify:
    """The round's `Verify` (its Plan): answers in, judged by the
    validator."""
    session, exchange = self.session, flight.exchange
    assert exchange is not None
    key = exchange.key
    reads = 0
    while key not in self._ended:
      if key not in session.exchanges:
        raise RuntimeError(f"finish: round {key} is not in flight")
      left = exchange.deadline - self.clock()
      waiting = time.perf_counter()
      got = (self.endpoint.recv(max(left, 0.0)) if self.endpoint is not None
             else None)
      self.waited_s += time.perf_counter() - waiting
      if got is not None:
        reads += 1
        effects = session.receive(got[1], self.clock())
      else:     # a lost connection ends the exchange now, as its deadline
        lost = self.endpoint is None or self.endpoint.broken()
        effects = session.poll(exchange.deadline if lost else self.clock(),
                               None if lost else key)
      for effect in effects:
        self._ended[effect.key] = effect
      if got is None or key in self._ended:
        continue
      # A receive that never comes back empty (a peer streaming junk or
      # replaying stale answers) must not hold the round: its deadline is
      # checked after every message, and past MAX_READS messages it ends
      # as at its deadline. (The first message is read even past the
      # deadline: an answer that waited while this side verified another
      # round is used.)
      now = self.clock()
      if now < exchange.deadline and reads >= MAX_READS:
        self.counters.event("read_bound")
        now = exchange.deadline
      for effect in session.poll(now, key):
        self._ended[effect.key] = effect
    effect = self._ended.pop(key)
    self.seconds.append(self.clock() - flight.begun)
    if self.deadline is not None and isinstance(effect, Stage):
      self.deadline.observe(self.seconds[-1])     # answered in full
    verdict = self.validator.validate(effect, flight.draws, exchange)
    if not isinstance(effect, Stage):
      assert isinstance(effect, Verify)
      return effect
    if verdict is None:
      raise RuntimeError("the validator judged no Stage")
    return session.staged(verdict, key)

  def abandon(self) -> None:
    """Forgets the rounds in flight, unfinished (a caller that gives up
    on them removes or resets their requests next)."""
    self.session.abandon()
    self._ended.clear()

  def execute(self, plan: Plan) -> list[RoundResult]:
    """Shares a round's plan with the other ranks (the sharer), runs it,
    commits it; returns the RoundResults."""
    if self.sharer is not None:
      plan = self.sharer.share(plan)
    return self.apply(plan)

  def apply(self, plan: Plan) -> list[RoundResult]:
    """Runs a shared plan and commits it (the COMMIT goes out when a
    session is open); returns the RoundResults."""
    results, commit = self.session.commit(plan, self.run(plan))
    self._send(commit)
    return results

  def follow(self) -> int:
    """A follower rank's loop: runs the leader's plans until a stop plan.

    Needs the sharer, whose `share(None)` on a follower returns the
    leader's next plan. The follower keeps the same `requests` (add them
    in the same order, or give a `request_factory`) and commits exactly
    what the leader commits; it never touches the transport.
    """
    if self.sharer is None:
      raise RuntimeError("follow: the verifier has no plan sharer")
    rounds = 0
    while True:
      plan = self.sharer.share(None)
      if int(plan.stop):
        return rounds
      self.apply(plan)
      rounds += 1

  def stop_followers(self) -> None:
    """Leader: tells follower ranks that there are no more rounds."""
    if self.sharer is not None:
      self.sharer.stop()

  def run(self, plan: Plan) -> list[engine_lib.Outcome]:
    """The outcome of every plan row (`engine.Engine.run`): verified on its
    q, or one token of the target alone where its code discards the
    proposal."""
    chains = []
    for i, rid in enumerate(plan.rids):
      rid = int(rid)
      if rid not in self.requests and self.request_factory:
        self.add_request(rid, *self.request_factory(rid))
      req = self.requests[rid]
      chains.append(engine_lib.Chain(rid, req.tokens, req.seed,
                                     int(plan.tags[i, 0]),
                                     int(plan.tags[i, 1])))
    return self.engine.run(chains, plan.codes, plan.rows, plan.counts,
                           plan.lengths)

  def log(self) -> None:
    logging.info("verifier counters: %s", self.counters.snapshot())


def _no_target(prefix: np.ndarray, draft: np.ndarray) -> jax.Array:
  """The target of a verifier made without one (a probe): never called."""
  raise RuntimeError("this Verifier was made without a target")

