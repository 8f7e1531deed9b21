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
toy draft of experiments/pipeline_models.py (parallel backbone + Markov
head); the verifier
must announce the same capabilities (vocab, depth, requests, q, k and the
identities) or the HELLO is refused, and hold the same deployment secret
(--keys_dir; docs/security.md) or nothing it sends is accepted.
--insecure turns authentication off (CRC32C only) and says so on stderr.
--worker_bug=token_not_from_q is a fault drill: the worker sends its q but
each drafted token is the next entry after the one its draw picked (an
off-by-one in the cumulative search); the verifier's sampling audit
refuses every such proposal. Startup takes a few seconds (JAX import and
one compile).
"""

import json
import signal
import sys

from absl import app
from absl import flags
import numpy as np

from dyadic_jax import DEFAULT_VOCAB
from dyadic_jax import bridge
from dyadic_jax.bridge import keys as keys_lib
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
_KEYS_DIR = flags.DEFINE_string(
    "keys_dir", None, "Directory of the bridge keys (python -m "
    "dyadic_jax.bridge.keys DIR): the secret every frame's MAC is keyed "
    "with, and the CURVE keys of --encrypt.")
_INSECURE = flags.DEFINE_bool(
    "insecure", False, "No authentication (CRC32C tags only): any process "
    "that reaches the socket can talk to this worker. Benchmarks only.")
_ENCRYPT = flags.DEFINE_bool(
    "encrypt", False, "Encrypt the link with ZeroMQ CURVE (keys from "
    "--keys_dir; the verifier must use --encrypt too).")
_WORKER_BUG = flags.DEFINE_enum(
    "worker_bug", "none", ["none", "token_not_from_q"], "Fault drill: "
    "token_not_from_q sends each q row with the token after the drawn one.")
flags.register_validator("vocab", lambda v: 2 <= v <= 1 << 21,
                         "--vocab must be in [2, 2^21]")
flags.register_validator("depth", lambda v: 1 <= v <= 255,
                         "--depth must be in [1, 255]")
flags.register_validator("requests", lambda v: 1 <= v <= 1024,
                         "--requests must be in [1, 1024]")
flags.register_validator("k", lambda v: v >= 1, "--k must be >= 1")
flags.register_multi_flags_validator(
    ["keys_dir", "insecure", "encrypt"],
    lambda f: (f["keys_dir"] is not None) != f["insecure"] and not (
        f["insecure"] and f["encrypt"]),
    "give --keys_dir (authenticated) or --insecure, not both; --encrypt "
    "needs --keys_dir")


def capabilities():
  """The Capabilities these flags describe (the verifier builds the same)."""
  representation = {"sparse": layouts.Representation.SPARSE,
                    "dense": layouts.Representation.DENSE,
                    "greedy": layouts.Representation.TOKEN}[_Q.value]
  mode = (layouts.Mode.GREEDY if _Q.value == "greedy"
          else layouts.Mode.SAMPLED)
  return bridge.Capabilities(
      mode=int(mode), vocab=_VOCAB.value, max_depth=_DEPTH.value,
      max_requests=_REQUESTS.value, representation=representation,
      max_support=_K.value)


def token_not_from_q(propose):
  """The drill's buggy proposer: each token is the next live entry of its
  q row after the one the draw picked (cyclic): q is honest, the tokens
  are not drawn from it."""
  def buggy(*args, out=None):
    proposal = propose(*args, out=out)
    rows = out
    if rows is None:          # a warm-up draw: nothing is sent
      return proposal
    for i in range(len(rows.tokens)):
      n = int(rows.n[i])
      if rows.ids is not None:
        live = np.flatnonzero(rows.values[i, :n] > 0)
        at = int(np.flatnonzero(rows.ids[i, :n] == rows.tokens[i])[0])
        nxt = live[(np.searchsorted(live, at, "right")) % len(live)]
        rows.tokens[i] = rows.ids[i, nxt]
      else:
        live = np.flatnonzero(rows.values[i] > 0)
        at = int(rows.tokens[i])
        rows.tokens[i] = live[np.searchsorted(live, at, "right") % len(live)]
    return proposal
  return buggy


def main(argv):
  del argv
  caps = capabilities()
  _, draft = pipeline_models.make_models(pipeline_models.ModelConfig(
      vocab=caps.vocab, seed=_SEED.value, closeness=_CLOSENESS.value,
      max_depth=caps.max_depth))
  propose = bridge.draft_proposer(
      draft.head, caps, backbone_fn=draft.backbone if _BACKBONE.value
      else None)
  if _WORKER_BUG.value == "token_not_from_q":
    propose = token_not_from_q(propose)
  if _INSECURE.value:
    print("WARNING: --insecure: the bridge link is NOT authenticated; any "
          "process that reaches the socket can talk to this worker",
          file=sys.stderr, flush=True)
    secret, curve = None, None
  else:
    secret, curve = keys_lib.load(_KEYS_DIR.value, "worker",
                                  encrypt=_ENCRYPT.value)
  # SIGTERM ends the loop like Ctrl-C, so the counters are reported.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

  def ready(address):
    print(f"READY {address}", flush=True)

  def on_exit(worker):
    print("STATS " + json.dumps(worker.counters.snapshot()), flush=True)

  bridge.serve_forever(caps, propose, _ADDRESS.value, secret=secret,
                       curve=curve, ready=ready, on_exit=on_exit)


if __name__ == "__main__":
  app.run(main)
