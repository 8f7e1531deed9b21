"""The verifier driver: rounds of a `VerifierSession` over a ZeroMQ DEALER.

The protocol lives in `verifier_session.VerifierSession` (sans I/O); this
driver moves bytes, keeps time, and does the numeric work the session asks
for:

* `Stage`: the q format validates the staged rows (the dense batch in one
  jitted pass on the staging slot) and audits every drafted token against
  the PROPOSAL draws (`audit.proposal_draws`, computed while the worker
  drafts);
* `Verify`: the plan is shared with the other ranks (`share_fn`), then
  the requests whose q validated are verified together, one `verify_fn`
  call per round on their exact q (padded to max_requests rows, so one
  compiled shape serves every round), and each request whose proposal the
  plan discarded gets one token from `sample_fn` (the target alone,
  TARGET_ONLY key); `verify_fn` returning a refusal status makes that
  request a counted fallback too.

`verify_fn` is `dyadic_jax.verify_batch` or the sharded
`sharding.verify_batch` with its mesh bound (the bridge never imports
`sharding`): (target_logits [B, D+1, V], q [B, D, ...], draft [B, D],
keys [B], anchors [B]) -> (accepted [B], token [B], status [B]); `target_fn(prefix, draft)` returns the target logits
float32[len(draft) + 1, V] after the committed `prefix` and the drafted
tokens, with the target's processors applied.
"""

import math
import time
import typing

from absl import logging
import jax.numpy as jnp
import numpy as np

from dyadic_jax import rng, verification
from dyadic_jax.bridge import audit as audit_lib
from dyadic_jax.bridge import transport
from dyadic_jax.bridge.effects import Plan, Stage, Verify
from dyadic_jax.bridge.verifier_session import (Request, RoundResult,
                                                VerifierSession, empty_plan)
from dyadic_jax.errors import raise_for_status
from dyadic_jax.wire import status as status_lib
from dyadic_jax.wire.errors import Code, ProtocolError

__all__ = ["Outcome", "Request", "RoundResult", "Verifier", "greedy_verify"]


class Outcome(typing.NamedTuple):
  """What a rank's execution of one plan row committed."""
  accepted: int
  token: int
  code: int = 0       # nonzero: verification refused, a counted fallback


def greedy_verify(target_logits, draft_tokens):
  """Greedy point-mass verification: accept while x_i is the target argmax."""
  best = np.argmax(np.asarray(target_logits), axis=-1)
  accepted = 0
  while accepted < len(draft_tokens) and draft_tokens[accepted] == best[
      accepted]:
    accepted += 1
  return accepted, int(best[accepted])


