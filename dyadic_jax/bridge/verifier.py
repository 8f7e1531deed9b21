"""The verifier loop: one exchange per round, verified or target-only.

A round for a batch of requests (at most `max_requests`):

1. every request's round id advances; a slot is acquired (the watchdog
   first expires timed-out exchanges); one STEP message is sent;
2. messages are read until the exchange is complete or its deadline passes.
   Messages of older rounds or generations (late or duplicated replies) are
   counted and dropped without touching the slot. In a message of this
   exchange every frame must decode (framing, bounds, CRC32C) or the whole
   batch's proposal is discarded; then each request's D REPLY rows and its
   COMPLETION must match the STEP (request, positions in order, anchor,
   context, byte count, CRC of the rows, status OK), and every q row must
   validate: sparse rows with `wire.validate_q_row`, dense rows in one fused
   pass (`staging.dense_rows`) that agrees with it exactly;
3. only then is the slot published (q-ready), and each request is verified
   with `verify_fn` on its exact q;
4. a request whose q is missing, corrupt or late is not verified at all:
   its error is counted, the next token is drawn by the ordinary target
   sampler from the committed prefix (TARGET_ONLY key of that round), and
   the request moves to a new generation, so no key of the failed exchange
   can be used again;
5. one COMMIT per request (accepted count, next token, new position, the
   failure code and the fallback flag) tells the worker what was committed.

`verify_fn` is `dyadic_jax.verify_chain` or the vocabulary-sharded
`sharding.verify_chain` with its mesh bound (the bridge never imports
`sharding`); `target_fn(prefix, draft)` returns the target logits
float32[len(draft) + 1, V] after the committed `prefix` and the drafted
tokens, with the target's processors applied.
"""

import dataclasses
import time
import typing

from absl import logging
import numpy as np

from dyadic_jax import rng, verification
from dyadic_jax.constants import Status
from dyadic_jax.errors import DyadicError, raise_for_status
from dyadic_jax.bridge import digest as digest_lib
from dyadic_jax.bridge import hello, staging
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.transport import Endpoint
from dyadic_jax.bridge.worker import POLICY_GREEDY, POLICY_SAMPLED
from dyadic_jax.wire import codec, layouts, validate_q_row
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import Kind, Representation


