"""What a process that only reaches the worker's port costs it (issue 40,
item 5; docs/security.md, "Connections and handshakes below the bridge").

  python -m experiments.idle_flood [--connections=19000] [--replay_s=10]

Starts a bridge worker (experiments.bridge_worker, a toy draft, CURVE on,
a throwaway key set) on loopback and reports, from /proc:

* idle connections: its RSS idle, with --connections TCP connections open
  that send nothing, and after they all closed (libzmq frees what it held
  for them; what the allocator keeps is the cost that stays);
* a replayed HELLO: one CURVE greeting and HELLO recorded from a real
  verifier's connection, sent again on a new connection in a loop for
  --replay_s seconds (each answered with a WELCOME, never admitted): the
  worker's CPU (share of one core) idle and under the replay.

Bounded: at most --connections connections (each a file descriptor on
both sides: the default stays under a 20,000 descriptor limit), a fixed
settle time per step, --replay_s seconds of replay.
"""

import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import flags

from experiments import cli

_CONNECTIONS = flags.DEFINE_integer(
    "connections", 19000, "Idle connections opened at once.", lower_bound=1,
    upper_bound=100000)
_REPLAY_S = flags.DEFINE_float(
    "replay_s", 10.0, "Seconds of HELLO replay (and of idle CPU measured).",
    lower_bound=0.5, upper_bound=120.0)
_SETTLE_S = flags.DEFINE_float(
    "settle_s", 3.0, "Seconds left to the worker's I/O thread after each "
    "step (open, close) before its RSS is read.", lower_bound=0.0,
    upper_bound=60.0)

cli.parse_flags_early(__name__)

# pylint: disable=g-import-not-at-top,wrong-import-position
import zmq

from dyadic_jax.bridge import keys as keys_lib
from dyadic_jax.bridge import transport
# pylint: enable=g-import-not-at-top,wrong-import-position


def rss_mb(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  raise RuntimeError("no VmRSS")


def cpu_s(pid: int) -> float:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pid: int, seconds: float) -> float:
  start, t0 = cpu_s(pid), time.monotonic()
  time.sleep(seconds)
  return (cpu_s(pid) - start) / (time.monotonic() - t0)


def record_hello(curve: transport.Curve) -> bytes:
  """What a verifier sends on a new connection before the server's
  answer: its ZMTP greeting and its CURVE HELLO command, recorded by a
  listener that answers with a CURVE server greeting."""
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen()
  port = listener.getsockname()[1]
  endpoint = transport.Endpoint.connect(
      f"tcp://127.0.0.1:{port}", max_message=transport.HELLO_MESSAGE,
      curve=curve)
  conn, _ = listener.accept()
  conn.settimeout(10)
  greeting = (b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0])
              + b"CURVE".ljust(20, b"\x00") + b"\x01" + bytes(31))
  conn.sendall(greeting)
  got = b""
  while len(got) < 64 + 202:       # greeting, then HELLO: 0x04 200 ...
    chunk = conn.recv(4096)
    if not chunk:
      break
    got += chunk
  conn.close()
  endpoint.close()
  listener.close()
  return got


def replay(port: int, hello: bytes, stop: threading.Event,
           counts: list[int]) -> None:
  while not stop.is_set():
    s = socket.socket()
    try:
      s.connect(("127.0.0.1", port))
      s.sendall(hello)
      if select.select([s], [], [], 1.0)[0]:
        s.recv(4096)
      counts[0] += 1
    except OSError:
      pass
    finally:
      s.close()


def main(argv):
  del argv
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  need = _CONNECTIONS.value + 256
  if soft < need:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
  with tempfile.TemporaryDirectory(prefix="idle_flood-") as tmp:
    keys_dir = keys_lib.make(os.path.join(tmp, "keys"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.bridge_worker",
         "--address=tcp://127.0.0.1:0", f"--keys_dir={keys_dir}"],
        stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_NOFILE, (min(need, hard), hard)))
    try:
      line = proc.stdout.readline().split()
      if line[:1] != ["READY"]:
        cli.fail(f"the worker did not start: {line}")
      port = int(line[1].rsplit(":", 1)[1])
      time.sleep(_SETTLE_S.value)
      idle = rss_mb(proc.pid)
      conns = []
      for _ in range(_CONNECTIONS.value):
        s = socket.socket()
        s.connect(("127.0.0.1", port))
        conns.append(s)
      time.sleep(_SETTLE_S.value)
      held = rss_mb(proc.pid)
      for s in conns:
        s.close()
      del conns
      time.sleep(_SETTLE_S.value)
      after = rss_mb(proc.pid)
      print(f"idle connections: {_CONNECTIONS.value}; worker RSS idle "
            f"{idle:.1f} MB, with them open {held:.1f} MB (+{held - idle:.1f}),"
            f" after they closed {after:.1f} MB (+{after - idle:.1f})")
      hello = record_hello(keys_lib.load(keys_dir, "verifier").curve)
      quiet = cpu_share(proc.pid, _REPLAY_S.value)
      stop, counts = threading.Event(), [0]
      thread = threading.Thread(target=replay,
                                args=(port, hello, stop, counts))
      thread.start()
      busy = cpu_share(proc.pid, _REPLAY_S.value)
      stop.set()
      thread.join()
      print(f"replayed HELLO ({len(hello)} bytes recorded): "
            f"{counts[0] / _REPLAY_S.value:.0f} connections/s; worker CPU "
            f"{quiet:.0%} of a core idle, {busy:.0%} under the replay; RSS "
            f"after {rss_mb(proc.pid):.1f} MB; zmq {zmq.zmq_version()}")
    finally:
      proc.terminate()
      proc.wait(30)


if __name__ == "__main__":
  cli.run(main)
