"""CURVE's cost per round and per side: the batch answer, clear vs CURVE.

  python -m experiments.bench_curve [--json_out=F]

A worker process binds the bridge's own endpoint (`bridge.transport`,
ROUTER) and sends the verifier (this process, DEALER) one batch answer of
the PACKED size per round (docs/wire.md), sparse (k entries a row) and
dense (the whole vocabulary), first in the clear, then with ZeroMQ CURVE
(fresh key pairs, the worker's ZAP handler admitting the verifier's key
alone). Each message is acknowledged before the next is sent, so a round
is one message in flight. Reported per message: the one-way time (median)
and each side's CPU time (getrusage of its process, libzmq's I/O threads
included), each as a ratio to the clear send of the same bytes. The two
sides are separate processes on purpose: in a deployment they are
separate hosts, each with its own budget.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import flags

from experiments import cli

_VOCAB = flags.DEFINE_integer(
    "vocab", cli.DEFAULT_VOCAB, f"Vocabulary size V, 2..{cli.MAX_VOCAB}.",
    lower_bound=2, upper_bound=cli.MAX_VOCAB)
_REQUESTS = flags.DEFINE_integer("requests", 4, "Requests per batch R.",
                                 lower_bound=1, upper_bound=1024)
_DEPTH = flags.DEFINE_integer("depth", 5, "Drafted rows per request D.",
                              lower_bound=1, upper_bound=255)
_K = flags.DEFINE_integer("k", 32, "Entries per sparse row (<= --vocab).",
                          lower_bound=1)
_SPARSE_MESSAGES = flags.DEFINE_integer(
    "sparse_messages", 400, "Sparse batch answers timed per setting.",
    lower_bound=1, upper_bound=1 << 20)
_DENSE_MESSAGES = flags.DEFINE_integer(
    "dense_messages", 40, "Dense batch answers timed per setting.",
    lower_bound=1, upper_bound=1 << 20)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the record here.")
# The worker side: this module run again as a child process.
_SERVE = flags.DEFINE_integer("serve", 0, "(internal) Run as the worker, "
                              "sending messages of this many bytes.",
                              lower_bound=0)
_SERVE_COUNT = flags.DEFINE_integer("serve_count", 0, "(internal) Rounds "
                                    "the worker answers.", lower_bound=0)
cli.check(["k", "vocab"], lambda k, vocab: k <= vocab,
          "--k must be <= --vocab")
cli.check_output_path("json_out")
cli.parse_flags_early(__name__)

import zmq  # pylint: disable=g-import-not-at-top

from dyadic_jax import bridge  # pylint: disable=g-import-not-at-top
from dyadic_jax.bridge import transport  # pylint: disable=g-import-not-at-top
from dyadic_jax.wire.layouts import Representation  # pylint: disable=g-import-not-at-top

_ENV_KEYS = ("BENCH_CURVE_SERVER_PUBLIC", "BENCH_CURVE_SERVER_SECRET",
             "BENCH_CURVE_CLIENT_PUBLIC")


def packed_bytes(representation, requests, depth, vocab, k):
  """Bytes of one PACKED batch answer (the wire's own count)."""
  caps = bridge.Capabilities(vocab=vocab, max_depth=depth,
                             max_requests=requests,
                             representation=representation, max_support=k)
  return caps.bounds.packed_bytes(requests, depth)


def _cpu_s():
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def _curve_from_env(side):
  if _ENV_KEYS[0] not in os.environ:
    return None
  server_public, server_secret, client_public = (
      os.environ[k].encode() for k in _ENV_KEYS)
  client_secret = os.environ.get("BENCH_CURVE_CLIENT_SECRET", "").encode()
  if side == "worker":
    return transport.Curve(public_key=server_public, secret_key=server_secret,
                           server_public=server_public,
                           client_public=client_public)
  return transport.Curve(public_key=client_public, secret_key=client_secret,
                         server_public=server_public,
                         client_public=client_public)


def serve(size, count):
  """The worker: binds, prints its address, answers `count` rounds."""
  endpoint = transport.Endpoint.bind(
      "tcp://127.0.0.1:0", max_message=4096, curve=_curve_from_env("worker"))
  print("READY", endpoint.address, flush=True)
  message = os.urandom(size)
  got = endpoint.recv(60.0)                 # the verifier's first call
  assert got is not None, "no verifier"
  peer = got[0]
  start = _cpu_s()
  for _ in range(count):
    endpoint.send(message, peer)
    assert endpoint.recv(60.0) is not None, "no acknowledgement"
  print("CPU", _cpu_s() - start, flush=True)
  endpoint.close()


def measure(size, count, curve):
  """(one-way s median, worker CPU s, verifier CPU s) per message."""
  env = dict(os.environ)
  mine = None
  if curve:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    env.update(zip(_ENV_KEYS, (k.decode() for k in (
        server_public, server_secret, client_public))))
    mine = transport.Curve(public_key=client_public, secret_key=client_secret,
                           server_public=server_public,
                           client_public=client_public)
  child = subprocess.Popen(
      [sys.executable, "-m", "experiments.bench_curve", f"--serve={size}",
       f"--serve_count={count}"], env=env, stdout=subprocess.PIPE, text=True)
  try:
    ready = child.stdout.readline().split()
    assert ready[:1] == ["READY"], ready
    endpoint = transport.Endpoint.connect(
        ready[1], max_message=size + transport.CURVE_SLACK, curve=mine)
    endpoint.send(b"go")
    one_way = []
    start = _cpu_s()
    sent = time.perf_counter()
    for _ in range(count):
      got = endpoint.recv(60.0)
      now = time.perf_counter()
      assert got is not None and len(got[1]) == size, "lost answer"
      one_way.append(now - sent)
      endpoint.send(b"ok")
      sent = time.perf_counter()
    verifier_cpu = _cpu_s() - start
    worker_cpu = float(child.stdout.readline().split()[1])
    endpoint.close()
  finally:
    child.wait(60)
  return statistics.median(one_way), worker_cpu / count, verifier_cpu / count


def main(argv):
  del argv                  # cli refuses positional arguments at parse time
  if _SERVE.value:
    serve(_SERVE.value, _SERVE_COUNT.value)
    return
  r, d = _REQUESTS.value, _DEPTH.value
  cases = {name: (packed_bytes(rep, r, d, _VOCAB.value, _K.value), count)
           for name, rep, count in (
               ("sparse", Representation.SPARSE, _SPARSE_MESSAGES.value),
               ("dense", Representation.DENSE, _DENSE_MESSAGES.value))}
  print(f"CURVE cost per batch answer (R={r}, D={d}, V={_VOCAB.value}, "
        f"k={_K.value}); worker and verifier are separate processes")
  print(f"  {'q':<7}{'bytes':>12}  {'one way ms':>18}  "
        f"{'worker CPU ms':>18}  {'verifier CPU ms':>18}")
  print(f"  {'':<7}{'':>12}  {'clear  CURVE  (x)':>18}  "
        f"{'clear  CURVE  (x)':>18}  {'clear  CURVE  (x)':>18}")
  results = {}
  for name, (size, count) in cases.items():
    clear = measure(size, count, curve=False)
    curve = measure(size, count, curve=True)
    keys = ("one_way_ms", "worker_cpu_ms", "verifier_cpu_ms")
    row = {"bytes": size, "messages": count}
    cells = []
    for key, a, b in zip(keys, clear, curve):
      row[key] = {"clear": a * 1e3, "curve": b * 1e3,
                  "x_clear": b / a if a > 0 else None}
      ratio = f"{b / a:.1f}" if a > 0 else "-"
      cells.append(f"{a * 1e3:6.3f} {b * 1e3:6.3f} ({ratio})")
    results[name] = row
    print(f"  {name:<7}{size:>12,}  " + "  ".join(cells))
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"config": {"vocab": _VOCAB.value, "requests": r,
                            "depth": d, "k": _K.value},
                 "results": results}, f, indent=1)
    print(f"wrote {_JSON_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
