"""Counters: one per rejection `Code`, plus named events, thread safe.

Every refusal the bridge makes is counted here by code and logged (rate
limited), so that a snapshot accounts for every fault a run saw
(docs/wire.md, "Counters"). Events count what is not an error: rounds,
commits, fallbacks, retries served from the reply cache, resyncs,
reconnects. Memory is bounded: one entry per `Code` and per event name
(names are this code's, never a peer's).
"""

import collections
import threading

from absl import logging

from dyadic_jax.wire.refusals import Code


class Counters:
  """Error counts by `Code` and event counts by name."""

  def __init__(self, name: str = "bridge", *, log: bool = True) -> None:
    """log: log refusals (rate limited); off for fuzzers and benchmarks."""
    self.name = name
    self._log = log
    self._lock = threading.Lock()
    self._errors: collections.Counter[Code] = collections.Counter()
    self._events: collections.Counter[str] = collections.Counter()

  def reject(self, code: int, detail: str = "") -> None:
    """Counts one refusal of class `code` and logs it.

    Never raises: a value that is not a `Code` (a peer's unknown status or
    reason) is counted as BAD_STATUS.
    """
    parsed = Code.parse(code) if not isinstance(code, Code) else code
    if parsed is None:
      detail = f"unknown code {code!r} {detail}"
      parsed = Code.BAD_STATUS
    with self._lock:
      self._errors[parsed] += 1
    if not self._log:
      return
    # Rate-limited: a fault storm must not turn into a log storm.
    logging.log_every_n_seconds(logging.WARNING, "%s: refused %s %s", 1.0,
                                self.name, parsed.name, detail)

  def event(self, name: str, n: int = 1) -> None:
    with self._lock:
      self._events[name] += n

  def errors(self, code: int) -> int:
    with self._lock:
      return self._errors[Code(code)]

  def total_errors(self) -> int:
    with self._lock:
      return sum(self._errors.values())

  def events(self, name: str) -> int:
    with self._lock:
      return self._events[name]

  def snapshot(self) -> dict[str, dict[str, int]]:
    """{"errors": {code name: n}, "events": {name: n}} (nonzero entries)."""
    with self._lock:
      return {"errors": {c.name: n for c, n in sorted(self._errors.items())},
              "events": dict(sorted(self._events.items()))}

  def log(self) -> None:
    logging.info("%s counters: %s", self.name, self.snapshot())
