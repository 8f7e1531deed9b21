"""SIGTERM and SIGINT always end a program: its cleanups, one line, exit.

    from experiments import interrupt
    interrupt.install()           # first, before JAX starts a thread
    ...
    undo = interrupt.on_interrupt(lambda: shutil.rmtree(tmp))

Every mode blocks both signals in the calling thread (every thread started
after it inherits the mask, JAX's and XLA's included) and waits for them
in a thread of its own (`signal.sigwait`). So the signal is seen at once
even while the main thread sits in native code (a compile, a collective,
jax.distributed's rendezvous) where a Python handler would only run after
it returns, and no native handler can swallow it: in a multi-process run
JAX's preemption notifier caught SIGTERM and the run went on 113 s past
its limit. No mode raises an exception from a signal handler: one raised
there can land in whatever code the main thread runs, and where that is a
garbage-collector callback (JAX's `_xla_gc_callback`), a `__del__` or a
weakref callback, Python prints "Exception ignored" and goes on (issue
51: a worker given SIGTERM in its warm-up compiled for 6 more minutes and
ignored a second SIGTERM). A signal sets a flag instead (`requested`,
`stopping`); the programs' loops look at it (`check` raises `Stopped` at
that safe point); and a watchdog ends the process if they have not within
`grace_s()` seconds (DYADIC_JAX_STOP_GRACE_S, default 5): the registered
cleanups (newest first; each one's error ignored), the children killed,
one line `<program>: stopped by SIGTERM` on stderr and exit status 128 +
the signal's number, as a shell reports a program killed by it, without
Python's shutdown (which would wait for the threads that native code
holds). A second signal ends the process at once, the same way.

The modes differ in what the first signal does at once:

* `install` (the pipeline, whose cleanups stop its children and remove
  its folder): the cleanups, the line and the exit, at once.
* `unwind` (what every other entry point gets: `cli.run` calls it): the
  signal is sent on to this process's children, the flag set, the
  watchdog started. `cli.run` turns a `Stopped` (a loop's `check`), or
  anything else the main thread ends with while a stop is asked for (a
  child gone, its pipe closed), into the same end: the children killed,
  the line, 128 + the signal; the `finally` and `with` blocks it unwinds
  remove what they made (temporary folders, keys, workers).
* `as_exit` (a program whose main loop wakes often and has a way out of
  its own: the worker, whose loop watches `stopping()` and prints its
  counters on the way): the flag and the watchdog only; the program ends
  its loop and returns (status 0).

A child process inherits the blocked mask through exec: every program
this project starts chooses a mode itself (until then the signal stays
pending, not lost).
"""

import os
import signal
import sys
import threading
import typing


SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.RLock()   # a handler in the main thread may take it
_cleanups: list[typing.Callable[[], None]] = []
_installed = False        # a mode chosen: install, as_exit or unwind


class Stopped(BaseException):
  """SIGTERM or SIGINT, raised in the main thread by `check` at a loop's
  safe point (a BaseException: no `except Exception` takes it for an
  error)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum



def program() -> str:
  """The running experiment's short name (pp1_pipeline, round_demo ...)."""
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None:
    return spec.name.rsplit(".", 1)[-1]
  return os.path.basename(sys.argv[0]).removesuffix(".py")

GRACE_ENV = "DYADIC_JAX_STOP_GRACE_S"
DEFAULT_GRACE_S = 5.0
_requested = threading.Event()
_signum = 0               # the first signal's number, once _requested
_mode = ""                # "install", "as_exit" or "unwind"


def grace_s() -> float:
  """Seconds the watchdog gives the loops after a signal
  (DYADIC_JAX_STOP_GRACE_S, a number >= 0; default 5)."""
  try:
    grace = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
  except ValueError:
    return DEFAULT_GRACE_S
  return grace if 0.0 <= grace < float("inf") else DEFAULT_GRACE_S


def requested() -> bool:
  """Whether SIGTERM or SIGINT asked this program to stop."""
  return _requested.is_set()


def stopping() -> threading.Event:
  """The Event a signal sets (a loop may wait on it, or pass it as its
  stop event)."""
  return _requested


def signum() -> int:
  """The number of the signal that asked for the stop (0: none)."""
  return _signum


def unwinding() -> bool:
  """Whether a signal asked for a stop that `cli.run` is to finish (the
  `unwind` mode's; the worker's `as_exit` loop returns on its own)."""
  return _requested.is_set() and _mode == "unwind"


def check() -> None:
  """Raises `Stopped` if a signal asked for a stop: a loop's safe point,
  in the main thread."""
  if _requested.is_set():
    raise Stopped(_signum)


def _choose(mode: str) -> bool:
  """Chooses `mode` unless one is chosen; starts the waiting thread."""
  global _installed, _mode
  if _installed:
    return False
  _installed, _mode = True, mode
  # A thread started before this call (numpy's BLAS pool, if something
  # imported it) can still take a signal: its Python handler, which runs
  # in the main thread, only hands it on (it never raises).
  for signum_ in SIGNALS:
    signal.signal(signum_, lambda signum_, _: _request(signum_))
  signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
  threading.Thread(target=_wait, name="interrupt", daemon=True).start()
  return True


def install() -> None:
  """Blocks SIGINT and SIGTERM here and handles them in a thread (above);
  a signal stops the program at once. Call it from the main thread before
  any other thread starts."""
  _choose("install")


def as_exit() -> None:
  """The worker's mode: a signal sets `stopping()`, which its loop
  watches; the watchdog ends it if the loop does not (above)."""
  _choose("as_exit")


def unwind() -> None:
  """Unless a mode is chosen: a signal is sent on to the children, sets
  the flag and starts the watchdog (above; `cli.run` ends the program)."""
  _choose("unwind")


def _request(signum_: int) -> None:
  """What a signal does (the waiting thread's, or a handler's)."""
  global _signum
  with _lock:
    first = not _requested.is_set()
    if first:
      _signum = signum_
      _requested.set()
  if not first or _mode == "install":
    stop(signum_)          # a second signal: at once
  if _mode == "unwind":
    signal_children(signal.SIGTERM)
  watchdog = threading.Timer(grace_s(), stop, args=(signum_,))
  watchdog.name, watchdog.daemon = "interrupt-watchdog", True
  watchdog.start()


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


_stopping = threading.Lock()     # one stop runs; a second caller waits


def stop(signum: int) -> typing.NoReturn:
  """The cleanups, the children killed, the line, the exit (what a signal
  does, at once or from the watchdog; any thread may call it)."""
  _stopping.acquire()    # never released: the process ends below
  with _lock:
    cleanups = list(reversed(_cleanups))
    _cleanups.clear()
  for cleanup in cleanups:
    try:
      cleanup()
    except Exception:  # pylint: disable=broad-except
      pass      # the next one still runs: an interrupted run leaves nothing
  # A child that has not ended by now (it ignored SIGTERM) is killed.
  signal_children(signal.SIGKILL)
  sys.stderr.write(f"{program()}: stopped by "
                   f"{signal.Signals(signum).name}\n")
  sys.stderr.flush()
  os._exit(128 + signum)   # pylint: disable=protected-access


def _wait() -> None:
  while True:
    _request(signal.sigwait(SIGNALS))
