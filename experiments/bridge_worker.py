"""The draft worker as its own process: serves proposals over ZeroMQ.

    python -m dyadic_jax.bridge.keys /tmp/keys     # once: the key files
    python -m experiments.bridge_worker --address=tcp://127.0.0.1:0 \
        --keys_dir=/tmp/keys [--vocab=129280 --q=sparse --k=32 --depth=5 \
        --requests=4 --encrypt]

Binds the address (port 0 picks a free port), compiles the proposer, prints
one line `READY <address>` on stdout, and serves HELLO, STEP, COMMIT and
RESET until it is stopped (SIGTERM/SIGINT); on the way out it prints one
line `STATS <json>` (its counters: proposals, commits, refusals by code,
`propose_us` = time spent drawing proposals). The draft is the DSpark-style
toy draft of dyadic_jax/models/toy_pair.py (parallel backbone + Markov
head), or with --model=stdlib the trained transformer draft, which keeps a
KV cache per request and learns each request's prefix from the verifier's
CONTEXT frames (docs/wire.md); the verifier must announce the same capabilities (vocab, depth,
requests, q, k and the identities) or the HELLO is refused, and hold the
same deployment secret (--keys_dir; docs/security.md) or nothing it sends
is accepted. --insecure turns authentication off (CRC32C only) and says so
on stderr. --worker_bug=token_not_from_q is a fault drill: the worker
sends its q, but each drafted token is the next entry after the one its
draw picked (an off-by-one in the cumulative search); the verifier's
sampling audit refuses every such proposal.

The session flags (--vocab, --depth, --requests, --q, --k, --closeness,
--model_seed, --backbone, and the link's --keys_dir, --insecure, --encrypt,
--worker_bug) are experiments/pipeline_config.py's, the same
as the pipeline's, which starts this program with its resolved config.
Start-up takes a few seconds (JAX import and one compile); a bad flag
exits at once with a one-line error.
"""

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import typing

from absl import flags

from experiments import cli
from experiments import interrupt
from experiments import pipeline_config

# --help lists the session flags too, not only under --helpfull.
flags.adopt_module_key_flags(pipeline_config)

_ADDRESS = flags.DEFINE_string(
    "address", "tcp://127.0.0.1:0", "ZeroMQ address to bind: "
    "tcp://HOST:PORT (PORT in [0, 65535]; 0: a free port) or ipc:///path. "
    "A port another process holds is refused at start.")


def _tcp_host_port(address: str) -> tuple[str, int] | None:
  """(host, port) of tcp://HOST:PORT (None: not that form)."""
  host, _, port = address.removeprefix("tcp://").rpartition(":")
  if not host or not port.isdigit():
    return None
  return host, int(port)


def address_problem(address: str) -> str | None:
  """Why --address cannot be bound as given (one line), or None.

  A tcp port is probed here, before JAX starts, the way ZeroMQ binds it
  (SO_REUSEADDR): one that a live socket holds is refused now rather than
  after the compile. The actual bind can still lose a race; then the
  worker says so in one line too.
  """
  if address.startswith("ipc://"):
    if len(address) == len("ipc://"):
      return f"--address={address}: ipc:// needs a path"
    folder = os.path.dirname(os.path.abspath(address[len("ipc://"):]))
    if not os.path.isdir(folder):
      return (f"--address={address}: the socket's folder {folder} does not "
              "exist")
    return None
  if not address.startswith("tcp://"):
    return f"--address={address} must be tcp://HOST:PORT or ipc://PATH"
  parsed = _tcp_host_port(address)
  if parsed is None:
    return f"--address={address} must be tcp://HOST:PORT with a numeric PORT"
  host, port = parsed
  if not 0 <= port <= 65535:
    return f"--address={address}: port {port} is not in [0, 65535]"
  if port == 0:
    return None
  host = "0.0.0.0" if host == "*" else host.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      probe.bind((host, port))
  except OSError as e:
    if e.errno == errno.EADDRINUSE:
      return f"--address={address}: port {port} is already in use"
    return f"--address={address}: cannot bind it ({e.strerror or e})"
  return None


cli.check_problem("address", address_problem)
pipeline_config.check_keys_dir(["worker"])
_RANK = flags.DEFINE_integer(
    "rank", 0, "This process's rank of a --worker_ranks worker (0: the "
    "leader, which serves the session; s >= 1 sends block s on the rank "
    "link bound at --address).", lower_bound=0,
    upper_bound=pipeline_config.MAX_RANKS - 1)
_COORDINATOR = flags.DEFINE_string(
    "coordinator", "", "The worker ranks' jax.distributed coordinator (rank "
    "0's process), with --worker_ranks > 1: unix:PATH (the pipeline's: a "
    "socket in its private run folder) or host:port; rank 0 listens there "
    "and nowhere else.")
cli.check(["rank", "worker_ranks", "coordinator"],
          lambda rank, worker_ranks, coordinator: rank < worker_ranks and (
              worker_ranks == 1 or bool(coordinator)),
          "--rank must be < --worker_ranks, and --worker_ranks > 1 needs "
          "--coordinator")

cli.parse_flags_early(__name__)
if __name__ == "__main__":
  # SIGTERM and Ctrl-C end its loop quietly, the counters reported (STATS);
  # a warm-up that has not finished is ended by the watchdog.
  interrupt.as_exit()


