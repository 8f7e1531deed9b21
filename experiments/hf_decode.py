"""The transformers peer of experiments/bench_pair.py (run as a subprocess).

    <python with torch and transformers> experiments/hf_decode.py JOB.json

Not an experiment of its own: bench_pair exports the pair it measures
(experiments/export_hf.py: the same weights as `ArceeForCausalLM`; a GGUF
target is its own file, which transformers dequantizes to the same float32
weights, and its draft a `LlamaForCausalLM` over the full vocabulary), writes
the job (the two folders, the prompts, the new tokens, the depth, the torch
threads) and runs this file with an interpreter that has torch and
transformers (not dependencies of the project, so it may be another
virtual environment). Plain sampling at temperature 1 (top_k=0, top_p=1),
no end-of-text stop, every prompt decoded to the same length as ours:

  target_b1       `generate` one prompt at a time
  target_b4       batched `generate`, 4 prompts a call (equal lengths: no
                  padding)
  assisted_b1     assisted generation with the draft, depth fixed at D
                  (constant schedule, no confidence stop), one prompt at a
                  time

Each leg runs once untimed on a short request, then on every prompt; it
reports new tokens, wall and CPU seconds (this process, all threads) and
tokens per second of each. Prints one JSON line. Imports only numpy, torch
and transformers.
"""

import json
import os
import sys
import time


def _legs(job):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(job["threads"])
  load = transformers.AutoModelForCausalLM.from_pretrained
  if job["target"].endswith(".gguf"):      # transformers reads the file
    folder, name = os.path.split(job["target"])
    target = load(folder, gguf_file=name, dtype=torch.float32).eval()
  else:
    target = load(job["target"], dtype=torch.float32).eval()
  draft = load(job["draft"], dtype=torch.float32).eval()
  for model in (target, draft):
    model.generation_config.eos_token_id = None   # decode to the length
  new, depth, prompts = job["new_tokens"], job["depth"], job["prompts"]
  common = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                pad_token_id=0)
  assisted = dict(assistant_model=draft, num_assistant_tokens=depth,
                  num_assistant_tokens_schedule="constant",
                  assistant_confidence_threshold=0.0)

  def run(batch, extra, requests, tokens):
    made = 0
    for i in range(0, len(requests), batch):
      ids = torch.tensor(requests[i:i + batch], dtype=torch.long)
      with torch.no_grad():
        out = target.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=tokens, **common, **extra)
      made += int(out.shape[0] * (out.shape[1] - ids.shape[1]))
    return made

  torch.manual_seed(job["seed"])
  out = {"torch": torch.__version__, "transformers": transformers.__version__,
         "threads": job["threads"]}
  for name, batch, extra in (("target_b1", 1, {}), ("target_b4", 4, {}),
                             ("assisted_b1", 1, assisted)):
    run(batch, extra, prompts[:batch], 2 * (depth + 1))      # warm
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = run(batch, extra, prompts, new)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    out[name] = {"tokens": tokens, "wall_s": wall, "cpu_s": cpu,
                 "tokens_per_second": tokens / wall,
                 "tokens_per_cpu_second": tokens / cpu}
    print(f"hf_decode: {name} {tokens / wall:.1f} tok/s", file=sys.stderr,
          flush=True)
  return out


def main(argv):
  if len(argv) != 2:
    sys.exit("usage: hf_decode.py JOB.json")
  with open(argv[1]) as f:
    job = json.load(f)
  print(json.dumps(_legs(job)))


if __name__ == "__main__":
  main(sys.argv)
