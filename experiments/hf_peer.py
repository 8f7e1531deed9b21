"""The HF transformers peer of experiments/bench_core.py (run as a subprocess).

    <python with torch and transformers> experiments/hf_peer.py INPUTS.npz REPEATS THREADS

Not an experiment of its own: bench_core writes the verification round's
inputs (target logits [R, D+1, V], draft logits [R, D, V] and the drafted
chains [R, D]) to INPUTS.npz and runs this file with an interpreter that has
torch and transformers (they are not dependencies of the project, so it may
be another virtual environment). It times one round: transformers'
`_speculative_sampling` on each request (batch 1, as `generate` calls it),
the median of REPEATS rounds after one warm-up, with THREADS torch threads,
and prints one JSON line. Imports only numpy, torch and transformers.
"""

import inspect
import json
import statistics
import sys
import time

import numpy as np


def _sampler():
  """transformers' `_speculative_sampling` (its module moved between versions)."""
  try:
    from transformers.generation.utils import _speculative_sampling  # pylint: disable=g-import-not-at-top
  except ImportError:
    from transformers.generation.candidate_generator import _speculative_sampling  # pylint: disable=g-import-not-at-top
  return _speculative_sampling


def main(argv):
  if len(argv) != 4:
    sys.exit("usage: hf_peer.py INPUTS.npz REPEATS THREADS")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  inputs, repeats, threads = argv[1], int(argv[2]), int(argv[3])
  torch.set_num_threads(threads)
  sample = _sampler()
  data = np.load(inputs)
  target = torch.from_numpy(data["target"])      # [R, D+1, V] float32
  draft = torch.from_numpy(data["draft"])        # [R, D, V] float32
  chain = torch.from_numpy(data["chain"].astype(np.int64))  # [R, D]
  requests, depth = chain.shape

  # Older versions take is_done_candidate as a fifth argument.
  extra = ((False,) if "is_done_candidate" in
           inspect.signature(sample).parameters else ())

  def round_():
    out = []
    for r in range(requests):
      tokens, n_matches = sample(chain[r:r + 1], draft[r:r + 1], depth,
                                 target[r:r + 1], *extra)
      out.append((int(n_matches), tokens.shape[-1]))
    return out

  torch.manual_seed(0)
  first = round_()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    round_()
    times.append(time.perf_counter() - start)
  print(json.dumps({"round_s": statistics.median(times),
                    "accepted": [a for a, _ in first],
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "threads": threads}))


if __name__ == "__main__":
  main(sys.argv)
