"""The worker's reply slots: preallocated buffers its answers are drawn into.

`max_slots` buffers, each sized once from the negotiated bounds (after the
first HELLO), taken in turn. A slot's epoch counts its reuses: a request's
cached answer is (slot, epoch, start, end), void once the slot is taken
again, so a retry resends the same bytes while they are still there and
nothing else. A slot whose last message the transport still holds when it
comes round again is replaced, not waited for (`slots_reclaimed`): a peer
that never reads costs at most what the transport queues for it.

No socket, clock or JAX here (tests/test_layers.py).
"""

from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.effects import Send
from dyadic_jax.wire import codec, qformats

__all__ = ["ReplySlots"]

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
