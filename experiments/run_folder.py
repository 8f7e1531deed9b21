"""A run's private folder, and the reaping of folders that dead runs left.

    from experiments import run_folder
    with run_folder.folder("pp1-") as tmp:     # 0700, removed on exit
      ...

A leader keeps its throwaway keys, sockets and logs in a 0700 folder that
it removes on the way out, SIGTERM and SIGINT included. A SIGKILL (or a
crash of the interpreter) gives it no way out: the folder stays, with the
secret keys in it (issue 50, item 5). So each folder carries a record of
its leader (`LEADER`: its pid, the process's start time and its pid
namespace), and `folder` first removes the folders of its own kind
(`prefix`, in the same parent) whose leader is gone: no process with that
pid, or one with another start time (the pid reused). A folder is only
ever removed when all of these hold: it is a directory (not a link) owned
by this user, named with the prefix, its record readable and recorded
from this pid namespace (a leader in another container sharing the
folder cannot be seen, so it is left alone), and its leader dead. A
folder without a record (still being made, or an older version's) is
kept.

No JAX, no absl (`interrupt` only).
"""

import contextlib
import os
import shutil
import stat
import tempfile
import typing

from experiments import interrupt

LEADER = "leader"    # the record's file name inside the folder


def _start_time(pid: int) -> str | None:
  """Process `pid`'s start time (clock ticks since boot; /proc/PID/stat
  field 22), or None if there is no such process."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None
  return fields[19] if len(fields) > 19 else None


def _namespace() -> str:
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return "unknown"


def record() -> str:
  """This process's record: "<pid> <start time> <pid namespace>"."""
  pid = os.getpid()
  return f"{pid} {_start_time(pid)} {_namespace()}\n"


def _is_dead(text: str) -> bool:
  """Whether the leader of record `text` is gone (False when unsure)."""
  parts = text.split()
  if len(parts) != 3 or not parts[0].isdigit() or parts[2] != _namespace():
    return False
  return _start_time(int(parts[0])) != parts[1]


def stale(prefix: str, parent: str | None = None) -> list[str]:
  """The folders named `prefix`* under `parent` (default: the temporary
  directory) that a dead leader of this user left (see the docstring)."""
  parent = parent or tempfile.gettempdir()
  found = []
  try:
    names = os.listdir(parent)
  except OSError:
    return []
  for name in names:
    if not name.startswith(prefix):
      continue
    path = os.path.join(parent, name)
    try:
      info = os.lstat(path)
      if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        continue
      with open(os.path.join(path, LEADER)) as f:
        text = f.read(256)
    except OSError:
      continue
    if _is_dead(text):
      found.append(path)
  return found


def reap(prefix: str, parent: str | None = None) -> list[str]:
  """Removes `stale(prefix, parent)`; returns the folders removed."""
  removed = []
  for path in stale(prefix, parent):
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
      removed.append(path)
  return removed


def make(prefix: str, parent: str | None = None) -> str:
  """A fresh 0700 folder `prefix`* under `parent` (default: the temporary
  directory) with this process's record (the caller removes it); the
  folders dead leaders of the same kind left there are removed first."""
  reap(prefix, parent)
  path = tempfile.mkdtemp(prefix=prefix, dir=parent)
  try:
    with open(os.path.join(path, LEADER), "w") as f:
      f.write(record())
  except BaseException:
    shutil.rmtree(path, ignore_errors=True)
    raise
  return path


@contextlib.contextmanager
def folder(prefix: str, parent: str | None = None
           ) -> typing.Iterator[str]:
  """`make(prefix, parent)`, removed on exit, and by a signal's stop even
  when the program is ended before it unwinds (`interrupt`'s watchdog)."""
  path = make(prefix, parent)
  undo = interrupt.on_interrupt(
      lambda: shutil.rmtree(path, ignore_errors=True))
  try:
    yield path
  finally:
    undo()
    shutil.rmtree(path, ignore_errors=True)
