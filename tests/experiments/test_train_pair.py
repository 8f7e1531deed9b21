"""`python -m experiments.train_pair` as a user runs it, at toy size.

A tiny pair trained on one stdlib package (json: 5 files, decoder.py held
out), continued with --init_from, then loaded and decoded from: the path
from a fresh clone to one's own pair, in seconds (the pipeline takes a
checkpoint directory in tests/experiments/test_pp1_pipeline.py). The
shipped pair's figures are the long run's (the module's docstring).
"""

import json
import shlex
import subprocess
import sys

from experiments import corpus

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top

# No --warmup: its default (a tenth of --steps) fits any --steps.
_TINY = ["--vocab=300", "--max_len=96", "--seq_len=64", "--batch=2",
         "--eval_windows=2", "--log_every=1",
         "--target_d_model=32", "--target_layers=1", "--target_heads=2",
         "--target_d_ff=64", "--draft_d_model=16", "--draft_heads=1",
         "--draft_d_ff=32"]


def _run(module, *flags):
  """Runs experiments.<module>; a failure shows its stderr."""
  proc = subprocess.run([sys.executable, "-m", f"experiments.{module}",
                         *flags], cwd=_ROOT, env=paths.subprocess_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _assert_parses(command):
  """The printed pipeline command passes the pipeline's flag checks (its
  context check included: issue 40, the tiny pair's command failed it)."""
  args = shlex.split(command)
  assert args[:3] == ["python", "-m", "experiments.pp1_pipeline"], args
  code = ("import sys\n"
          "from absl import flags\n"
          "from experiments.pp1 import flags as _\n"
          "flags.FLAGS(['pp1_pipeline', *sys.argv[1:]])\n")
  proc = subprocess.run([sys.executable, "-c", code, *args[3:]], cwd=_ROOT,
                        env=paths.subprocess_env(), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, (command, proc.stderr[-2000:])


def test_a_tiny_pair_trains_continues_and_runs(tmp_path):
  out, cache = tmp_path / "pair", tmp_path / "cache"
  first = _run("train_pair", f"--corpus_root={corpus.stdlib_root() / 'json'}",
               "--steps=3", f"--output_dir={out}", f"--cache_dir={cache}",
               *_TINY)
  assert "held-out loss" in first.stdout and "step 3/3" in first.stderr
  assert f"--model={out}" in first.stdout
  assert "Unable to initialize backend" not in first.stderr
  _assert_parses(first.stdout.rsplit("run it with ", 1)[1])
  # A second run into the folder is refused before training (no --force);
  # a continued pair replaces its own folder.
  again = subprocess.run(
      [sys.executable, "-m", "experiments.train_pair",
       f"--output_dir={out}", "--steps=2"], cwd=_ROOT,
      env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=600)
  assert again.returncode == 2 and "--force" in again.stderr, again.stderr
  _run("train_pair", f"--corpus_root={corpus.stdlib_root() / 'json'}",
       "--steps=2", f"--init_from={out}", f"--output_dir={out}",
       f"--cache_dir={cache}", *_TINY)
  meta = json.loads((out / "config.json").read_text())
  assert meta["corpus"]["held_out_files"] == 1      # json/decoder.py
  assert "json" in meta["corpus"]["source"]
  assert meta["training"]["steps"] == 2
  assert [r["training"]["steps"] for r in meta["earlier_runs"]] == [3]
  assert "--init_from" in meta["command"]

  from dyadic_jax.bridge import generate  # pylint: disable=g-import-not-at-top
  from dyadic_jax.models import pair as pair_lib  # pylint: disable=g-import-not-at-top
  pair = pair_lib.load_dir(out, max_depth=3)
  assert pair.target.vocab == pair.draft.vocab == pair.tokenizer.vocab == 300
  out_tokens = generate.target_only(pair.target, ["import json\n"],
                                    max_new_tokens=4,
                                    tokenizer=pair.tokenizer).tokens
  assert [len(t) for t in out_tokens] == [4]


def test_a_distilled_draft_gets_closer_to_its_fixed_target(tmp_path):
  """--draft_only --distill=kl on a tiny pair: the held-out KL(p || q)
  falls and the exact acceptance rises (before and after in config.json),
  the target's weights are written back unchanged, the record keeps the
  pair's run and the distillation's settings."""
  pair, out, cache = tmp_path / "pair", tmp_path / "draft", tmp_path / "c"
  root = f"--corpus_root={corpus.stdlib_root() / 'json'}"
  _run("train_pair", root, "--steps=12", f"--output_dir={pair}",
       f"--cache_dir={cache}", *_TINY)
  run = _run("train_pair", root, "--steps=12", f"--init_from={pair}",
             f"--output_dir={out}", f"--cache_dir={cache}", "--draft_only",
             "--distill=kl", "--topk_penalty=0.1", "--topk_penalty_k=16",
             "--acceptance_windows=2", "--acceptance_ks=16,32,1000", *_TINY)
  assert "step 12/12 loss target" in run.stderr and " kl " in run.stderr
  assert "sum min(p, q), sparse k=32" in run.stdout
  meta = json.loads((out / "config.json").read_text())
  acc = meta["held_out_acceptance"]
  assert acc["ks"] == [16, 32] and acc["windows"] == 2   # 1000 >= V
  before, after = acc["before"], acc["after"]
  assert after["kl"] < before["kl"]
  assert after["dense"] > before["dense"]
  for record in (before, after):
    assert record["k16"] <= record["k32"] <= record["dense"] + 1e-9
    assert record["k32"] <= 1 - record["outside_p_k32"] + 1e-9
  assert meta["distillation"]["objective"] == "kl"
  assert meta["distillation"]["topk_penalty_k"] == 16
  assert meta["earlier_runs"][-1]["training"]["steps"] == 12
  assert (out / "target.safetensors").read_bytes() == (
      pair / "target.safetensors").read_bytes()
  assert (out / "draft.safetensors").read_bytes() != (
      pair / "draft.safetensors").read_bytes()


def test_distillation_flags_need_draft_only():
  for flag in ("--distill=kl", "--topk_penalty=0.5", "--draft_from_scratch"):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train_pair", flag], cwd=_ROOT,
        env=paths.subprocess_env(), capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2 and "needs --draft_only" in proc.stderr, (
        flag, proc.stderr)
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train_pair", "--draft_only"],
      cwd=_ROOT, env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=120)
  assert proc.returncode == 2 and "needs --init_from" in proc.stderr
