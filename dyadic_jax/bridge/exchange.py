"""One round in flight on the verifier, as a value with an explicit state.

An `Exchange` is made by `VerifierSession.begin` when a round's STEP
message is made, and lives until the round's `Verify`. Its lifecycle is
one table (in the manner of h11's `_state.py`): each event names the
states it may leave and where it goes; anything else is an
`ExchangeError`, a bug of the session, never a peer's doing (every frame
is routed to an exchange only where the table allows it).

    SENT --ANSWER--> ANSWERING --ANSWER--> ANSWERING
    SENT, ANSWERING --STAGE--> STAGED --VERDICT--> DONE
    SENT, ANSWERING --FALL_BACK--> FAILED     (deadline, or all refused)

A request's answer, whichever frame carried it (a REPLY with its
COMPLETION, or a PACKED record), is judged by one cascade (`judge`): the
worker's status (a known Code, or BAD_STATUS), then anchor and context
(STATE_MISMATCH), then the frame's own defect (a REPLY's: its rows of
another request, tag or depth, BAD_SEQUENCE; its size, UNEXPECTED_SIZE;
its tag against the COMPLETION's, CHECKSUM_MISMATCH), then its depth
(BAD_SEQUENCE); then its rows are copied into the staging slot. A PACKED
answer's records are compared with the expected ones at once
(`take_packed`): when all match (the usual answer) the q rows are staged
in place in the received message, else those that match are copied in
bulk and any other record is judged alone. On a session that agreed on
ADAPTIVE_DEPTH an answer may carry d in [1, depth] rows (`fits`);
elsewhere any depth but the exchange's is BAD_SEQUENCE.

Drivers read an exchange and never write it: a deadline is the session's
input (`begin`'s `timeout_s`, `expire`).

No socket, clock or JAX here (tests/test_layers.py).
"""

import math
import typing

import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax.bridge import hello, staging
from dyadic_jax.bridge.effects import Counts, Plan
from dyadic_jax.wire import codec, layouts, qformats
from dyadic_jax.wire.refusals import Code

_RECORDS_AT = layouts.FIXED_BYTES[layouts.Kind.PACKED]   # PACKED records

__all__ = ["Event", "Exchange", "ExchangeError", "State", "TRANSITIONS",
           "empty_plan"]


# States and events are plain strings, as h11's are sentinels: the table is
# looked up twice a round, and an Enum member hashes in Python.
class State:
  SENT = "sent"             # STEP made, nothing answered yet
  ANSWERING = "answering"   # some requests answered (or refused)
  STAGED = "staged"         # a Stage was handed out: awaits `staged`
  DONE = "done"             # its verdicts made a Plan
  FAILED = "failed"         # fell back whole: deadline, or all refused


class Event:
  ANSWER = "answer"         # one or more requests answered or refused
  STAGE = "stage"           # answered in full, rows handed out to judge
  VERDICT = "verdict"       # the judged rows made its Plan
  FALL_BACK = "fall_back"   # its Plan without any verification


# state -> {event: next state}; what is not here is an ExchangeError.
TRANSITIONS: dict[str, dict[str, str]] = {
    State.SENT: {Event.ANSWER: State.ANSWERING, Event.FALL_BACK: State.FAILED},
    State.ANSWERING: {Event.ANSWER: State.ANSWERING,
                      Event.STAGE: State.STAGED,
                      Event.FALL_BACK: State.FAILED},
    State.STAGED: {Event.VERDICT: State.DONE},
    State.DONE: {},
    State.FAILED: {},
}


class ExchangeError(RuntimeError):
  """An event the exchange's state does not allow (a session bug)."""


def empty_plan(caps: hello.Capabilities, rids: typing.Sequence[int],
               tags: typing.Sequence[tuple[int, int]], codes: ArrayLike,
               depth: int, lengths: ArrayLike | None = None,
               key: int = 0) -> Plan:
  """A Plan of R requests with zero drafts and no q (codes say what to
  do); each chain `depth` rows long unless `lengths` says otherwise; key:
  its round's number."""
  r = len(rids)
  ids = (np.zeros((r, depth, caps.width), np.int32) if caps.format.has_ids
         else None)
  rows = qformats.Rows(np.zeros((r, depth), np.int32),
                       np.zeros((r, depth), np.int32), ids)
  return Plan(np.asarray(rids, np.int32),
              np.asarray(tags, np.int64).reshape(r, 2),
              np.asarray(codes, np.int32), rows, None, np.zeros((), np.int32),
              np.full(r, depth, np.int32) if lengths is None
              else np.asarray(lengths, np.int32).reshape(r), key)


