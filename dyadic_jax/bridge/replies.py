"""The worker's reply slots: preallocated buffers its answers are drawn into.

`max_slots` buffers, each sized once from the negotiated bounds (after the
first HELLO), taken in turn. A slot's epoch counts its reuses: a request's
cached answer is (slot, epoch, start, end), void once the slot is taken
again, so a retry resends the same bytes while they are still there and
nothing else. A slot whose last message the transport still holds when it
comes round again is replaced, not waited for (`slots_reclaimed`): a peer
that never reads costs at most what the transport queues for it.

A fresh answer is laid out in a slot as the STEPs are taken (its REPLY
frames, or one PACKED frame), drawn into by the driver, then sealed here
(`seal`): each request's rows (d of them for a short answer), its
COMPLETION or PACKED record, the tags.

No socket, clock or JAX here (tests/test_layers.py).
"""

import typing

import numpy as np

from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Propose, Send
from dyadic_jax.wire import auth, codec, qformats
from dyadic_jax.wire.layouts import FIXED_BYTES, Kind
from dyadic_jax.wire.refusals import Code

__all__ = ["Entry", "ReplySlots", "WorkerAnswer"]

_COMPLETION = FIXED_BYTES[Kind.COMPLETION]
# served(request, tag, (slot, epoch, start, end), drafted tokens or None):
# where a request's sealed answer lies (`ledger.Views.served`).
Served = typing.Callable[[int, tuple[int, int], tuple[int, int, int, int],
                          typing.Any], None]


class Entry(typing.NamedTuple):
  """One request's place in a fresh answer (see `ReplySlots.seal`)."""
  request: int
  tag: tuple[int, int]
  start: int                # offset of its REPLY (or lone COMPLETION)
  reply: memoryview | None  # the REPLY frame, None for a refused STEP
  rows: qformats.Rows | None  # its rows (views), or None
  depth: int
  anchor: int
  context: int
  status: int


class WorkerAnswer(typing.NamedTuple):
  """What `WorkerSession.receive` returns: sends now; proposals to draw,
  then `finish`. packed: the PACKED frame the entries' rows live in (a
  packed session; an entry's `start` is then its record)."""
  send: list[Send]
  propose: list[Propose]
  slot: int | None = None
  entries: tuple[Entry, ...] = ()
  packed: codec.Packed | None = None

_Layout = tuple[tuple[int, int], codec.Packed, tuple[qformats.Rows, ...]]


