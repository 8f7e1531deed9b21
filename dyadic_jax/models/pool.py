"""Several slabs of one model: one per group of requests in flight.

With two rounds in flight the verifier (and the worker) serve two groups
of requests that take turns. One slab of `max_requests` slots would evict
one group's caches to serve the other every round; one slab of twice the
slots would compute a row per slot for every call. A `SlabPool` keeps a
slab per group instead: a call goes to the slab that already holds most
of its requests (else to the one used least recently, made on first
need), and its requests leave the other slabs, so each group keeps its
caches and a call computes its own slab's rows only. Which slab serves a
request changes no row beyond float rounding (a slab rebuilds a request
from its prefix when it has none: slower, never different).

No JAX here: the slabs are the model's (`models.batched`).
"""

import typing

class Held(typing.Protocol):
  """What a pool needs of a slab (`models.TargetBatch` has both)."""

  def holds(self, rid: int) -> bool: ...

  def drop(self, rid: int) -> None: ...


Slab = typing.TypeVar("Slab", bound=Held)


class SlabPool(typing.Generic[Slab]):
  """Up to `count` slabs made by `make()`, routed by the requests of each
  call (see the module docstring). Each slab has `holds(rid)` and
  `drop(rid)` (`models.TargetBatch`'s)."""

  def __init__(self, make: typing.Callable[[], Slab], count: int) -> None:
    if count < 1:
      raise ValueError(f"SlabPool: count must be >= 1, got {count}")
    self._make = make
    self.count = count
    self.slabs: list[Slab] = []     # least recently used first

  def pick(self, rids: typing.Sequence[int]) -> Slab:
    """The slab for a call of requests `rids` (they leave the others)."""
    held = [sum(map(s.holds, rids)) for s in self.slabs]
    if self.slabs and (max(held) > 0 or len(self.slabs) == self.count):
      # The most held; among equals the least recently used.
      slab = self.slabs[held.index(max(held))]
      self.slabs.remove(slab)
    else:
      slab = self._make()
    for other in self.slabs:
      for rid in rids:
        other.drop(rid)
    self.slabs.append(slab)
    return slab

  def drop(self, rid: int) -> None:
    """Forgets request `rid` in every slab."""
    for slab in self.slabs:
      slab.drop(rid)


class TargetPool(SlabPool[typing.Any]):
  """A pool of target slabs that is itself a `models.TargetBatch`."""

  def rows(self, rids: typing.Sequence[int], *args: typing.Any,
           **kwargs: typing.Any) -> typing.Any:
    return self.pick(rids).rows(rids, *args, **kwargs)

  def decode(self, rids: typing.Sequence[int], *args: typing.Any,
             **kwargs: typing.Any) -> typing.Any:
    return self.pick(rids).decode(rids, *args, **kwargs)
