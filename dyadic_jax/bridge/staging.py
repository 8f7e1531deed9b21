"""Slots: preallocated host buffers for one batch of q rows each.

A slot is sized once from the negotiated `Capabilities` (HELLO) and reused:
values float32[R, D, width] (64-byte aligned, so that JAX on CPU can read
it without a copy), ids int32[R, D, width] (sparse), tokens int32[R, D].
Two dense slots at V = 129280, R = 4, D = 5 hold 20,684,800 bytes of q.

Life of a slot (one exchange):

    FREE --acquire(tag, deadline)--> FILLING --publish()--> READY
    READY --hold()/done() by each consumer--> FREE once none is left
    FILLING past its deadline --expire()--> INVALID --> FREE (the watchdog)

Rows are copied in only after their frame's framing checks passed and are
consumable only after `publish`, which the verifier calls once every row
of the batch was validated. `expire` (the watchdog) runs before every
`acquire`, so a timed-out exchange is invalidated before its buffers can be
reused; the caller turns the expired tags into new generations.
"""

import enum
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax import x64
from dyadic_jax.constants import M
from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.layouts import Representation


class SlotState(enum.IntEnum):
  FREE = 0
  FILLING = 1
  READY = 2
  INVALID = 3


def aligned_empty(shape, dtype, alignment=64):
  """An uninitialized numpy array whose data starts on `alignment` bytes."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  start = (-raw.ctypes.data) % alignment
  return raw[start:start + nbytes].view(dtype).reshape(shape)


class Slot:
  """One batch's buffers and its state (see the module docstring)."""

  def __init__(self, index, caps):
    r, d, w = caps.max_requests, caps.max_depth, caps.width
    self.index = index
    self.values = aligned_empty((r, d, w), np.float32)
    sparse = caps.representation == Representation.SPARSE
    self.ids = aligned_empty((r, d, w), np.int32) if sparse else None
    self.counts = np.zeros((r, d, w), np.int32) if sparse else None
    self.n = np.zeros((r, d), np.int32)
    self.tokens = np.zeros((r, d), np.int32)
    self.state = SlotState.FREE
    self.tag = None          # (request, generation, round) of each request
    self.deadline = None
    self.consumers = 0
    self._device_values = None

  @property
  def device_values(self):
    """`values` as a JAX array on the same memory (CPU), made once.

    Kept with the slot: a view made per call is released by an XLA worker
    thread after the computation; when that release races with interpreter
    shutdown, jaxlib calls std::terminate (exit status 134, in ~10-30% of
    short runs that exit right after dense_rows).
    """
    if self._device_values is None:
      self._device_values = jax.dlpack.from_dlpack(self.values)
    return self._device_values

  @property
  def nbytes(self):
    return sum(a.nbytes for a in (self.values, self.ids) if a is not None)


class SlotPool:
  """The `max_slots` slots of a session, with preflight and a watchdog."""

  def __init__(self, caps, clock):
    self.caps = caps
    self._clock = clock
    self._lock = threading.Lock()
    self.slots = [Slot(i, caps) for i in range(caps.max_slots)]

  @property
  def nbytes(self):
    return sum(s.nbytes for s in self.slots)

  def preflight(self, requests, depth):
    """Refuses a batch shape the slots were not sized for (no state change)."""
    if not 1 <= requests <= self.caps.max_requests or not (
        1 <= depth <= self.caps.max_depth):
      raise ProtocolError(Code.ABSURD_LENGTH, f"{requests} requests x depth "
                          f"{depth}; slots hold {self.caps.max_requests} x "
                          f"{self.caps.max_depth}")

  def expire(self):
    """The watchdog: invalidates FILLING slots past their deadline.

    Returns the tags of the expired exchanges (the caller starts new
    generations for them); their slots are FREE again afterwards.
    """
    now = self._clock()
    expired = []
    with self._lock:
      for slot in self.slots:
        if slot.state == SlotState.FILLING and now >= slot.deadline:
          slot.state = SlotState.INVALID
          expired.append(slot.tag)
          self._free(slot)
    return expired

  def acquire(self, tag, timeout):
    """A FREE slot for an exchange tagged `tag`, FILLING until `timeout`."""
    self.expire()
    with self._lock:
      for slot in self.slots:
        if slot.state == SlotState.FREE:
          slot.state, slot.tag = SlotState.FILLING, tag
          slot.deadline = self._clock() + timeout
          slot.n[:] = 0
          return slot
    raise RuntimeError("SlotPool: every slot is in use (more exchanges in "
                       f"flight than the {len(self.slots)} negotiated)")

  def publish(self, slot):
    """FILLING -> READY: every row was validated; consumers may read it."""
    with self._lock:
      if slot.state != SlotState.FILLING:
        raise ProtocolError(Code.TIMEOUT, f"slot {slot.index} expired")
      slot.state = SlotState.READY

  def hold(self, slot):
    with self._lock:
      if slot.state != SlotState.READY:
        raise RuntimeError(f"slot {slot.index} is {slot.state.name}")
      slot.consumers += 1

  def done(self, slot):
    """One consumer finished; the last one frees the slot."""
    with self._lock:
      slot.consumers -= 1
      if slot.consumers == 0:
        self._free(slot)

  def discard(self, slot):
    """Abandons a FILLING or READY slot whose exchange failed."""
    with self._lock:
      if slot.consumers:
        raise RuntimeError(f"slot {slot.index} still has consumers")
      self._free(slot)

  @staticmethod
  def _free(slot):
    slot.state, slot.tag, slot.deadline, slot.consumers = (SlotState.FREE,
                                                           None, None, 0)


