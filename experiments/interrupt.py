"""SIGTERM and SIGINT end a program at once: its cleanups, one line, exit.

    from experiments import interrupt
    interrupt.install()           # first, before JAX starts a thread
    ...
    undo = interrupt.on_interrupt(lambda: shutil.rmtree(tmp))

`install` blocks both signals in the calling thread (every thread started
after it inherits the mask, JAX's and XLA's included) and waits for them
in a thread of its own (`signal.sigwait`). So the signal is seen at once
even while the main thread sits in native code (a compile, a collective,
jax.distributed's rendezvous) where a Python handler would only run after
it returns, and no native handler can swallow it: in a multi-process run
JAX's preemption notifier caught SIGTERM and the run went on 113 s past
its limit. On a signal the thread runs the registered cleanups (newest
first; each one's error ignored), prints one line `<program>: stopped by
SIGTERM` on stderr and exits with status 128 + the signal's number, as a
shell reports a program killed by it, without Python's shutdown (which
would wait for the threads that native code holds).

A child process inherits the blocked mask through exec: every program
this project starts calls `install` (or `as_exit`) itself, so it handles
the signal once it runs (until then the signal stays pending, not lost).

`as_exit` is for a program whose main loop wakes often and has a way out
of its own (the worker: it prints its counters on the way): both signals
unblocked, each a SystemExit(0) in the main thread.

`unwind` is what every other entry point gets (`cli.run` calls it): the
signal is sent on to this process's children and raised in the main
thread as `Stopped`, so its `finally` and `with` blocks remove what they
made (temporary folders, keys, workers); `cli.run` then kills any child
still there, prints the one line and exits 128 + the signal. Before, a
SIGTERM killed bench_pair at once and left its worker running and its
folder of keys behind; Ctrl-C printed a traceback.
"""

import os
import signal
import sys
import threading
import typing


SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_cleanups: list[typing.Callable[[], None]] = []
_installed = False        # a mode chosen: install, as_exit or unwind


class Stopped(BaseException):
  """SIGTERM or SIGINT, raised in the main thread by `unwind`'s handler (a
  BaseException: no `except Exception` takes it for an error)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum



def program() -> str:
  """The running experiment's short name (pp1_pipeline, round_demo ...)."""
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  name = spec.name if spec is not None else os.path.basename(sys.argv[0])
  return name.rsplit(".", 1)[-1].removesuffix(".py")

def install() -> None:
  """Blocks SIGINT and SIGTERM here and handles them in a thread (above).
  Call it from the main thread before any other thread starts."""
  global _installed
  if _installed:
    return
  _installed = True
  # A thread started before this call (numpy's BLAS pool, if something
  # imported it) can still take the signal: then the main thread stops.
  for signum in SIGNALS:
    signal.signal(signum, lambda signum, _: stop(signum))
  signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
  threading.Thread(target=_wait, name="interrupt", daemon=True).start()


def as_exit() -> None:
  """SIGINT and SIGTERM unblocked (a parent's mask is inherited), each a
  SystemExit(0) in the main thread: a quiet end, no traceback."""
  global _installed
  _installed = True
  for signum in SIGNALS:
    signal.signal(signum, lambda *_: sys.exit(0))
  signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def unwind() -> None:
  """Unless a mode is chosen: SIGINT and SIGTERM unblocked, each sent on to
  the children and raised as `Stopped` in the main thread (above); a
  second one while it unwinds is ignored, so the cleanups finish."""
  global _installed
  if _installed:
    return
  _installed = True

  def handler(signum, frame):
    del frame
    for s in SIGNALS:
      signal.signal(s, signal.SIG_IGN)
    signal_children(signal.SIGTERM)
    raise Stopped(signum)
  for signum in SIGNALS:
    signal.signal(signum, handler)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def children(parent: int | None = None) -> list[int]:
  """The pids of the live children of `parent` (default: this process),
  from /proc."""
  me, found = os.getpid() if parent is None else parent, []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    if int(fields[1]) == me and fields[0] != "Z":
      found.append(int(entry))
  return found


def signal_children(signum: int) -> None:
  """Sends `signum` to every child (each handles it: ends, removes what it
  made); one already gone is skipped."""
  for pid in children():
    try:
      os.kill(pid, signum)
    except OSError:
      pass


def on_interrupt(cleanup: typing.Callable[[], None]
                 ) -> typing.Callable[[], None]:
  """Registers `cleanup` to run on a signal; returns what unregisters it."""
  with _lock:
    _cleanups.append(cleanup)

  def undo() -> None:
    with _lock:
      if cleanup in _cleanups:
        _cleanups.remove(cleanup)
  return undo


def stop(signum: int) -> typing.NoReturn:
  """The cleanups, the line, the exit (what a signal does)."""
  with _lock:
    cleanups = list(reversed(_cleanups))
    _cleanups.clear()
  for cleanup in cleanups:
    try:
      cleanup()
    except Exception:  # pylint: disable=broad-except
      pass      # the next one still runs: an interrupted run leaves nothing
  sys.stderr.write(f"{program()}: stopped by "
                   f"{signal.Signals(signum).name}\n")
  sys.stderr.flush()
  os._exit(128 + signum)   # pylint: disable=protected-access


def _wait() -> None:
  stop(signal.sigwait(SIGNALS))
