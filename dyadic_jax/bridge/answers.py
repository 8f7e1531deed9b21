"""Routes an authenticated answer's frames to the exchanges in flight.

The verifier session (`verifier_session.VerifierSession`) authenticates a
worker's message and hands its frames here: they are grouped into
answers (a REPLY and its COMPLETION, a lone COMPLETION, or a PACKED
frame), each request's answer goes to the exchange that owns the request
under that tag (`ledger.Ledger.classify`: a stale or duplicate tag is
counted and dropped before anything is copied), and is judged there
(`exchange.Exchange.judge`, `take_packed`). A frame that cannot be
attributed to one request fails the unanswered requests of the exchange
its message answers. Every refusal is counted, none raises.

No socket, clock or JAX here (tests/test_layers.py).
"""

import numpy as np

from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.exchange import Exchange
from dyadic_jax.bridge.ledger import Ledger
from dyadic_jax.wire import codec, layouts
from dyadic_jax.wire.layouts import Kind
from dyadic_jax.wire.refusals import Code, ProtocolError

__all__ = ["Answers"]

_RECORD = layouts.RECORD_STRUCT
_RECORDS_AT = layouts.FIXED_BYTES[Kind.PACKED]   # a PACKED frame's records


class Answers:
  """The verifier's router of answers (see the module docstring)."""

  def __init__(self, ledger: Ledger, exchanges: dict[int, Exchange],
               counters: Counters) -> None:
    self.ledger = ledger
    self.exchanges = exchanges    # the session's, by key, oldest first
    self.counters = counters

  def _fail(self, ex: Exchange, i: int, code: int, detail: str) -> None:
    self.counters.reject(code, detail)
    ex.refuse(i, code)

  def route(self, frames: list[memoryview],
            headers: list[layouts.Header], bounds: codec.Bounds) -> None:
    """Groups an authenticated message into (REPLY?, COMPLETION) answers."""
    decoded: list[tuple[codec.Frame | None, int | None]] = []
    for frame, h in zip(frames, headers):
      try:
        decoded.append((codec.decode(frame, bounds), None))
      except ProtocolError as e:
        decoded.append((None, e.code))
    claims = self._claims(decoded)
    i = 0
    while i < len(decoded):
      got, code = decoded[i]
      kind = headers[i].kind
      if kind == Kind.PACKED:
        if code is not None:
          self._broken(code, headers[i], "PACKED", claims)
          return
        assert got is not None
        self._packed(got)
        i += 1
        continue
      if kind == Kind.REPLY and i + 1 < len(decoded) and (
          headers[i + 1].kind == Kind.COMPLETION):
        reply, reply_code = got, code
        done, done_code = decoded[i + 1]
        i += 2
      elif kind == Kind.COMPLETION:
        reply, reply_code = None, None
        done, done_code = got, code
        i += 1
      else:
        self._broken(Code.BAD_SEQUENCE, headers[i], "rows without COMPLETION"
                     if kind == Kind.REPLY else f"{Kind(kind).name} frame",
                     claims)
        return
      if done_code is not None:
        self._broken(done_code, headers[i - 1], "COMPLETION", claims)
        return
      assert done is not None       # decoded (no code)
      self._answer(reply, reply_code, done)

  def _claims(self, decoded: list[tuple[codec.Frame | None, int | None]]
              ) -> Exchange | None:
    """The exchange a message answers, by the first of its decoded frames
    that names a request of an exchange in flight under that request's
    tag there (a worker answers one STEP message with one message: with
    two rounds in flight the (generation, round) of a header alone can be
    both exchanges')."""
    for got, _ in decoded:
      if got is None:
        continue
      if got.records is not None:
        if not len(got.records):
          continue
        rec = got.records[0]
        rid, tag = int(rec["request"]), (int(rec["generation"]),
                                         int(rec["round"]))
      elif got.kind in (Kind.REPLY, Kind.COMPLETION):
        rid, tag = int(got.body.request), got.tag
      else:
        continue
      ex = self.ledger.owner.get(rid)
      if ex is not None and ex.tags[rid] == tag:
        return ex
    return None

  def _broken(self, code: int, header: layouts.Header, detail: str,
              claims: Exchange | None = None) -> None:
    """An authenticated frame that cannot be attributed to one request:
    it fails every unanswered request of the exchange it claims: the one
    its message answers (`claims`; none when that one is answered in
    full already: another exchange is never failed for it), else the
    oldest open one with a request of its tag, else the oldest open one
    (a worker answers STEP messages in the order they came)."""
    tag = (header.generation, header.round)
    late = self.ledger.late(tag)
    open_ = [ex for ex in self.exchanges.values()
             if ex.open and not ex.complete]
    if claims is not None:
      ex = claims if claims in open_ else None
    else:
      ex = next((e for e in open_ if any(
          e.tags[r] == tag and not e.answered[e.index[r]] for r in e.rids)),
                open_[0] if open_ else None)
    if late or ex is None:
      self.counters.reject(late or code, detail)
      return
    self.counters.reject(code, detail)
    ex.refuse_open(code)

  def _packed(self, f: codec.Frame) -> None:
    """A PACKED answer: records as expected are taken in bulk; the others
    one by one, with the per-frame answer's checks."""
    records, rows = f.records, f.rows
    assert records is not None and rows is not None   # decoded PACKED
    # The first record, as Python ints (decode made sure there is one).
    rid, _, _, _, generation, round_id, _, _ = _RECORD.unpack_from(
        f.raw, _RECORDS_AT)
    if (f.header.generation, f.header.round) != (generation, round_id):
      self._broken(Code.BAD_SEQUENCE, f.header, "PACKED header tag")
      return
    # The exchange its first record's request is in (a worker answers one
    # STEP message with one PACKED frame).
    ex = self.ledger.owner.get(rid)
    left = np.arange(len(records)) if ex is None else ex.take_packed(f)
    for j in left:
      self._record(f, int(j))

  def _record(self, f: codec.Frame, j: int) -> None:
    """Record `j` of a PACKED answer that is not the expected one."""
    records = f.records
    assert records is not None and f.rows is not None
    rec = records[j]
    rid = int(rec["request"])
    tag = (int(rec["generation"]), int(rec["round"]))
    slot = self._open_slot(rid, tag, "record")
    if slot is None:
      return
    ex, i = slot
    depth = int(rec["depth"])
    defect = None if f.body.depth == ex.depth else (Code.BAD_SEQUENCE,
                                                    "depth")
    if self._accept(ex, i, f"request {rid} {tag}", int(rec["status"]),
                    int(rec["anchor"]), int(rec["context_version"]), depth,
                    defect):
      ex.take(np.array([i]), f.rows, np.array([j]), depth)

  def _open_slot(self, rid: int, tag: tuple[int, int],
                 what: str) -> tuple[Exchange, int] | None:
    """(exchange, index) of request `rid` if an answer tagged `tag` may
    fill it; else None, the answer refused and counted (a BAD_SEQUENCE one
    still closes the request's slot, unanswered, with its code)."""
    code = self.ledger.classify(rid, tag)
    ex = self.ledger.owner.get(rid)
    if code is not None:
      self.counters.reject(code, f"{what} of request {rid} {tag}")
      if code == Code.BAD_SEQUENCE and ex is not None and ex.open:
        i = ex.index[rid]
        if not ex.answered[i]:
          ex.refuse(i, code)
      return None
    assert ex is not None         # the tag is its exchange's (_classify)
    i = ex.index[rid]
    if ex.answered[i]:          # the same exchange answered twice (a retry)
      self.counters.reject(Code.DUPLICATE_ROUND, f"second {what} of {rid}")
      return None
    return ex, i

  def _answer(self, reply: codec.Frame | None, reply_code: int | None,
              done: codec.Frame) -> None:
    body = done.body
    rid, tag = body.request, done.tag
    slot = self._open_slot(rid, tag, "reply")
    if slot is None:
      return
    ex, i = slot
    defect: tuple[int, str] | None = None
    if reply_code is not None:
      defect = reply_code, "REPLY"
    elif reply is None or not ex.fits(body.depth) or (
        reply.body.request, reply.tag, reply.body.depth) != (rid, tag,
                                                              body.depth):
      defect = Code.BAD_SEQUENCE, "rows"
    elif body.reply_bytes != len(reply.raw):
      defect = Code.UNEXPECTED_SIZE, "reply bytes"
    elif body.reply_tag != reply.header.tag:
      defect = Code.CHECKSUM_MISMATCH, "REPLY vs COMPLETION"
    if self._accept(ex, i, f"request {rid} {tag}", body.status, body.anchor,
                    body.context_version, body.depth, defect):
      assert reply is not None and reply.rows is not None   # no defect
      ex.take_row(i, reply.rows, body.depth)

  def _accept(self, ex: Exchange, i: int, what: str, status: int,
              anchor: int, context_version: int, depth: int,
              defect: tuple[int, str] | None) -> bool:
    """Whether request i's answer may be taken (`Exchange.judge`); if
    not, it is refused and counted."""
    refusal = ex.judge(i, status, anchor, context_version, depth, defect)
    if refusal is not None:
      self._fail(ex, i, refusal[0], f"{what}: {refusal[1]}")
    return refusal is None
