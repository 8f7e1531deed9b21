"""The draft worker as its own process: serves proposals over ZeroMQ.

    python -m experiments.bridge_worker --address=tcp://127.0.0.1:0 \
        [--vocab=129280 --q=sparse --k=32 --depth=5 --requests=4]

Binds the address (port 0 picks a free port), compiles the proposer, prints
one line `READY <address>` on stdout, and serves HELLO, STEP, COMMIT and
RESET until it is stopped (SIGTERM/SIGINT); on the way out it prints one
line `STATS <json>` (its counters: proposals, commits, refusals by code,
`propose_us` = time spent drawing proposals). The draft is the DSpark-style
toy draft of experiments/pipeline_models.py (parallel backbone + Markov
head); the verifier
must announce the same capabilities (vocab, depth, requests, q, k and the
identities) or the HELLO is refused. Startup takes a few seconds (JAX
import and one compile).
"""

import json
import signal
import sys

from absl import app
from absl import flags

from dyadic_jax import DEFAULT_VOCAB
from dyadic_jax import bridge
from dyadic_jax.wire import layouts
from experiments import pipeline_models

_ADDRESS = flags.DEFINE_string(
    "address", "tcp://127.0.0.1:0", "ZeroMQ address to bind: "
    "tcp://127.0.0.1:PORT (0: a free port) or ipc:///path.")
_VOCAB = flags.DEFINE_integer("vocab", DEFAULT_VOCAB, "Vocabulary size V.")
_DEPTH = flags.DEFINE_integer("depth", 5, "Maximum draft depth D.")
_REQUESTS = flags.DEFINE_integer("requests", 4, "Requests per batch slot.")
_Q = flags.DEFINE_enum("q", "sparse", ["sparse", "dense", "greedy"],
                       "q representation on the wire (greedy: v1, no q).")
_K = flags.DEFINE_integer("k", 32, "Support of sparse q rows (top-k).")
_CLOSENESS = flags.DEFINE_float(
    "closeness", 0.9, "How closely the toy draft tracks the toy target, in "
    "[0, 1].")
_SEED = flags.DEFINE_integer("model_seed", 0, "Seed of the toy models.")
_BACKBONE = flags.DEFINE_bool(
    "backbone", True, "Add the draft's parallel backbone (DSpark-style); "
    "off: a purely sequential Markov draft.")


def capabilities():
  """The Capabilities these flags describe (the verifier builds the same)."""
  representation = {"sparse": layouts.Representation.SPARSE,
                    "dense": layouts.Representation.DENSE,
                    "greedy": layouts.Representation.TOKEN}[_Q.value]
  mode = (layouts.GREEDY_VERSION if _Q.value == "greedy"
          else layouts.WIRE_VERSION)
  return bridge.Capabilities(
      mode=mode, vocab=_VOCAB.value, max_depth=_DEPTH.value,
      max_requests=_REQUESTS.value, representation=representation,
      max_support=_K.value)


def main(argv):
  del argv
  caps = capabilities()
  _, draft = pipeline_models.make_models(pipeline_models.ModelConfig(
      vocab=caps.vocab, seed=_SEED.value, closeness=_CLOSENESS.value,
      max_depth=caps.max_depth))
  propose = bridge.draft_proposer(
      draft.head, caps, backbone_fn=draft.backbone if _BACKBONE.value
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
  app.run(main)
