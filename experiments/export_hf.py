"""Exports a trained pair for Hugging Face transformers (`ArceeForCausalLM`).

    python -m experiments.export_hf --model=stdlib --output_dir=OUT [--force]

writes OUT/target and OUT/draft, each a folder that transformers loads
with `AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` (config.json, model.safetensors in
float32, tokenizer.json, tokenizer_config.json;
dyadic_jax/models/hf_layout.py says how the weights map). Then, for
example, plain decoding of the same weights in transformers:

    model = AutoModelForCausalLM.from_pretrained("OUT/target")
    model.generate(ids, do_sample=True, top_k=0, max_new_tokens=64)

and its assisted generation with `assistant_model=` the draft folder
(experiments/bench_pair.py times both beside ours). Needs the [models]
extra, never torch or transformers. Runtime: about 2 s.
"""

import logging
import os
import pathlib

from absl import flags

from experiments import cli

def problem_of_output(output_dir: str, force: bool) -> str | None:
  """Why --output_dir cannot take an export (one line), or None."""
  out = pathlib.Path(output_dir)
  if out.exists() and not out.is_dir():
    return f"--output_dir={output_dir} is a file, not a folder"
  parent = out if out.is_dir() else out.parent
  if not parent.is_dir() or not os.access(parent, os.W_OK):
    return f"--output_dir={output_dir}: {parent} is not a writable folder"
  taken = [r for r in ("target", "draft") if (out / r / "config.json").exists()]
  if taken and not force:
    return (f"--output_dir={output_dir} already holds an export "
            f"({', '.join(taken)}); --force replaces it")
  return None


_MODEL = flags.DEFINE_string(
    "model", "stdlib", "The trained pair: a shipped one's name "
    "(dyadic_jax/models/checkpoints/NAME) or a checkpoint directory.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "The folder to write (target/ and draft/ inside).",
    required=True)
_FORCE = flags.DEFINE_bool("force", False, "Replace an export already in "
                           "--output_dir.")
cli.check_checkpoint("model", "--model is a shipped pair's name (stdlib) "
                     "or a checkpoint directory")
cli.check_problem(["output_dir", "force"], lambda output_dir, force: (
    None if output_dir is None else problem_of_output(output_dir, force)))
cli.parse_flags_early(__name__, extra="models")

# pylint: disable=g-import-not-at-top,wrong-import-position
from dyadic_jax.models import hf_layout
# pylint: enable=g-import-not-at-top,wrong-import-position


def main(argv: list[str]) -> None:
  del argv
  # JAX's backend probe logs "Unable to initialize backend 'tpu'" at INFO.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  try:
    folders = hf_layout.export_pair(cli.model_dir(_MODEL.value),
                                   _OUTPUT_DIR.value)
  except OSError as e:   # a folder the checks could not see was unwritable
    cli.fail(f"--output_dir={_OUTPUT_DIR.value}: cannot write "
             f"{e.filename or 'it'}: {e.strerror or e}")
  for role, folder in folders.items():
    print(f"{role}: {folder}")


if __name__ == "__main__":
  cli.run(main)