@functools.partial(jax.jit, static_argnums=2)
def _dense_rows(values, tokens, requests):
  # s = q * 2^24 is exact; a row is valid iff every s is an integer in
  # [0, 2^24] (NaN and inf fail the range test), the integers sum to exactly
  # 2^24, and the sampled token has a nonzero count. One reduction checks
  # the entries and the sum: a bad entry adds 2^25 (> 2^24; every term is
  # >= 0), and a float64 sum of V <= 2^21 integers <= 2^25 is exact in any
  # order (< 2^53). XLA:CPU reduces floats several times faster than int64.
  values, tokens = values[:requests], tokens[:requests]  # fused: not read
  s = values * jnp.float32(M)
  in_range = (s >= 0) & (s <= M)
  counts = jnp.where(in_range, s, 0).astype(jnp.int32)
  entry_ok = in_range & (counts.astype(jnp.float32) == s)
  total = jnp.sum(jnp.where(entry_ok, s, jnp.float32(2 * M)).astype(
      jnp.float64), axis=-1)
  vocab = values.shape[-1]
  in_vocab = (tokens >= 0) & (tokens < vocab)
  at_token = jnp.take_along_axis(
      counts, jnp.clip(tokens, 0, vocab - 1)[..., None], axis=-1)[..., 0]
  ok = (total == M) & in_vocab & (at_token > 0)
  return counts, ok


@x64.scoped
def dense_rows(values, tokens, requests=None):
  """Validates a batch of dense q rows at once: (counts, ok).

  values: float32[R, ..., V] (a JAX array such as `Slot.device_values`, or
  numpy: aligned arrays are read without a copy on CPU); tokens
  int32[R, ...]; requests: validate only values[:requests] (default all R;
  each value compiles once). ok[...] is True exactly where
  `wire.validate_q_row(values[...], None, vocab_size=V, token=...)` would
  return instead of raising (tests/test_bridge.py and
  tests/test_bridge_fastpaths.py check this on every rejection class);
  counts int32[..., V] are the counts there. The
  caller asks `validate_q_row` for the code of a row that is not ok.
  """
  values = jnp.asarray(values) if not isinstance(values, np.ndarray) else (
      jax.dlpack.from_dlpack(values) if values.ctypes.data % 64 == 0
      and values.flags.c_contiguous else jnp.asarray(values))
  requests = values.shape[0] if requests is None else int(requests)
  return _dense_rows(values, jnp.asarray(tokens, jnp.int32), requests)



def sparse_rows(values, ids, n, tokens, vocab):
  """Validates a batch of sparse q rows at once (numpy): (counts, ok).

  values float32[B, k], ids int32[B, k], n int32[B] (entries per row; the
  rest is padding), tokens int32[B]. ok[b] is True exactly where
  `wire.validate_q_row(values[b, :n[b]], ids[b, :n[b]], vocab_size=vocab,
  token=tokens[b])` would return; counts[b, :n[b]] are its counts there.
  The caller asks `validate_q_row` for the code of a row that is not ok.
  """
  k = values.shape[-1]
  live = np.arange(k) < n[:, None]
  ok = (n >= 1) & (tokens >= 0) & (tokens < vocab)
  ok &= ~np.any(live & ((ids < 0) | (ids >= vocab)), axis=-1)
  ok &= ~np.any(live[:, 1:] & (ids[:, 1:] <= ids[:, :-1]), axis=-1)
  v = np.where(live, values, np.float32(0))
  with np.errstate(invalid="ignore"):
    ok &= np.all((v >= 0) & (v <= 1), axis=-1)     # NaN fails both
    s = v * np.float32(M)                          # exact: a power of two
    ok &= np.all(np.floor(s) == s, axis=-1)
  counts = np.where(ok[:, None], s, 0).astype(np.int32)
  ok &= counts.sum(axis=-1, dtype=np.int64) == M
  ok &= np.where(live & (ids == tokens[:, None]), counts, 0).sum(axis=-1) > 0
  return counts, ok
