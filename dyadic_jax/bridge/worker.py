"""The worker driver: a `WorkerSession` behind a ZeroMQ ROUTER.

The protocol lives in `worker_session.WorkerSession` (sans I/O); this
driver only moves bytes and draws proposals: it receives a message, hands
it to the session, calls the proposer for every `Propose` (writing into
the REPLY frame's rows), lets the session seal the answer, and sends it.
A proposer with a stopping rule (`DraftProposer.admission`) makes the
session accept `Feature.ADAPTIVE_DEPTH` where the verifier offers it; on
such a session each proposal is drawn under the rule (1..depth rows,
without `out`), copied into the frame's first rows, and its length handed
to `WorkerSession.finish` (a short REPLY).
A proposer that raises (a local bug, a refused draft row) is answered with
a COMPLETION whose status is PROPOSER_FAILED: counted, never fatal. Zero-
copy sends are tracked; a slot is reported released once ZeroMQ let go of
it, and nothing here ever waits for that (the session takes a new buffer).

Run it as its own process with `serve_forever`; `experiments/bridge_worker.py`
is the command-line entry point.
"""

import threading
import time
import typing

from absl import logging
import numpy as np
import zmq

from dyadic_jax.bridge import drafting, hello
from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Call, Propose, Send
from dyadic_jax.bridge.transport import Curve, Endpoint
from dyadic_jax.bridge.worker_session import WorkerSession
from dyadic_jax.wire import layouts, qformats
from dyadic_jax.wire.refusals import Code


class DrawHook:
  """Told before the worker draws (no-ops here): a tensor-parallel worker's
  leader tells its other ranks, which draw with it
  (`rank_links.ProposalBroadcast`). batched: whether the worker may draw a
  message's proposals in one batched call (the ranks draw one by one)."""

  batched = True

  def warmup(self, depth: int) -> None:
    """Before the warm-up draw (a throwaway seed, `depth` rows)."""

  def draw(self, p: Propose) -> None:
    """Before proposal `p` is drawn."""