class Verifier:
  """Drives rounds against one worker; owns the requests' committed state."""

  def __init__(self, caps, address, *, target_fn, secret,
               verify_fn=verification.verify_batch,
               sample_fn=verification.sample_target, timeout_s=2.0,
               counters=None, clock=time.monotonic, share_fn=None,
               request_factory=None, sampling_audit=True, curve=None,
               connect=None, deadline=None):
    """secret: the deployment secret (32 bytes; `bridge.keys`), or None
    (`--insecure`). sampling_audit: recompute every drafted token from its
    q and the PROPOSAL key (off: `--no_sampling_audit`). curve: CURVE keys
    (`--encrypt`). share_fn(plan) broadcasts a round's plan to the other
    ranks (`bridge.ranks.plan_broadcast`); request_factory(rid) -> (prompt,
    seed) lets a follower rank create the leader's requests. connect: the
    endpoint factory `(address, max_message) -> Endpoint` (tests).
    timeout_s: the deadline of a HELLO and, without `deadline`, of every
    exchange; deadline: an `AdaptiveDeadline` that sets each exchange's
    deadline from the measured round time instead."""
    self.caps = caps
    self.address = address
    self.target_fn = target_fn
    self.verify_fn = verify_fn
    self.sample_fn = sample_fn
    self.timeout_s = timeout_s
    self.deadline = deadline
    self.clock = clock
    self.share_fn = share_fn
    self.request_factory = request_factory
    self.curve = curve
    self.session = VerifierSession(caps, secret=secret, timeout_s=timeout_s,
                                   audit=sampling_audit, counters=counters)
    self._connect = connect or self._zmq_connect
    self.endpoint = None
    self._bound = 0
    self._warm = False
    # Per exchange: seconds from its STEP to its answer (or its deadline),
    # before validation: what the link took.
    self.seconds = []

  # -- plumbing --------------------------------------------------------------

  @property
  def counters(self):
    return self.session.counters

  @property
  def requests(self):
    return self.session.requests

  def _zmq_connect(self, address, max_message):
    return transport.Endpoint.connect(address, max_message=max_message,
                                      curve=self.curve,
                                      counters=self.counters)

  def _endpoint(self, max_message):
    if self.endpoint is None or self._bound < max_message:
      if self.endpoint is not None:
        self.endpoint.close()
      self.endpoint = self._connect(self.address, max_message)
      self._bound = max_message
    return self.endpoint

  def _send(self, send):
    if send is None or self.endpoint is None:
      return False
    sent, _ = self.endpoint.send(send.message)
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
    self._endpoint(transport.HELLO_MESSAGE)
    for _ in range(attempts):
      self._send(session.hello(self.clock()))
      deadline = self.clock() + self.timeout_s
      while (left := deadline - self.clock()) > 0:
        got = self.endpoint.recv(left)
        if got is None:
          continue
        session.receive(got[1], self.clock())
        if session.refused is not None:
          raise ProtocolError(session.refused, "the session was refused")
        if session.is_open:
          # Now the negotiated bound: a new socket (libzmq reads
          # ZMQ_MAXMSGSIZE when it connects).
          self._endpoint(session.max_message)
          self.warmup()
          if self.deadline is not None:
            self.deadline.new_session()
          return self
      self.counters.reject(Code.TIMEOUT, "no HELLO answer")
    raise ProtocolError(Code.TIMEOUT, f"no worker answered at {self.address}"
                        " (wrong key, or --insecure on one side only?)")

  def warmup(self) -> None:
    """Compiles the audit and the validation kernel for a full batch at
    the maximal depth (once), so that a first round does not spend its
    deadline compiling."""
    if self._warm or self.session.slots is None:
      return
    self._warm = True
    r, d = self.caps.max_requests, self.caps.max_depth
    draws = None
    if self.session.audit:
      draws = audit_lib.proposal_draws(np.zeros(r), np.zeros(r),
                                       np.zeros(r), np.zeros(r), d)
    fmt = self.caps.format
    rows = self.session.slots[0].rows(r, d)
    fmt.validate(rows, vocab=self.caps.vocab, draws=draws, device=True)

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
    self._send(self.session.remove_request(rid))

  def reset(self, rid: int | None = None) -> None:
    """Cancels request `rid` (all when None): new generation, RESET sent."""
    self._send(self.session.reset(rid))

  # -- one round -------------------------------------------------------------

  def round(self, rids: typing.Sequence[int],
            depth: int | None = None) -> list[RoundResult]:
    """Runs one round for requests `rids`; returns their RoundResults."""
    depth = depth or self.caps.max_depth
    if not self.session.is_open:
      try:
        self.open(attempts=1)
      except ProtocolError as e:
        return self.execute(self.session.fallback(rids, e.code).plan)
    return self.execute(self._exchange(rids, depth).plan)

  def _exchange(self, rids, depth):
    """STEP out, answers in, rows validated and audited: the round's
    `Verify` (its Plan). Never waits past the exchange's deadline."""
    effect, draws = self._answer(rids, depth)
    if isinstance(effect, Stage):
      effect = self.validate(effect, draws)
    return effect

  def _answer(self, rids, depth):
    """STEP out, the answer in (or the deadline): (the session's first
    effect, the audit's PROPOSAL draws or None)."""
    session = self.session
    if self.deadline is not None:
      session.timeout_s = self.deadline.seconds()
    start = self.clock()
    send = session.begin(rids, depth, start)
    self.on_begin(session.exchange)
    sent = self._send(send)
    draws = None
    if session.audit:     # computed while the worker drafts
      draws = audit_lib.proposal_draws(*session.draw_inputs(), depth,
                                       pad_to=self.caps.max_requests)
    effects = [] if sent else session.poll(math.inf)
    while not effects:
      left = session.exchange.deadline - self.clock()
      got = self.endpoint.recv(left) if left > 0 else None
      effects = (session.receive(got[1], self.clock()) if got is not None
                 else session.poll(self.clock()))
    self.seconds.append(self.clock() - start)
    if self.deadline is not None and isinstance(effects[0], Stage):
      self.deadline.observe(self.seconds[-1])     # answered in full
    return effects[0], draws

  def on_begin(self, exchange: typing.Any) -> None:
    """Called once a round's STEP is made, before it is sent (the rank
    links' leader tells its other ranks what to expect)."""

  def validate(self, stage: Stage,
               draws: np.ndarray | None = None) -> Verify:
    """The verdict of a Stage's rows (the q format's kernel, the audit)."""
    fmt = self.caps.format
    verdict = fmt.validate(stage.rows, vocab=self.caps.vocab, draws=draws,
                           device=True)
    return self.session.staged(verdict)

  def execute(self, plan: Plan) -> list[RoundResult]:
    """Shares a round's plan with the other ranks (`share_fn`), runs it,
    commits it; returns the RoundResults."""
    if self.share_fn is not None:
      plan = self.share_fn(plan)
    outcomes = self._run(plan)
    results, commit = self.session.commit(plan, outcomes)
    self._send(commit)
    return results

  def follow(self) -> int:
    """A follower rank's loop: runs the leader's plans until a stop plan.

    Needs `share_fn`, which on a follower ignores its argument and returns
    the leader's next plan. The follower keeps the same `requests` (add
    them in the same order, or give a `request_factory`) and commits
    exactly what the leader commits; it never touches the transport.
    """
    rounds = 0
    while True:
      plan = self.share_fn(None)
      if int(plan.stop):
        return rounds
      self.session.commit(plan, self._run(plan))
      rounds += 1

  def stop_followers(self) -> None:
    """Leader: tells follower ranks that there are no more rounds."""
    if self.share_fn is not None:
      r = self.caps.max_requests
      plan = empty_plan(self.caps, [0] * r, [(0, 0)] * r, [0] * r,
                        self.caps.max_depth)
      self.share_fn(plan._replace(stop=np.ones((), np.int32)))

  def _run(self, plan):
    outcomes = [None] * len(plan.rids)
    verified = []
    for i, rid in enumerate(plan.rids):
      rid = int(rid)
      if rid not in self.requests and self.request_factory:
        self.add_request(rid, *self.request_factory(rid))
      if plan.codes[i]:
        outcomes[i] = Outcome(0, self._target_only(self.requests[rid],
                                                   _tag(plan, i)))
      else:
        verified.append(i)
    if verified:
      for i, out in zip(verified, self._verify(plan, verified)):
        outcomes[i] = out
    return outcomes

  def _verify(self, plan, rows):
    """Outcomes of the plan rows `rows` (validated q): one `verify_fn` call
    for all of them, padded to max_requests rows (one compiled shape)."""
    reqs = [self.requests[int(plan.rids[i])] for i in rows]
    logits = [self.target_fn(np.asarray(req.tokens, np.int32),
                             np.array(plan.draft[i]))
              for req, i in zip(reqs, rows)]
    if self.caps.greedy:
      return [Outcome(*greedy_verify(x, np.array(plan.draft[i])))
              for x, i in zip(logits, rows)]
    pad = list(rows) + [rows[0]] * (self.caps.max_requests - len(rows))
    idx = np.asarray(pad)
    fmt = self.caps.format
    counts = plan.counts if pad == list(range(len(plan.rids))) else (
        plan.counts[idx])
    q = fmt.to_q(counts, _PlanRows(plan, idx))
    keys = jnp.stack([rng.round_key(req.seed, *_tag(plan, i))
                      for req, i in zip(reqs, rows)]
                     + [rng.round_key(0, 0, 0)] * (len(pad) - len(rows)))
    anchors = np.asarray([req.anchor for req in reqs]
                         + [0] * (len(pad) - len(rows)), np.int64)
    logits = np.stack(logits + [logits[0]] * (len(pad) - len(rows)))
    accepted, tokens, status = (
        np.asarray(a) for a in self.verify_fn(logits, q, plan.draft[idx],
                                              keys, anchors))
    outcomes = []
    for j, (req, i) in enumerate(zip(reqs, rows)):
      if status[j] or tokens[j] < 0:
        # The verifier refused the row (e.g. NaN target logits): a counted
        # fallback to the target alone, never a committed -1.
        code = int(status_lib.codes([int(status[j]) or 1])[0])
        logging.log_every_n_seconds(logging.WARNING, "verify_fn refused "
                                    "request %d: status %d", 1.0, req.rid,
                                    int(status[j]))
        outcomes.append(Outcome(0, self._target_only(req, _tag(plan, i)),
                                code))
      else:
        outcomes.append(Outcome(int(accepted[j]), int(tokens[j])))
    return outcomes

  def _target_only(self, req, tag):
    """The fallback: one token from the target alone (TARGET_ONLY key)."""
    logits = self.target_fn(np.asarray(req.tokens, np.int32),
                            np.zeros(0, np.int32))
    key = rng.draw_key(rng.round_key(req.seed, tag[0], tag[1]), req.anchor,
                       rng.Domain.TARGET_ONLY)
    token, row_status = self.sample_fn(logits[0], key)
    raise_for_status("sample_fn", row_status)
    return int(token)

  def log(self):
    logging.info("verifier counters: %s", self.counters.snapshot())


def _tag(plan, i):
  """(generation, round) of plan row i."""
  return int(plan.tags[i, 0]), int(plan.tags[i, 1])


class _PlanRows(typing.NamedTuple):
  """The Rows of plan requests i (an index array; what `QFormat.to_q`
  reads)."""
  plan: typing.Any
  i: typing.Any

  @property
  def ids(self):
    return self.plan.ids[self.i]

  @property
  def n(self):
    return self.plan.n[self.i]

  @property
  def tokens(self):
    return self.plan.draft[self.i]

