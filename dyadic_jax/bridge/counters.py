"""Counters: one per rejection `Code`, plus named events, thread safe.

Every refusal the bridge makes is counted here by code and logged once, so
that a snapshot accounts for every fault a run saw (DESIGN.md section 5).
Events count what is not an error: rounds, commits, fallbacks, retries
served from the reply cache, resyncs, reconnects.
"""

import collections
import threading

from absl import logging

from dyadic_jax.wire.errors import Code


class Counters:
  """Error counts by `Code` and event counts by name."""

  def __init__(self, name="bridge"):
    self.name = name
    self._lock = threading.Lock()
    self._errors = collections.Counter()
    self._events = collections.Counter()

  def reject(self, code, detail=""):
    """Counts one refusal of class `code` (a `Code`) and logs it."""
    code = Code(code)
    with self._lock:
      self._errors[code] += 1
    # Rate-limited: a fault storm must not turn into a log storm.
    logging.log_every_n_seconds(logging.WARNING, "%s: refused %s %s", 1.0,
                                self.name, code.name, detail)

  def event(self, name, n=1):
    with self._lock:
      self._events[name] += n

  def errors(self, code):
    with self._lock:
      return self._errors[Code(code)]

  def events(self, name):
    with self._lock:
      return self._events[name]

  def snapshot(self):
    """{"errors": {code name: n}, "events": {name: n}} (nonzero entries)."""
    with self._lock:
      return {"errors": {c.name: n for c, n in sorted(self._errors.items())},
              "events": dict(sorted(self._events.items()))}

  def log(self):
    logging.info("%s counters: %s", self.name, self.snapshot())
