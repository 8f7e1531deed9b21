"""The run's wall clock: named phases that add up to the wall time.

`START` is taken when the entry point imports this module (first), so the
wall time runs from the program's start; the interpreter's own start is
before it.
"""

import contextlib
import time
import typing

from experiments import cli
from experiments.pp1 import flags

START = time.perf_counter()   # the wall clock starts with the program


class Stopwatch:
  """Named phases of the wall time; a phase nested in another is not
  counted twice (the outer one gets only its own, exclusive time), except
  inside an absorbing phase, which claims all of its time (the compile
  warm-up runs the timed round functions)."""

  def __init__(self, start: float):
    self.start = start
    self.end: float | None = None
    self.seconds: dict[str, float] = {}
    self._open: list[typing.Any] = []   # [name, start, nested s, absorb]

  @contextlib.contextmanager
  def phase(self, name: str, *, absorb: bool = False,
            since: float | None = None) -> typing.Iterator[None]:
    """Counts the block's time in phase `name` (from `since` if given: a
    phase that began before the block, e.g. with the imports)."""
    if any(frame[3] for frame in self._open):
      yield                  # an absorbing phase counts it
      return
    begun = time.perf_counter() if since is None else since
    frame: list[typing.Any] = [name, begun, 0.0, absorb]
    self._open.append(frame)
    try:
      yield
    finally:
      self._open.pop()
      elapsed = time.perf_counter() - frame[1]
      self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - frame[2]
      if self._open:
        self._open[-1][2] += elapsed

  def timed(self, name: str, fn: typing.Callable[..., typing.Any],
            block: typing.Callable[[typing.Any], typing.Any] = lambda out: out
            ) -> typing.Callable[..., typing.Any]:
    """fn, with its calls (until `block` returns) counted in phase `name`."""
    def call(*args: typing.Any, **kwargs: typing.Any) -> typing.Any:
      with self.phase(name):
        return block(fn(*args, **kwargs))
    return call

  def stop(self) -> None:
    self.end = time.perf_counter()

  @property
  def wall(self) -> float:
    return (self.end or time.perf_counter()) - self.start


def say(text: str) -> None:
  """A progress line of the leader's start-up (stderr, with the progress
  bar), stamped with the time since START: the run is never silent while
  it starts, compiles or waits. Follower ranks (--rank >= 1) stay quiet."""
  if not flags.RANK.value:
    cli.progress(f"{text} [{time.perf_counter() - START:.1f} s]")