def token_not_from_q(propose):
  """The drill's buggy proposer: each token is the next live entry of its
  q row after the one the draw picked (cyclic): q is honest, the tokens
  are not drawn from it."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  def buggy(*args, out=None, **kwargs):
    proposal = propose(*args, out=out, **kwargs)
    if out is None:           # a warm-up draw: nothing is sent
      return proposal
    for i in range(len(out.tokens)):
      n = int(out.n[i])
      if out.ids is not None:
        live = np.flatnonzero(out.values[i, :n] > 0)
        at = int(np.flatnonzero(out.ids[i, :n] == out.tokens[i])[0])
        out.tokens[i] = out.ids[i, live[np.searchsorted(live, at, "right")
                                        % len(live)]]
      else:
        live = np.flatnonzero(out.values[i] > 0)
        out.tokens[i] = live[np.searchsorted(live, int(out.tokens[i]),
                                             "right") % len(live)]
    return proposal
  return buggy


def shard_mass(propose):
  """The shard_mass drill's proposer (a rank s >= 1): its block is well
  formed and sealed, but the first row's first entry carries 2^-24 more,
  so the row's global mass is M + 1."""

  def buggy(*args, out=None, **kwargs):
    proposal = propose(*args, out=out, **kwargs)
    if out is not None:
      out.values[0, 0] += 2.0 ** -24
    return proposal
  return buggy


@contextlib.contextmanager
def _bind_errors():
  """A bind that fails after all (the port taken since the flags were
  checked): one line, exit status 1, no traceback."""
  import zmq  # pylint: disable=g-import-not-at-top
  try:
    yield
  except zmq.ZMQError as e:
    if e.errno not in (zmq.EADDRINUSE, errno.EADDRINUSE, errno.EADDRNOTAVAIL,
                       errno.EACCES):
      raise
    cli.fail(f"cannot bind --address={_ADDRESS.value}: {e}")


def main(argv: list[str]) -> None:
  del argv
  cli.exit_with_parent()     # started by the pipeline: never outlives it
  if pipeline_config.KEYS_DIR.value is None and not (
      pipeline_config.INSECURE.value):
    cli.usage_error("give --keys_dir (python -m dyadic_jax.bridge.keys DIR "
                    "makes one) or --insecure")
  # JAX starts here, after the flags passed their checks.
  # pylint: disable=g-import-not-at-top
  from dyadic_jax import bridge, rowops
  from dyadic_jax.bridge import rank_links
  from dyadic_jax.bridge import ranks as bridge_ranks
  from dyadic_jax.models import toy_pair
  import sharding
  # pylint: enable=g-import-not-at-top
  # JAX's backend probe logs "Unable to initialize backend 'tpu'" at INFO.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  config = pipeline_config.from_flags()
  ranks, rank = config.worker_ranks, _RANK.value
  caps = config.capabilities()
  if config.rank_links:
    caps = caps.link(rank)       # this rank's block
  executor = rowops.LOCAL
  if ranks > 1:
    # One CPU device per rank; the draws' collectives run over gloo.
    bridge_ranks.initialize(_COORDINATOR.value, ranks, rank)
    executor = sharding.executor(sharding.vocab_mesh(ranks))
  draft: typing.Any
  if config.model == "toy":
    _, toy = toy_pair.make_models(config.model_config())
    draft = toy.markov(config.backbone)
  else:
    from dyadic_jax.models import pair  # pylint: disable=g-import-not-at-top
    draft = pair.load_dir(cli.model_dir(config.model),
                          max_depth=config.depth).draft
  propose = bridge.draft_proposer(draft, caps, executor=executor)
  if config.worker_bug == "token_not_from_q":
    propose = token_not_from_q(propose)
  if config.worker_bug == "shard_mass" and rank == ranks - 1:
    propose = shard_mass(propose)
  if config.insecure:
    print(pipeline_config.INSECURE_WARNING, file=sys.stderr, flush=True)
  secret, curve = config.link_keys("worker")

  def ready(address):
    print(f"READY {address}", flush=True)

  # The leader tells its other ranks each proposal's inputs.
  others = rank_links.ProposalBroadcast() if ranks > 1 else None

  def on_exit(worker):
    if others is not None:
      others.stop()
    print("STATS " + json.dumps(worker.counters.snapshot()), flush=True)

  if rank == 0:
    with _bind_errors():
      bridge.serve_forever(caps, propose, _ADDRESS.value, secret=secret,
                           curve=curve, ready=ready, on_exit=on_exit,
                           draw_hook=others,
                           # A trained draft conditions on the prefix.
                           wants_context=config.model != "toy",
                           # SIGTERM/SIGINT: the loop ends, STATS printed.
                           stop=interrupt.stopping())
    return
  # A rank s >= 1: its block on its own link (dense), or only the draws.
  with _bind_errors():
    sender = (rank_links.ShardSender(caps, _ADDRESS.value, secret=secret,
                                     curve=curve) if config.rank_links
              else None)
  ready(sender.address if sender else "none")
  try:
    sent = rank_links.follow_proposals(propose, sender)
  except (SystemExit, KeyboardInterrupt):
    sent = -1
  stats = sender.counters.snapshot() if sender else {}
  print("STATS " + json.dumps(dict(stats, sent=sent)), flush=True)
  if sender:
    sender.close()


if __name__ == "__main__":
  cli.run(main)