class Exchange:
  """The round in flight: its tags, deadline, staging slot and per-request
  outcome (what a driver's round hook is shown: read only)."""

  def __init__(self, rids: typing.Sequence[int],
               tags: dict[int, tuple[int, int]], depth: int, deadline: float,
               slot: staging.Slot, key: int, expected: bytes,
               step_tag: bytes, adaptive: bool = False) -> None:
    """expected: the PACKED records a worker answers with when all is well,
    in STEP order (reserved fields zero); step_tag: the tag of its first
    STEP frame (what a worker's refusal is keyed by); adaptive: the
    session agreed on ADAPTIVE_DEPTH (an answer may be 1..depth rows)."""
    self.key = key                # which of the session's exchanges
    self.rids = list(rids)
    self.index = {rid: i for i, rid in enumerate(rids)}
    self.tags = tags              # rid -> (generation, round)
    self.depth = depth
    self.deadline = deadline
    self.slot = slot
    self.state = State.SENT
    self.adaptive = adaptive
    r = len(rids)
    self.answered = np.zeros(r, bool)
    self.codes = np.zeros(r, np.int32)
    self.lengths = np.full(r, depth, np.int32)    # rows each answer carries
    self.rows = slot.rows(r, depth)
    # The usual answer's records are these bytes (one comparison); the
    # table, for the field-by-field one.
    self.expected_bytes = expected
    self.expected = np.frombuffer(expected, layouts.PACKED_RECORD)
    self.step_tag = step_tag

  # -- the state table -------------------------------------------------------

  def fire(self, event: str) -> str:
    """Moves along the table (`Event` -> `State`); ExchangeError where it
    has no such edge."""
    nxt = TRANSITIONS[self.state].get(event)
    if nxt is None:
      raise ExchangeError(f"exchange {self.key}: {event} while "
                          f"{self.state}")
    self.state = nxt
    return nxt

  @property
  def open(self) -> bool:
    """Answers may still land (not staged, not ended)."""
    return self.state in (State.SENT, State.ANSWERING)

  @property
  def staging(self) -> bool:
    return self.state == State.STAGED

  @property
  def complete(self) -> bool:
    return bool(self.answered.all())

  def expire(self) -> None:
    """No answer can come any more: the next `poll` fails it."""
    self.deadline = -math.inf

  # -- answers ---------------------------------------------------------------

  def refuse(self, index: typing.Any, code: int) -> None:
    """Requests `index` answered with refusal `code` (not counted here)."""
    self.fire(Event.ANSWER)
    self.answered[index], self.codes[index] = True, code

  def refuse_open(self, code: int) -> None:
    """Every unanswered request refused with `code`."""
    if not self.complete:
      self.refuse(np.flatnonzero(~self.answered), code)

  def fits(self, depth: np.ndarray | int) -> np.ndarray:
    """Whether an answer of `depth` rows fits: the STEP's depth, or 1..that
    on a session that agreed on ADAPTIVE_DEPTH."""
    depth = np.asarray(depth)
    if self.adaptive:
      return (depth >= 1) & (depth <= self.depth)
    return depth == self.depth

  def judge(self, i: int, status: int, anchor: int, context_version: int,
            depth: int, defect: tuple[int, str] | None
            ) -> tuple[int, str] | None:
    """The refusal (code, why) of request i's answer, or None if its rows
    may be taken: the one cascade of every frame that carries an answer.
    defect: what the carrying frame itself got wrong (checked after the
    status and the committed view, before the depth)."""
    if status:
      return (Code.parse(status) or Code.BAD_STATUS,
              f"the worker refused the STEP (status {status})")
    want = self.expected[i]
    if (anchor, context_version) != (int(want["anchor"]),
                                     int(want["context_version"])):
      return Code.STATE_MISMATCH, "anchor or context"
    if defect is not None:
      return defect
    if not self.fits(depth):
      return Code.BAD_SEQUENCE, "depth"
    return None

  def take(self, into: typing.Any, rows: qformats.Rows, src: typing.Any,
           lengths: typing.Any = None) -> None:
    """Copies the answer rows `src` of `rows` into this slot's `into`."""
    self.fire(Event.ANSWER)
    staged = self.rows
    staged.tokens[into] = rows.tokens[src]
    staged.n[into] = rows.n[src]
    if rows.ids is not None and staged.ids is not None:
      staged.ids[into] = rows.ids[src]
    if rows.values is not None and staged.values is not None:
      staged.values[into] = rows.values[src]
    if lengths is not None:
      self.lengths[into] = lengths
    self.answered[into] = True

  def take_row(self, i: int, rows: qformats.Rows, depth: int) -> None:
    """Request i's answer of `depth` rows (a REPLY's)."""
    self.fire(Event.ANSWER)
    staged = self.rows
    self.lengths[i] = depth
    staged.tokens[i, :depth] = rows.tokens
    staged.n[i, :depth] = rows.n
    if rows.ids is not None and staged.ids is not None:
      staged.ids[i, :depth] = rows.ids
    if rows.values is not None and staged.values is not None:
      staged.values[i, :depth] = rows.values
    self.answered[i] = True

  def take_in_place(self, rows: qformats.Rows,
                    lengths: typing.Any = None) -> None:
    """Every record of a PACKED answer as expected: its q rows are staged
    where they arrived (no copy; validation reads them once, and a dense
    row's counts, which verification reads, are written by validation into
    their own buffer); tokens, n and ids are copied into the slot."""
    if rows.values is not None and self.rows.values is not None:
      self.rows = self.rows._replace(values=rows.values)
      rows = rows._replace(values=None)
    self.take(slice(None), rows, slice(None), lengths)

  def take_packed(self, f: codec.Frame) -> typing.Iterable[typing.Any]:
    """Takes the records of PACKED answer `f` that are the expected ones,
    in bulk; returns the indices of the others (each to be judged alone)."""
    records, rows = f.records, f.rows
    assert records is not None and rows is not None   # decoded PACKED
    r = len(records)
    if r == len(self.rids) and f.body.depth == self.depth and (
        f.raw[_RECORDS_AT:_RECORDS_AT + len(self.expected_bytes)]
        == self.expected_bytes) and not self.answered.any():
      # Every record the expected one, byte for byte (the usual answer): the
      # field comparisons below would all hold.
      self.take_in_place(rows)
      return ()
    good = np.zeros(r, bool)
    if f.body.depth == self.depth:
      m = min(r, len(self.rids))
      # Field by field: a reserved field is not the worker's to fill.
      good[:m] = ~self.answered[:m]
      for name in ("request", "status", "generation", "round", "anchor",
                   "context_version"):
        good[:m] &= records[name][:m] == self.expected[name][:m]
      good[:m] &= self.fits(records["depth"][:m])
    if good.all() and r == len(self.rids):
      self.take_in_place(rows, records["depth"])  # reserved fields apart
      return ()
    if good.any():
      index = np.flatnonzero(good)
      self.take(index, rows, index, records["depth"][index])
    return np.flatnonzero(~good)

  # -- the end ---------------------------------------------------------------

  def plan(self, caps: hello.Capabilities, counts: Counts = None) -> Plan:
    """Its Plan (the verdict's `counts`, or none: every request falls
    back); moves to DONE or FAILED."""
    self.fire(Event.VERDICT if self.staging else Event.FALL_BACK)
    plan = empty_plan(caps, self.rids, [self.tags[r] for r in self.rids],
                      self.codes, self.depth, self.lengths, self.key)
    ok = plan.codes == 0
    if ok.any():
      rows = plan.rows
      # Whole copies when every request verifies (the usual round): a
      # masked copy costs several times more on a small batch.
      take: typing.Any = slice(None) if ok.all() else ok
      rows.tokens[take] = self.rows.tokens[take]
      rows.n[take] = self.rows.n[take]
      if rows.ids is not None and self.rows.ids is not None:
        rows.ids[take] = self.rows.ids[take]
      # Counts stay as validated (a JAX array, perhaps split over a mesh):
      # only the rows of requests whose code is 0 are ever read.
      plan = plan._replace(counts=counts)
    return plan
