"""experiments/export_hf.py and dyadic_jax/models/hf_layout.py.

* The exported tensors, run through a numpy transcription of
  `ArceeForCausalLM`'s forward (a torch `Linear` computes x W^T, rotary
  embeddings by `rotate_half`, tanh GELU, RMSNorm, tied logits), give
  `transformer.forward`'s logits: the mapping is checked without torch.
* transformers itself loads the export and its logits agree with ours
  within 1e-4: with torch and transformers in this interpreter, or in the
  one $DYADIC_JAX_HF_PYTHON names (the README's /tmp/hf venv, say);
  skipped, with the reason, where neither has them.
* The command refuses an existing export without --force, and a file.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from dyadic_jax.models import hf_layout
from dyadic_jax.models import pair as pair_lib
from dyadic_jax.models import transformer
from tests import paths

_TOKENS = [5, 100, 200, 300, 17, 4000, 12, 99, 0, 1, 2, 3]


@pytest.fixture(name="shipped", scope="module")
def _shipped():
  return pair_lib.load_pair("stdlib")


def _arcee_forward(t: dict, config: dict, tokens: list[int]) -> np.ndarray:
  """ArceeForCausalLM's logits [T, V] of tokens, in numpy float64."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  heads, dh = config["num_attention_heads"], config["head_dim"]
  eps, n = config["rms_norm_eps"], len(tokens)

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

  def rotate_half(x):
    return np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)

  inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dh, 2) / dh)
  angles = np.arange(n)[:, None] * inv_freq[None, :]
  cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
  sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
  x = t["model.embed_tokens.weight"][tokens]
  causal = np.tril(np.ones((n, n), bool))
  for i in range(config["num_hidden_layers"]):
    pre = f"model.layers.{i}."
    h = norm(x, t[pre + "input_layernorm.weight"])
    q, k, v = (
        (h @ t[pre + f"self_attn.{c}_proj.weight"].T).reshape(n, heads, dh)
        for c in "qkv")
    q, k = (y * cos + rotate_half(y) * sin for y in (q, k))
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dh)
    scores = np.where(causal, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    att = np.einsum("hts,shd->thd", w, v).reshape(n, heads * dh)
    x = x + att @ t[pre + "self_attn.o_proj.weight"].T
    h = norm(x, t[pre + "post_attention_layernorm.weight"])
    up = h @ t[pre + "mlp.up_proj.weight"].T
    gelu = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi)
                                   * (up + 0.044715 * up ** 3)))
    x = x + gelu @ t[pre + "mlp.down_proj.weight"].T
  return norm(x, t["model.norm.weight"]) @ t["model.embed_tokens.weight"].T


@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_layout_is_arcees_forward(shipped, role):
  model = getattr(shipped, role)
  config = hf_layout.hf_config(model.config)
  tensors = hf_layout.hf_tensors(model.params)
  assert all(v.dtype == np.float32 and v.flags.c_contiguous
             for v in tensors.values())
  ours = np.asarray(transformer.forward(model.params, np.array([_TOKENS])))[0]
  theirs = _arcee_forward(tensors, config, _TOKENS)
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def _hf_python() -> str | None:
  named = os.environ.get("DYADIC_JAX_HF_PYTHON")
  if named:
    return named
  if all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
    return sys.executable
  return None


_LOAD = """
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, tokens, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
AutoTokenizer.from_pretrained(folder)
with torch.no_grad():
  np.save(out, model(torch.tensor([tokens])).logits[0].numpy())
print(type(model).__name__)
"""


def _export(tmp_path, *flags):
  return subprocess.run(
      [sys.executable, "-m", "experiments.export_hf", "--model=stdlib",
       f"--output_dir={tmp_path / 'hf'}", *flags], cwd=paths.ROOT,
      env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=300)


def test_transformers_loads_the_export(shipped, tmp_path):
  python = _hf_python()
  if python is None:
    pytest.skip("torch and transformers are not installed here, and "
                "$DYADIC_JAX_HF_PYTHON names no interpreter that has them")
  run = _export(tmp_path)
  assert run.returncode == 0, run.stderr
  for role in ("target", "draft"):
    out = tmp_path / f"{role}.npy"
    load = subprocess.run(
        [python, "-c", _LOAD, str(tmp_path / "hf" / role),
         json.dumps(_TOKENS), str(out)], capture_output=True, text=True,
        timeout=300)
    assert load.returncode == 0, load.stderr[-3000:]
    assert load.stdout.split()[-1] == "ArceeForCausalLM"
    model = getattr(shipped, role)
    ours = np.asarray(transformer.forward(model.params,
                                          np.array([_TOKENS])))[0]
    np.testing.assert_allclose(np.load(out), ours, atol=1e-4, rtol=0)


def test_the_command_refuses_to_overwrite(tmp_path):
  assert _export(tmp_path).returncode == 0
  again = _export(tmp_path)
  assert again.returncode == 2
  assert again.stderr.splitlines() == [
      f"export_hf: --output_dir={tmp_path / 'hf'} already holds an export "
      "(target, draft); --force replaces it (--helpfull lists every flag)"]
  assert _export(tmp_path, "--force").returncode == 0
  (tmp_path / "file").write_text("")
  run = subprocess.run(
      [sys.executable, "-m", "experiments.export_hf",
       f"--output_dir={tmp_path / 'file'}"], cwd=paths.ROOT,
      env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=300)
  assert run.returncode == 2
  assert "is a file, not a folder" in run.stderr
  assert pathlib.Path(tmp_path / "hf" / "target" / "model.safetensors").stat(
  ).st_size > 0