class Worker:
  """Serves proposals for a verifier. Not thread safe: one loop owns it."""

  def __init__(self, caps: hello.Capabilities,
               propose_fn: drafting.Proposer, *,
               secret: bytes | None, counters: Counters | None = None,
               max_views: int = 4096,
               draw_hook: DrawHook | None = None,
               wants_context: bool | None = None) -> None:
    """secret: the deployment secret (32 bytes; `bridge.keys`) or None
    (`--insecure`: nothing is authenticated). draw_hook: told before every
    draw (default: nobody). wants_context: accept CONTEXT frames, so the
    proposer is handed each request's committed prefix (`context=`);
    None (default): as the proposer's draft says (`DraftProposer.
    wants_context`: True for the transformer pair's). False for a draft
    that drafts from the prefix is a ValueError: it would draft without
    it (exact tokens, but fewer accepted)."""
    # Its optional capabilities (batched draws, a stopping rule, the
    # context) declared.
    self.propose = drafting.declared(propose_fn)
    wanted = self.propose.wants_context
    if wants_context is None:
      wants_context = wanted
    elif wanted and not wants_context:
      raise ValueError("Worker: the proposer's draft drafts from the "
                       "committed prefix; wants_context=False would leave "
                       "it without (leave wants_context out, or True)")
    self.caps = caps
    self.draw_hook = draw_hook or DrawHook()
    self.session = WorkerSession(
        caps, secret=secret, counters=counters, max_views=max_views,
        wants_context=wants_context,
        wants_adaptive=self.propose.admission is not None)
    self._trackers: dict[int, list[zmq.MessageTracker]] = {}

  @property
  def counters(self) -> Counters:
    return self.session.counters

  @property
  def max_message(self) -> int:
    """The largest message this worker accepts (ZMQ_MAXMSGSIZE)."""
    return self.session.max_message

  def warmup(self, max_context: int = 128) -> None:
    """Compiles the proposer before the first STEP (a STEP must not wait
    for a compile past the verifier's deadline). The draws use a seed no
    request is given (2^64 - 1) and are thrown away. With wants_context,
    also draws after contexts of 2, 3, 5, ..., max_context + 1 tokens, so
    a draft that catches up in chunks of power-of-two sizes (a KV cache's
    prompt fill, a round's one or two committed tokens) has compiled each
    one; and, where the proposer draws a batch in one call (`batched`),
    a full batch after each of them."""
    self.draw_hook.warmup(self.caps.max_depth)
    self.propose(2 ** 64 - 1, 0, 0, 0, 0, self.caps.max_depth)
    if not self.session.wants_context:
      return
    many = self._batch_draw()
    # The batched draw's throwaway requests: ids no verifier gives.
    rids = [layouts.ALL_REQUESTS - 1 - i
            for i in range(self.caps.max_requests)]
    n = 1
    while n <= max_context:
      context = np.zeros(n + 1, np.int32)
      self.propose(2 ** 64 - 1, 0, 0, n + 1, 0, self.caps.max_depth,
                   context=context)
      if many is not None:
        # The batched draw too (`_draw_many`), a full batch, each span.
        many([Call(2 ** 64 - 1, 0, 0, n + 1, 0, rid, context)
              for rid in rids], self.caps.max_depth)
        for rid in rids:
          self.propose.forget(rid)
      n *= 2

  def handle(self, message: layouts.Buffer) -> list[Send]:
    """Answers one message: the list of `Send`s (no socket involved)."""
    answer = self.session.receive(message)
    failed: dict[int, int] = {}
    lengths: dict[int, int] = {}
    if self._draw_many(answer.propose):
      return self.session.finish(answer, failed)
    for p in answer.propose:
      start = time.perf_counter()
      try:
        d = self.draw(p)
        if p.adaptive and d != p.depth:
          lengths[p.entry] = d
      except Exception as e:  # pylint: disable=broad-except
        # The proposer is local code: its failure fails this request's
        # round (a counted fallback on both sides), never the worker.
        logging.log_every_n_seconds(logging.ERROR, "proposer failed: %r",
                                    1.0, e)
        failed[p.entry] = Code.PROPOSER_FAILED
      self.counters.event("propose_us",
                          int((time.perf_counter() - start) * 1e6))
    return self.session.finish(answer, failed, lengths)

  def _batch_draw(self) -> typing.Callable[..., typing.Any] | None:
    """The proposer's batched draw (`many` of a `drafting.DraftProposer`
    whose draft has a slab: `batched`), or None where the worker draws
    one by one (any other proposer, or a draw hook whose ranks draw with
    each proposal)."""
    if not (self.propose.batched and self.draw_hook.batched):
      return None
    return self.propose.many

  def _draw_many(self, props: typing.Sequence[Propose]) -> bool:
    """Draws every proposal of a STEP message in one batched draft call
    (`_batch_draw`) when each holds its request's committed prefix and
    all have one depth; False (nothing drawn) otherwise, or when the batch call fails:
    then each is drawn alone, so a failure fails its own request only.
    The rows are those of the per-request draws (the same keys)."""
    many = self._batch_draw()
    if (many is None or len(props) < 2 or any(p.adaptive for p in props)
        or any(p.context is None for p in props)
        or len({p.depth for p in props}) != 1):
      return False
    start = time.perf_counter()
    try:
      drawn = many([p.call for p in props], props[0].depth)
    except Exception as e:  # pylint: disable=broad-except
      logging.log_every_n_seconds(logging.ERROR, "batched draw failed, "
                                  "drawing one by one: %r", 1.0, e)
      return False
    for p, rows in zip(props, drawn):
      _put(p.rows, rows)
    self.counters.event("propose_us",
                        int((time.perf_counter() - start) * 1e6))
    self.counters.event("batched_draws")
    return True

  def draw(self, p: Propose) -> int:
    """Draws one proposal into its REPLY rows (the draw hook first);
    returns its rows: the STEP's depth, or on an adaptive session
    (`Propose.adaptive`) the 1..depth its proposer's rule admitted."""
    self.draw_hook.draw(p)
    if not p.adaptive:
      self.propose(p.seed, p.generation, p.round, p.anchor, p.last_token,
                   p.depth, out=p.rows, request=p.request, context=p.context)
      return p.depth
    # Without `out` the proposer's rule decides the length.
    drawn = self.propose(p.seed, p.generation, p.round, p.anchor,
                         p.last_token, p.depth, request=p.request,
                         context=p.context)
    _put(p.rows, drawn)
    return len(drawn.tokens)

  def _release(self) -> None:
    for slot, trackers in list(self._trackers.items()):
      if all(t.done for t in trackers):
        del self._trackers[slot]
        self.session.released(slot)

  def serve(self, endpoint: Endpoint, stop: threading.Event | None = None,
            idle_s: float = 0.05) -> None:
    """Answers messages on `endpoint` until `stop` (an Event) is set."""
    stop = stop or threading.Event()
    endpoint.counters = endpoint.counters or self.counters
    while not stop.is_set():
      self._release()
      got = endpoint.recv(idle_s)
      if got is None:
        continue
      peer, message = got
      # The worker's busy time (its message answered and sent): what two
      # rounds in flight hide behind the verifier's work.
      start = time.perf_counter()
      for send in self.handle(message):
        sent, tracker = endpoint.send(send.message, peer)
        if send.slot is None:
          continue
        if sent and tracker is not None:
          self._trackers.setdefault(send.slot, []).append(tracker)
        elif send.slot not in self._trackers:
          self.session.released(send.slot)
      self.counters.event("busy_us",
                          int((time.perf_counter() - start) * 1e6))


def _put(into: qformats.Rows, rows: qformats.Rows) -> None:
  """Copies a proposal of d rows into the first d of a frame's rows."""
  d = len(rows.tokens)
  for name in ("tokens", "n", "ids", "values"):
    dst = getattr(into, name)
    if dst is not None:
      dst[:d] = getattr(rows, name)


def serve_forever(caps: hello.Capabilities,
                  propose_fn: drafting.Proposer, address: str,
                  *, secret: bytes | None, curve: Curve | None = None,
                  ready: typing.Callable[[str], None] | None = None,
                  on_exit: typing.Callable[["Worker"], None] | None = None,
                  draw_hook: DrawHook | None = None,
                  wants_context: bool | None = None,
                  stop: threading.Event | None = None) -> None:
  """Binds `address` and serves until interrupted (SystemExit, Ctrl-C) or
  `stop` (an Event, e.g. a signal's flag) is set.

  ready(address) is called once the proposer is compiled and the socket
  bound; on_exit(worker) when the loop ends, whatever ended it.
  draw_hook: the Worker's (a tensor-parallel worker's leader passes a
  `rank_links.ProposalBroadcast`). wants_context: the Worker's (the
  proposer gets each request's committed prefix).
  """
  worker = Worker(caps, propose_fn, secret=secret, draw_hook=draw_hook,
                  wants_context=wants_context)
  endpoint = Endpoint.bind(address, max_message=worker.max_message,
                           curve=curve, counters=worker.counters)
  worker.warmup()
  logging.info("worker listening on %s", endpoint.address)
  try:
    # Inside: a signal the moment READY is out still reports the counters.
    if ready:
      ready(endpoint.address)
    worker.serve(endpoint, stop)
  except (SystemExit, KeyboardInterrupt):
    pass
  finally:
    worker.counters.log()
    if on_exit:
      on_exit(worker)
    endpoint.close()