class ReplySlots:
  """The slot buffers, their epochs, which the transport holds, and each
  slot's last PACKED layout."""

  def __init__(self, counters: Counters, bounds: codec.Bounds,
               slots: int) -> None:
    self.counters = counters
    self.bounds = bounds
    self.count = slots
    self.buffers: list[bytearray] | None = None   # after a HELLO
    self.epoch = [0] * slots
    # Per slot, the views of its last PACKED answer's layout: (requests,
    # depth), the frame's views and each request's rows. A batch of the
    # same shape (every round, usually) reuses them (`packed_layout`).
    self.layouts: list[_Layout | None] = [None] * slots
    self.busy = [False] * slots
    self._next = 0

  def allocate(self) -> None:
    """Sized from the agreed (local) bounds, once."""
    if self.buffers is None:
      self.buffers = [bytearray(self.bounds.max_reply_message)
                      for _ in range(self.count)]

  def buffer(self, slot: int) -> bytearray:
    assert self.buffers is not None    # a session exists: its HELLO sized them
    return self.buffers[slot]

  def take(self) -> int:
    """The next slot; every answer cached in it is gone."""
    slot = self._next
    self._next = (slot + 1) % self.count
    if self.busy[slot]:
      # The transport still holds its last message (a peer that does not
      # read): leave that buffer to it, take a new one. No waiting.
      assert self.buffers is not None
      self.buffers[slot] = bytearray(self.bounds.max_reply_message)
      self.layouts[slot] = None    # views of the old buffer
      self.busy[slot] = False
      self.counters.event("slots_reclaimed")
    self.epoch[slot] += 1
    return slot

  def sent(self, slot: int) -> None:
    """A message of `slot` goes to the transport."""
    self.busy[slot] = True

  def released(self, slot: int) -> None:
    """The transport let go of every message sent from `slot`."""
    self.busy[slot] = False

  def cached(self, where: tuple[int, int, int, int] | None
             ) -> tuple[int, int, int] | None:
    """(slot, start, end) of a cached answer (slot, epoch, start, end),
    None once its slot was taken again."""
    if where is None:
      return None
    slot, epoch, start, end = where
    return None if self.epoch[slot] != epoch else (slot, start, end)

  def retries(self, regions: list[tuple[int, int, int]]) -> list[Send]:
    """Sends of cached answers; adjacent regions of one slot go as one
    message (a retried batch is its original message, byte for byte)."""
    merged: list[list[int]] = []
    for slot, start, end in regions:
      if merged and merged[-1] == [slot, start, end]:
        continue      # a PACKED answer: every request's region is the frame
      if merged and merged[-1][0] == slot and merged[-1][2] == start:
        merged[-1][2] = end
      else:
        merged.append([slot, start, end])
    for slot, _, _ in merged:
      self.sent(slot)
    return [Send(memoryview(self.buffer(slot))[start:end], slot)
            for slot, start, end in merged]

  def packed_layout(self, slot: int, requests: int, depth: int
                    ) -> tuple[codec.Packed, tuple[qformats.Rows, ...]]:
    """The views of a PACKED answer of `requests` x `depth` in `slot`'s
    buffer and each request's rows: the slot's last ones when the shape is
    the same (no numpy call), else laid out anew (`codec.packed_layout`).
    One shape is kept per slot: memory stays bounded by the slots."""
    held, buf = self.layouts[slot], self.buffer(slot)
    if held is not None and held[0] == (requests, depth) and (
        held[1].frame.obj is buf):
      return held[1], held[2]
    packed = codec.packed_layout(buf, bounds=self.bounds,
                                 requests=requests, depth=depth)
    each = tuple(codec.select(packed.rows, j) for j in range(requests))
    self.layouts[slot] = ((requests, depth), packed, each)
    return packed, each

  @staticmethod
  def _length(e: Entry, i: int, lengths: dict[int, int],
              adaptive: bool) -> int:
    """Rows entry `i` carries: `lengths[i]` where the driver drew fewer
    than the STEP's depth (a session that agreed on ADAPTIVE_DEPTH: 1..
    depth; anything else is the driver's error: 0, its proposal fails)."""
    d = lengths.get(i, e.depth)
    if d == e.depth or (adaptive and 1 <= d <= e.depth):
      return int(d)
    return 0

  def _seal_packed(self, answer: WorkerAnswer, failed: dict[int, int],
                   lengths: dict[int, int], key: auth.Tagger, adaptive: bool,
                   served: Served) -> list[Send]:
    assert answer.packed is not None and answer.slot is not None
    frame, records, rows = answer.packed
    epoch = self.epoch[answer.slot]
    # The drafted tokens, copied once (each view keeps its request's row
    # of the copy, for the COMMIT), and the records written at once.
    drafted = list(np.array(rows.tokens))
    table = []
    for j, e in enumerate(answer.entries):
      status = e.status or int(failed.get(j, 0))
      d = self._length(e, j, lengths, adaptive)
      if not (status or d):
        status = Code.PROPOSER_FAILED    # a length the session never agreed
      if status and e.status == 0:
        self.counters.reject(status, f"proposal of request {e.request}")
      d = 0 if status else d
      table.append((e.request, d, status, 0, e.tag[0], e.tag[1], e.anchor,
                    e.context))
      if d < e.depth:   # rows past d: zeros, not a previous message's bytes
        for a in rows:
          if a is not None:
            a[j, d:] = 0
      served(e.request, e.tag, (answer.slot, epoch, 0, len(frame)),
             None if status else drafted[j][:d])
    records[:] = table
    auth.seal(frame, key)
    self.sent(answer.slot)
    return list(answer.send) + [Send(frame, answer.slot)]

  def seal(self, answer: WorkerAnswer, failed: dict[int, int],
           lengths: dict[int, int], session: int, key: auth.Tagger,
           adaptive: bool, served: Served) -> list[Send]:
    """Seals a fresh answer of session `session` under `key` once its
    proposals are drawn (`WorkerSession.finish`: failed, lengths);
    `served` is told where each request's answer lies."""
    assert answer.slot is not None
    if answer.packed is not None:
      return self._seal_packed(answer, failed, lengths, key, adaptive,
                               served)
    slot = answer.slot
    buf = memoryview(self.buffer(slot))
    epoch = self.epoch[slot]
    offset = 0
    for i, e in enumerate(answer.entries):
      status = e.status or int(failed.get(i, 0))
      d = self._length(e, i, lengths, adaptive)
      if not (status or d):
        status = Code.PROPOSER_FAILED    # a length the session never agreed
      reply = None if status else e.reply
      tokens = (None if reply is None or e.rows is None
                else np.array(e.rows.tokens[:d]))
      if reply is not None and d < e.depth:
        reply = self._shorten(reply, e, d)
      if reply is not None:
        if e.start != offset:      # an earlier request failed: close the gap
          buf[offset:offset + len(reply)] = bytes(reply)
          reply = buf[offset:offset + len(reply)]
        auth.seal(reply, key)
      elif e.status == 0:
        self.counters.reject(status, f"proposal of request {e.request}")
      start = offset
      offset += 0 if reply is None else len(reply)
      codec.encode(Kind.COMPLETION, session=session, generation=e.tag[0],
                   round_id=e.tag[1], send=key, out=buf[offset:],
                   body={"request": e.request,
                         "depth": 0 if reply is None else d,
                         "status": status,
                         "reply_bytes": 0 if reply is None else len(reply),
                         "anchor": e.anchor, "context_version": e.context,
                         "reply_tag": b"" if reply is None else auth.tag_of(
                             reply)})
      offset += _COMPLETION
      served(e.request, e.tag, (slot, epoch, start, offset), tokens)
    self.sent(slot)
    return list(answer.send) + [Send(buf[:offset], slot)]

  def _shorten(self, reply: memoryview, e: Entry, d: int) -> memoryview:
    """The REPLY of `e` laid out again for its first d rows, in place
    (a REPLY of d rows is shorter, its arrays nearer its start)."""
    assert e.rows is not None
    head = [None if a is None else np.array(a[:d]) for a in e.rows]
    frame, rows = codec.begin_reply(
        reply, bounds=self.bounds, session=codec.header(reply).session,
        generation=e.tag[0], round_id=e.tag[1], request=e.request, depth=d)
    for into, got in zip(rows, head):
      if into is not None and got is not None:
        into[...] = got
    return frame
