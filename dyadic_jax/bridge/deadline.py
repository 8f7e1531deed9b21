"""An exchange deadline that follows the measured round time.

A fixed deadline must be chosen for the slowest machine a run will meet:
too short, and a healthy but loaded run times out (its late answers then
come back as STALE_GENERATION) and falls back to the target alone; too
long, and every lost exchange costs that long. `AdaptiveDeadline` gives
each exchange `factor` times the median time of the last `window` exchanges
that were answered in full, clamped to [floor_s, ceiling_s] (the floor
while none has been). The first exchange of a session gets at least
`first_s` (default: factor x the floor, at most the ceiling): it pays for
what the first round of a fresh peer does once, and has nothing measured
to go by. Only answered exchanges count (a lost one says nothing about the
machine), so a dead link keeps the floor and a slow machine gets a longer
deadline, up to the ceiling.

Pure Python, no clock: the drivers (`Verifier`, `rank_links.ShardReceiver`)
ask `seconds()` when an exchange begins, report `observe(elapsed)` when one
was answered in full, and `new_session()` when a session opens.
"""

import collections
import statistics


class AdaptiveDeadline:
  """factor x the median of recent answered exchanges, in [floor, ceiling].

  Attributes:
    floor_s, ceiling_s: the bounds (ceiling_s >= floor_s).
    first_s: the least deadline of a session's first exchange.
    used: (min, max) of the deadlines handed out so far, or None.
  """

  def __init__(self, floor_s: float, ceiling_s: float, *,
               factor: float = 4.0, window: int = 32,
               first_s: float | None = None):
    if not 0.0 < floor_s <= ceiling_s < float("inf"):
      raise ValueError(f"AdaptiveDeadline: need 0 < floor_s {floor_s} <= "
                       f"ceiling_s {ceiling_s} < inf")
    if not factor >= 1.0 or window < 1:
      raise ValueError("AdaptiveDeadline: factor >= 1 and window >= 1")
    self.floor_s = float(floor_s)
    self.ceiling_s = float(ceiling_s)
    self.factor = float(factor)
    self._recent: collections.deque[float] = collections.deque(
        maxlen=window)
    self.first_s = min(max(factor * floor_s if first_s is None
                           else first_s, floor_s), ceiling_s)
    self._fresh = True      # the next exchange is a session's first
    self.used: tuple[float, float] | None = None

  def seconds(self) -> float:
    """The deadline of the exchange that begins now."""
    typical = statistics.median(self._recent) if self._recent else 0.0
    out = min(max(self.factor * typical, self.floor_s), self.ceiling_s)
    if self._fresh:
      out, self._fresh = max(out, self.first_s), False
    lo, hi = self.used or (out, out)
    self.used = (min(lo, out), max(hi, out))
    return out

  def new_session(self) -> None:
    """A session opened (a fresh peer, perhaps): its first exchange gets
    at least `first_s`."""
    self._fresh = True

  def observe(self, seconds: float) -> None:
    """An exchange was answered in full after `seconds`."""
    if seconds >= 0.0:
      self._recent.append(float(seconds))

  def figures(self) -> dict[str, float | None]:
    """floor, ceiling and the range handed out, for a run's record."""
    lo, hi = self.used or (None, None)
    return {"floor_s": self.floor_s, "ceiling_s": self.ceiling_s,
            "first_s": self.first_s, "factor": self.factor, "min_s": lo,
            "max_s": hi}
