"""The draft worker as its own process: serves proposals over ZeroMQ.

    python -m experiments.bridge_worker --address=tcp://127.0.0.1:0 \
        [--vocab=129280 --q=sparse --k=32 --depth=5 --requests=4]

Binds the address (port 0 picks a free port), compiles the proposer, prints
one line `READY <address>` on stdout, and serves HELLO, STEP, COMMIT and
RESET until it is stopped (SIGTERM/SIGINT); on the way out it prints one
line `STATS <json>` (its counters: proposals, commits, refusals by code,
`propose_us` = time spent drawing proposals). The draft is the DSpark-style
toy draft of dyadic_jax/testing/toy_models.py (parallel backbone + Markov
head); the verifier must announce the same capabilities (vocab, depth,
requests, q, k and the identities) or the HELLO is refused.

The session flags (--vocab, --depth, --requests, --q, --k, --closeness,
--model_seed, --backbone) are experiments/pipeline_config.py's, the same
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


def main(argv: list[str]) -> None:
  del argv
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
  # SIGTERM ends the loop like Ctrl-C, so the counters are reported.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

  def ready(address):
    print(f"READY {address}", flush=True)

  def on_exit(worker):
    print("STATS " + json.dumps(worker.counters.snapshot()), flush=True)

  bridge.serve_forever(caps, propose, _ADDRESS.value, ready=ready,
                       on_exit=on_exit)


if __name__ == "__main__":
  cli.run(main)
