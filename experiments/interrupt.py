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
"""

import os
import signal
import sys
import threading
import typing

from experiments import cli

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_cleanups: list[typing.Callable[[], None]] = []
_installed = False


def install() -> None:
  """Blocks SIGINT and SIGTERM here and handles them in a thread (above).
  Call it from the main thread before any other thread starts."""
  global _installed
  if _installed:
    return
  _installed = True
  signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
  threading.Thread(target=_wait, name="interrupt", daemon=True).start()


def as_exit() -> None:
  """SIGINT and SIGTERM unblocked (a parent's mask is inherited), each a
  SystemExit(0) in the main thread: a quiet end, no traceback."""
  for signum in SIGNALS:
    signal.signal(signum, lambda *_: sys.exit(0))
  signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


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
  sys.stderr.write(f"{cli.program()}: stopped by "
                   f"{signal.Signals(signum).name}\n")
  sys.stderr.flush()
  os._exit(128 + signum)   # pylint: disable=protected-access


def _wait() -> None:
  stop(signal.sigwait(SIGNALS))
