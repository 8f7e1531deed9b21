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
toy draft of dyadic_jax/testing/toy_models.py (parallel backbone + Markov
head); the verifier must announce the same capabilities (vocab, depth,
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

import json
import logging
import signal
import sys

from absl import flags

from experiments import cli
from experiments import pipeline_config

_ADDRESS = flags.DEFINE_string(
    "address", "tcp://127.0.0.1:0", "ZeroMQ address to bind: "
    "tcp://127.0.0.1:PORT (0: a free port) or ipc:///path.")
cli.check("address", lambda a: a.startswith(("tcp://", "ipc://")),
          "--address must be tcp://HOST:PORT or ipc://PATH")

cli.parse_flags_early(__name__)


def token_not_from_q(propose):
  """The drill's buggy proposer: each token is the next live entry of its
  q row after the one the draw picked (cyclic): q is honest, the tokens
  are not drawn from it."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  def buggy(*args, out=None):
    proposal = propose(*args, out=out)
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


def main(argv: list[str]) -> None:
  del argv
  if pipeline_config.KEYS_DIR.value is None and not (
      pipeline_config.INSECURE.value):
    cli.usage_error("give --keys_dir (python -m dyadic_jax.bridge.keys DIR "
                    "makes one) or --insecure")
  # JAX starts here, after the flags passed their checks.
  # pylint: disable=g-import-not-at-top
  from dyadic_jax import bridge
  from dyadic_jax.testing import toy_models
  # pylint: enable=g-import-not-at-top
  # JAX's backend probe logs "Unable to initialize backend 'tpu'" at INFO.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  config = pipeline_config.from_flags()
  caps = config.capabilities()
  _, draft = toy_models.make_models(config.model_config())
  propose = bridge.draft_proposer(
      draft.head, caps, backbone_fn=draft.backbone if config.backbone
      else None)
  if config.worker_bug == "token_not_from_q":
    propose = token_not_from_q(propose)
  if config.insecure:
    print(pipeline_config.INSECURE_WARNING, file=sys.stderr, flush=True)
  secret, curve = config.link_keys("worker")
  # SIGTERM ends the loop like Ctrl-C, so the counters are reported.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

  def ready(address):
    print(f"READY {address}", flush=True)

  def on_exit(worker):
    print("STATS " + json.dumps(worker.counters.snapshot()), flush=True)

  bridge.serve_forever(caps, propose, _ADDRESS.value, secret=secret,
                       curve=curve, ready=ready, on_exit=on_exit)


if __name__ == "__main__":
  cli.run(main)