@dataclasses.dataclass
class Request:
  """One request's committed state on the verifier (the source of truth)."""
  rid: int
  seed: int
  tokens: list                 # committed tokens, prompt first
  generation: int = 0
  round: int = 0
  context_version: int = 0
  digest: bytes = b""

  @property
  def anchor(self):
    return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What one round committed for one request."""
  rid: int
  generation: int
  round: int
  anchor: int
  committed: tuple             # tokens appended to the request, in order
  accepted: int                # drafted tokens among them
  fallback: bool               # True: proposal discarded, target-only token
  code: Code | None            # why it was discarded


class Plan(typing.NamedTuple):
  """What every verifier rank does in one round (fixed shapes, R requests).

  The leader builds it after validation; `share_fn` sends it to the other
  ranks, which then run exactly the same verification or fallback calls
  (the verdict travels with q, so no rank can commit while another falls
  back). codes[r] is 0 for a request whose q validated, else the `Code`
  that discarded its proposal (its draft and q are then zeros).
  """
  rids: np.ndarray       # int32[R]
  tags: np.ndarray       # int32[R, 2]  (generation, round)
  codes: np.ndarray      # int32[R]
  draft: np.ndarray      # int32[R, D]
  ids: np.ndarray        # int32[R, D, k] sparse ids ([R, D, 0] if dense)
  counts: np.ndarray     # int32[R, D, width] counts over ids, or dense
  n: np.ndarray          # int32[R, D] entries per row
  stop: np.ndarray       # int32[]: 1 tells follower ranks to return


def empty_plan(caps, rids, tags, codes, depth):
  r = len(rids)
  sparse = caps.representation == Representation.SPARSE
  w = caps.width
  return Plan(np.asarray(rids, np.int32), np.asarray(tags, np.int32),
              np.asarray(codes, np.int32), np.zeros((r, depth), np.int32),
              np.zeros((r, depth, w if sparse else 0), np.int32),
              np.zeros((r, depth, w), np.int32), np.zeros((r, depth),
                                                          np.int32),
              np.zeros((), np.int32))


def greedy_verify(target_logits, draft_tokens):
  """v1 point-mass verification: accept while x_i is the target argmax."""
  best = np.argmax(np.asarray(target_logits), axis=-1)
  accepted = 0
  while accepted < len(draft_tokens) and draft_tokens[accepted] == best[
      accepted]:
    accepted += 1
  return accepted, int(best[accepted])


class Verifier:
  """Drives rounds against one worker; owns the requests' committed state."""

  def __init__(self, caps, address, *, target_fn, verify_fn=verification.verify_chain,
               sample_fn=verification.sample_target, timeout_s=2.0, session=None,
               counters=None, clock=time.monotonic, share_fn=None,
               request_factory=None):
    self.caps = caps
    self.share_fn = share_fn
    # rid -> (prompt, seed) for requests a follower learns from a plan.
    self.request_factory = request_factory
    self.address = address
    self.target_fn = target_fn
    self.verify_fn = verify_fn
    self.sample_fn = sample_fn
    self.timeout_s = timeout_s
    self.session = session or int.from_bytes(np.random.bytes(8), "little")
    self.counters = counters or Counters("verifier")
    self.clock = clock
    self.requests = {}
    self.pool = None
    self.endpoint = None
    self._open = False
    self.used_tags = set()     # (rid, generation, round) ever sent

  # -- session ---------------------------------------------------------------

  def open(self, attempts=50):
    """Connects and negotiates (HELLO both ways); allocates the slots."""
    if self.endpoint is None:
      self.endpoint = Endpoint.connect(self.address)
    frame = hello.hello_frame(self.caps, self.session)
    for _ in range(attempts):
      self.endpoint.send([frame])
      deadline = self.clock() + self.timeout_s
      while (left := deadline - self.clock()) > 0:
        got = self.endpoint.recv(left)
        if got is None:
          break
        reply = got[1][0]
        peeked = codec.peek(reply)
        if peeked and peeked[0] == Kind.RESET and peeked[1] == self.session \
            and peeked[2:] == (0, 0):   # a refusal of this HELLO
          reason = codec.decode(reply, hello.HELLO_BOUNDS).body["reason"]
          self.counters.reject(int(reason), "worker refused HELLO")
          raise ProtocolError(int(reason), "the worker refused the session")
        if not peeked or peeked[0] != Kind.HELLO:
          continue           # a late answer to an earlier exchange
        theirs, session = hello.decode_hello(reply)
        if session != self.session:
          continue
        try:
          hello.negotiate(self.caps, theirs)
        except ProtocolError as e:
          self.counters.reject(e.code, str(e))
          raise
        if self.pool is None:   # nothing is allocated before agreement
          self.pool = staging.SlotPool(self.caps, self.clock)
        self._open = True
        self.counters.event("hellos")
        return self
      self.counters.reject(Code.TIMEOUT, "no HELLO reply")
    raise ProtocolError(Code.TIMEOUT, f"no worker answered at {self.address}")

  def reconnect(self):
    """New socket and session handshake; invalidates every in-flight key."""
    if self.endpoint is not None:
      self.endpoint.close()
    self.endpoint = None
    self._open = False
    for req in self.requests.values():
      req.generation, req.round = req.generation + 1, 0
    self.counters.event("reconnects")
    return self.open()

  def close(self):
    if self.endpoint is not None:
      self.endpoint.close()
      self.endpoint = None

  def add_request(self, rid, prompt, seed):
    if rid in self.requests or not 0 <= rid < layouts.ALL_REQUESTS:
      raise ValueError(f"add_request: bad or duplicate request id {rid}")
    prompt = [int(t) for t in prompt]
    if not prompt or min(prompt) < 0 or max(prompt) >= self.caps.vocab:
      raise ValueError("add_request: prompt needs tokens in [0, V)")
    self.requests[rid] = Request(rid, int(seed), prompt,
                                 digest=digest_lib.of(prompt))

  # -- one round -------------------------------------------------------------

  def round(self, rids, depth=None):
    """Runs one round for requests `rids`; returns their RoundResults."""
    depth = depth or self.caps.max_depth
    if not self._open:
      try:
        self.open(attempts=1)
      except ProtocolError as e:
        return self._fallback_all(rids, e.code)
    self.pool.preflight(len(rids), depth)
    reqs = [self.requests[r] for r in rids]
    for req in reqs:
      req.round += 1
    tags = {req.rid: (req.generation, req.round) for req in reqs}
    for req in reqs:
      key = (req.rid,) + tags[req.rid]
      assert key not in self.used_tags, f"key reuse {key}"
      self.used_tags.add(key)
    slot = self.pool.acquire(tags, self.timeout_s)
    steps = [self._step(req, i, depth) for i, req in enumerate(reqs)]
    self.counters.event("bytes_out", sum(len(f) for f in steps))
    self.endpoint.send(steps)
    outcome = self._collect(slot, reqs, tags, depth)
    results = self._finish(slot, reqs, tags, depth, outcome)
    self._commit(results)
    return results

  def _fallback_all(self, rids, code):
    reqs = [self.requests[r] for r in rids]
    for req in reqs:
      req.round += 1
      self.used_tags.add((req.rid, req.generation, req.round))
    plan = empty_plan(self.caps, rids,
                      [(q.generation, q.round) for q in reqs],
                      [int(code)] * len(reqs), self.caps.max_depth)
    return self.execute(plan)

  def _step(self, req, index, depth):
    body = {"slot": 0, "request": req.rid, "depth": depth,
            "policy": POLICY_GREEDY if self.caps.greedy else POLICY_SAMPLED,
            "last_token": req.tokens[-1], "seed": req.seed,
            "anchor": req.anchor, "context_version": req.context_version,
            "prefix_digest": req.digest}
    del index
    return codec.encode(Kind.STEP, session=self.session,
                        generation=req.generation, round_id=req.round,
                        body=body, version=self.caps.mode)

  def _collect(self, slot, reqs, tags, depth):
    """{rid: None (rows staged in slot) or Code} for the exchange."""
    outcome = {}
    index = {req.rid: i for i, req in enumerate(reqs)}
    while len(outcome) < len(reqs):
      left = slot.deadline - self.clock()
      if left <= 0:
        for rid in index:
          outcome.setdefault(rid, Code.TIMEOUT)
        break
      got = self.endpoint.recv(left)
      if got is not None:
        self.counters.event("bytes_in", sum(len(f) for f in got[1]))
        self._message(got[1], slot, reqs, tags, depth, index, outcome)
    return outcome

  def _late(self, tag, tags, index):
    """STALE_GENERATION / DUPLICATE_ROUND if `tag` is no request's current
    tag but an older one of some request; else None."""
    codes = [self._classify(rid, tag, tags) for rid in index]
    if None in codes:
      return None
    older = [c for c in codes if c != Code.BAD_SEQUENCE]
    return older[0] if older else None

  def _classify(self, rid, tag, tags):
    """None if `tag` is the exchange's tag of `rid`, else the refusal code."""
    want = tags.get(rid)
    if want is None:      # a request of no exchange in flight: late if older
      req = self.requests.get(rid)
      want = None if req is None else (req.generation, req.round + 1)
      if want is None or tag >= want:
        return Code.BAD_SEQUENCE
    elif tag > want:
      return Code.BAD_SEQUENCE
    if tag[0] < want[0]:
      return Code.STALE_GENERATION
    return None if tag == want else Code.DUPLICATE_ROUND

  def _message(self, frames, slot, reqs, tags, depth, index, outcome):
    peeked = codec.peek(frames[0]) if frames else None
    late = peeked is not None and self._late(peeked[2:], tags, index)
    if peeked and peeked[0] == Kind.HELLO and len(frames) == 1:
      self.counters.event("late_hellos")   # an answer to an earlier HELLO
      return
    if peeked and peeked[0] == Kind.RESET and len(frames) == 1:
      try:
        reason = Code(int(codec.decode(frames[0], self.caps.bounds
                                       ).body["reason"]))
      except (ProtocolError, ValueError):
        reason = Code.BAD_SEQUENCE
      if late:      # the answer to an exchange that is already over
        self.counters.reject(late, f"late RESET ({reason.name})")
        return
      self.counters.reject(reason, "worker RESET")
      if reason == Code.UNKNOWN_SESSION:
        self._open = False        # the worker restarted: HELLO again
      for rid in index:
        outcome.setdefault(rid, reason)
      return
    try:
      decoded = [codec.decode(f, self.caps.bounds, validate_rows=False)
                 for f in frames]
    except ProtocolError as e:
      # Which exchange a broken message belonged to is unknowable for sure:
      # if it claims an older one, drop it; otherwise discard the batch.
      self.counters.reject(e.code, "reply message")
      if not late:
        for rid in index:
          outcome.setdefault(rid, e.code)
      return
    if not decoded:
      self.counters.reject(Code.BAD_SEQUENCE, "empty message")
      return
    if any(int(f.header["session"]) != self.session for f in decoded):
      self.counters.reject(Code.UNKNOWN_SESSION, "reply of another session")
      return
    start = 0
    for end, f in enumerate(decoded):
      if int(f.header["kind"]) == Kind.COMPLETION:
        self._group(decoded[start:end + 1], frames[start:end + 1], slot,
                    tags, depth, index, outcome)
        start = end + 1
      elif int(f.header["kind"]) != Kind.REPLY:
        break
    if start != len(decoded):
      self.counters.reject(Code.BAD_SEQUENCE, "rows without COMPLETION")
      for rid in index:
        outcome.setdefault(rid, Code.BAD_SEQUENCE)

  def _group(self, group, raw, slot, tags, depth, index, outcome):
    done = group[-1]
    rid = int(done.body["request"])
    tag = (int(done.header["generation"]), int(done.header["round"]))
    code = self._classify(rid, tag, tags)
    if code is not None:
      self.counters.reject(code, f"reply of request {rid} {tag}")
      if code == Code.BAD_SEQUENCE and rid in index:
        outcome.setdefault(rid, code)
      return
    if rid in outcome:          # the same exchange answered twice (a retry)
      self.counters.reject(Code.DUPLICATE_ROUND, f"second reply of {rid}")
      return
    try:
      self._stage(group, raw, slot, index[rid], rid, tag, depth)
      outcome[rid] = None
    except ProtocolError as e:
      self.counters.reject(e.code, f"request {rid}")
      outcome[rid] = e.code

  def _stage(self, group, raw, slot, i, rid, tag, depth):
    done, rows = group[-1], group[:-1]
    req = self.requests[rid]
    status = int(done.body["status"])
    if status:
      raise ProtocolError(status if status in Code._value2member_map_ else
                          Code.BAD_SEQUENCE, "worker refused the STEP")
    if (int(done.body["anchor"]), int(done.body["context_version"])) != (
        req.anchor, req.context_version):
      raise ProtocolError(Code.STATE_MISMATCH, "anchor or context")
    if int(done.body["depth"]) != depth or len(rows) != depth:
      raise ProtocolError(Code.BAD_SEQUENCE, f"{len(rows)} rows, depth "
                          f"{depth}")
    for pos, row in enumerate(rows):
      if (int(row.body["request"]), int(row.body["position"])) != (rid, pos) \
          or (int(row.header["generation"]), int(row.header["round"])) != tag:
        raise ProtocolError(Code.BAD_SEQUENCE, f"row {pos}")
    if int(done.body["reply_bytes"]) != sum(len(r) for r in raw[:-1]):
      raise ProtocolError(Code.UNEXPECTED_SIZE, "reply bytes")
    crc = 0
    for r in raw[:-1]:       # decode checked each frame's CRC: combine them
      crc = codec.frame_crc(r, crc)
    if crc != int(done.body["replies_crc"]):
      raise ProtocolError(Code.CHECKSUM_MISMATCH, "rows vs COMPLETION")
    for pos, row in enumerate(rows):
      token = int(row.body["token"])
      slot.tokens[i, pos] = token
      if self.caps.greedy:
        continue
      n = len(row.values)
      slot.n[i, pos] = n
      if row.ids is None:
        if n != self.caps.vocab:   # checked before the copy, as the bounds
          raise ProtocolError(Code.LENGTH_MISMATCH, f"dense row of {n}")
        slot.values[i, pos] = row.values    # validated below, with the batch
      else:                                 # the same, one numpy batch
        slot.values[i, pos, :n] = row.values
        slot.ids[i, pos, :n] = row.ids

  def _validate_dense(self, slot, reqs, depth, outcome):
    """Validates the staged dense rows of every request still OK."""
    live = [i for i, req in enumerate(reqs) if outcome[req.rid] is None]
    if not live or self.caps.greedy:
      return None
    r = len(reqs)
    dense = self.caps.representation == Representation.DENSE
    if dense:      # only this exchange's requests are read
      counts, ok = staging.dense_rows(slot.device_values, slot.tokens,
                                      requests=r)
      ok = np.asarray(ok)
    else:          # every sparse row of the batch in one numpy pass
      k = slot.values.shape[-1]
      counts, ok = staging.sparse_rows(
          slot.values[:r, :depth].reshape(-1, k),
          slot.ids[:r, :depth].reshape(-1, k), slot.n[:r, :depth].reshape(-1),
          slot.tokens[:r, :depth].reshape(-1), self.caps.vocab)
      slot.counts[:r, :depth] = counts.reshape(r, depth, k)
      ok = ok.reshape(r, depth)
    for i in live:
      for pos in range(depth):
        if not ok[i, pos]:
          n = int(slot.n[i, pos])
          try:  # the exact code of the row (it raises: the rows agree)
            validate_q_row(slot.values[i, pos, :n],
                           None if dense else slot.ids[i, pos, :n],
                           vocab_size=self.caps.vocab,
                           token=int(slot.tokens[i, pos]))
            code = Code.WRONG_MASS   # unreachable if the two agree
          except ProtocolError as e:
            code = e.code
          self.counters.reject(code, f"request {reqs[i].rid} row {pos}")
          outcome[reqs[i].rid] = code
          break
    return counts if dense else None

  def _finish(self, slot, reqs, tags, depth, outcome):
    rids = [req.rid for req in reqs]
    tag_rows = [tags[r] for r in rids]
    if Code.TIMEOUT in outcome.values():
      # The watchdog: the exchange is over; its slot is invalidated before
      # it can be reused and the whole batch falls back.
      self.pool.expire()
      if slot.state != staging.SlotState.FREE:
        self.pool.discard(slot)
      # Counted for every request whose proposal the timeout discards
      # (answered or not); the others were counted with their own code.
      for rid in rids:
        if outcome[rid] in (None, Code.TIMEOUT):
          self.counters.reject(Code.TIMEOUT, f"request {rid}")
      return self.execute(empty_plan(
          self.caps, rids, tag_rows,
          [int(outcome[r] or Code.TIMEOUT) for r in rids], depth))
    dense = self._validate_dense(slot, reqs, depth, outcome)
    self.pool.publish(slot)    # q-ready: every row used below is validated
    self.pool.hold(slot)
    try:
      plan = empty_plan(self.caps, rids, tag_rows,
                        [int(outcome[r] or 0) for r in rids], depth)
      ok = plan.codes == 0
      plan.draft[ok] = slot.tokens[:len(rids), :depth][ok]
      plan.n[ok] = slot.n[:len(rids), :depth][ok]
      if self.caps.greedy or not ok.any():
        pass
      elif self.caps.representation == Representation.DENSE:
        plan.counts[ok] = np.asarray(dense)[:len(rids), :depth][ok]
      else:
        plan.ids[ok] = slot.ids[:len(rids), :depth][ok]
        plan.counts[ok] = slot.counts[:len(rids), :depth][ok]
      return self.execute(plan)
    finally:
      self.pool.done(slot)

  def execute(self, plan):
    """Shares a round's plan with the other ranks (`share_fn`), runs it."""
    if self.share_fn is not None:
      plan = self.share_fn(plan)
    return self._run(plan)

  def follow(self):
    """A follower rank's loop: runs the leader's plans until a stop plan.

    Needs `share_fn`, which on a follower ignores its argument and returns
    the leader's next plan. The follower keeps the same `requests` (add
    them in the same order, with the same prompts and seeds) and commits
    exactly what the leader commits; it never touches the transport.
    """
    rounds = 0
    while True:
      plan = self.share_fn(None)
      if int(plan.stop):
        return rounds
      self._run(plan)
      rounds += 1

  def stop_followers(self):
    """Leader: tells follower ranks that there are no more rounds."""
    if self.share_fn is not None:
      rids = sorted(self.requests)[:self.caps.max_requests]
      plan = empty_plan(self.caps, rids, [(0, 0)] * len(rids),
                        [0] * len(rids), self.caps.max_depth)
      self.share_fn(plan._replace(stop=np.ones((), np.int32)))

  def _run(self, plan):
    results = []
    for i, rid in enumerate(plan.rids):
      if int(rid) not in self.requests and self.request_factory:
        self.add_request(int(rid), *self.request_factory(int(rid)))
      req = self.requests[int(rid)]
      tag = (int(plan.tags[i, 0]), int(plan.tags[i, 1]))
      req.generation, req.round = tag     # a follower mirrors the leader
      if plan.codes[i]:
        results.append(self._target_only(req, tag, Code(int(plan.codes[i]))))
      else:
        results.append(self._verify(req, tag, plan, i))
    return results

  def _verify(self, req, tag, plan, i):
    draft = plan.draft[i].copy()
    logits = self.target_fn(np.asarray(req.tokens, np.int32), draft)
    if self.caps.greedy:
      accepted, token = greedy_verify(logits, draft)
    else:
      if self.caps.representation == Representation.DENSE:
        q = verification.DenseQ(plan.counts[i])
      else:
        q = verification.SparseQ(plan.ids[i], plan.counts[i], plan.n[i])
      key = rng.round_key(req.seed, tag[0], tag[1])
      accepted, token, status = self.verify_fn(logits, q, draft, key,
                                               anchor=req.anchor)
      accepted, token = int(accepted), int(token)
      if int(status) != Status.OK:
        raise DyadicError("verify_fn", int(status), [req.rid], [int(status)])
    committed = tuple(int(t) for t in draft[:accepted]) + (token,)
    return self._apply(req, tag, committed, accepted, None)

  def _target_only(self, req, tag, code):
    """The fallback: one token from the target alone, then a new generation."""
    logits = self.target_fn(np.asarray(req.tokens, np.int32),
                            np.zeros(0, np.int32))
    key = rng.draw_key(rng.round_key(req.seed, tag[0], tag[1]), req.anchor,
                      rng.Domain.TARGET_ONLY)
    token, status = self.sample_fn(logits[0], key)
    raise_for_status("sample_fn", status)
    result = self._apply(req, tag, (int(token),), 0, code)
    req.generation, req.round = tag[0] + 1, 0
    self.counters.event("fallbacks")
    return result

  def _apply(self, req, tag, committed, accepted, code):
    anchor = req.anchor
    req.tokens.extend(committed)
    req.digest = digest_lib.extend(req.digest, committed)
    self.counters.event("rounds")
    self.counters.event("tokens", len(committed))
    return RoundResult(req.rid, tag[0], tag[1], anchor, committed, accepted,
                       code is not None, code)

  def _commit(self, results):
    frames = []
    for res in results:
      frames.append(codec.encode(
          Kind.COMMIT, session=self.session, generation=res.generation,
          round_id=res.round, version=self.caps.mode, body={
              "request": res.rid, "accepted": res.accepted,
              "status": int(res.code or 0), "fallback": int(res.fallback),
              "next_token": res.committed[-1],
              "new_position": res.anchor + len(res.committed)}))
    if self.endpoint is not None:
      self.counters.event("bytes_out", sum(len(f) for f in frames))
      self.endpoint.send(frames)

  def reset(self, rid=None):
    """Cancels request `rid` (all when None): new generation, RESET sent."""
    targets = list(self.requests) if rid is None else [rid]
    for r in targets:
      req = self.requests[r]
      req.generation, req.round = req.generation + 1, 0
    if self.endpoint is not None:
      self.endpoint.send([codec.encode(
          Kind.RESET, session=self.session,
          generation=self.requests[r].generation, round_id=0,
          version=self.caps.mode, body={"request": r, "reason": 0})
                          for r in targets])
    self.counters.event("resets")

  def log(self):
    logging.info("verifier counters: %s", self.counters.snapshot())
