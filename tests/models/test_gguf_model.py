"""`gguf_model`: GGUF files read into the transformer's Llama family.

The default tier writes a tiny Llama GGUF itself with `gguf`'s writer
(Q4_1 projections, a Q8_0 embedding, F32 norms, q and k rows permuted the
way llama.cpp's converter does, grouped-query attention, a byte-level BPE)
and checks the loader against an independent float64 numpy forward that
computes the way llama.cpp does: on the file's permuted rows with
interleaved RoPE. The real SmolLM2 file's tests run where it is installed
(`requirements-models.txt`); the transformers comparison where an
interpreter with torch and transformers is named by
DYADIC_JAX_HF_PYTHON (default: this one), else it skips.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from dyadic_jax.models import gguf_model  # pylint: disable=wrong-import-position
from dyadic_jax.models import pair  # pylint: disable=wrong-import-position
from dyadic_jax.models import transformer as tf  # pylint: disable=wrong-import-position

D, H, KV, FF, LAYERS, BASE, EPS = 64, 4, 2, 96, 2, 5000.0, 1e-5
DH = D // H
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "1 2"]


def _vocab() -> list[str]:
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  return CONTROL + alphabet + ["Ġt", "he", "Ġthe", "Ġa", "12"]


def _write_tiny(path, seed: int = 0) -> dict[str, np.ndarray]:
  """A tiny Llama GGUF at path; returns each tensor as the file holds it
  after dequantization ((out, in) rows, q and k permuted)."""
  rng = np.random.default_rng(seed)
  vocab = _vocab()
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(LAYERS)
  writer.add_context_length(512)
  writer.add_embedding_length(D)
  writer.add_feed_forward_length(FF)
  writer.add_head_count(H)
  writer.add_head_count_kv(KV)
  writer.add_rope_freq_base(BASE)
  writer.add_rope_dimension_count(DH)
  writer.add_layer_norm_rms_eps(EPS)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm")
  writer.add_token_list(vocab)
  writer.add_token_types([3] * len(CONTROL) + [1] * (len(vocab) - 3))
  writer.add_token_merges(MERGES)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  q = gguf.GGMLQuantizationType
  held = {}

  def put(name, w, qtype):
    w = np.asarray(w, np.float32)
    if qtype == q.F32:
      data = w
    else:
      data = gguf.quants.quantize(w, qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)
    held[name] = np.asarray(gguf.quants.dequantize(data, qtype),
                            np.float32).reshape(w.shape)

  put("token_embd.weight", rng.normal(0, 0.5, (len(vocab), D)), q.Q8_0)
  put("output_norm.weight", 1 + 0.1 * rng.normal(size=D), q.F32)
  for i in range(LAYERS):
    pre = f"blk.{i}."
    put(pre + "attn_norm.weight", 1 + 0.1 * rng.normal(size=D), q.F32)
    put(pre + "ffn_norm.weight", 1 + 0.1 * rng.normal(size=D), q.F32)
    # The converter's permutation, applied as it writes q and k.
    put(pre + "attn_q.weight", gguf_model.permute(
        rng.normal(0, 0.2, (H * DH, D)), H), q.Q4_1)
    put(pre + "attn_k.weight", gguf_model.permute(
        rng.normal(0, 0.2, (KV * DH, D)), KV), q.Q4_1)
    put(pre + "attn_v.weight", rng.normal(0, 0.2, (KV * DH, D)), q.Q4_1)
    put(pre + "attn_output.weight", rng.normal(0, 0.2, (D, H * DH)), q.Q4_1)
    put(pre + "ffn_gate.weight", rng.normal(0, 0.2, (FF, D)), q.Q4_1)
    put(pre + "ffn_up.weight", rng.normal(0, 0.2, (FF, D)), q.Q4_1)
    put(pre + "ffn_down.weight", rng.normal(0, 0.2, (D, FF)), q.Q4_1)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return held


def _numpy_forward(t: dict[str, np.ndarray], tokens, heads, kv, eps, base
                   ) -> np.ndarray:
  """Logits f64[T, V] the way llama.cpp computes them: the file's
  (permuted) q and k rows, RoPE on interleaved pairs, k and v heads
  repeated for grouped-query attention."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  x = t["token_embd.weight"][tokens]
  n, d = x.shape
  dh = d // heads
  norm = lambda y, w: y / np.sqrt(np.mean(y * y, -1, keepdims=True) + eps) * w
  pos = np.arange(n)[:, None]
  freqs = base ** (-np.arange(0, dh, 2) / dh)
  cos, sin = np.cos(pos * freqs), np.sin(pos * freqs)      # [T, dh / 2]

  def rope(y):                                              # [T, h, dh]
    even, odd = y[..., 0::2], y[..., 1::2]
    c, s = cos[:, None], sin[:, None]
    out = np.empty_like(y)
    out[..., 0::2], out[..., 1::2] = even * c - odd * s, even * s + odd * c
    return out

  layers = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("blk."))
  mask = np.tril(np.ones((n, n), bool))
  for i in range(layers):
    w = {k[len(f"blk.{i}."):]: v for k, v in t.items()
         if k.startswith(f"blk.{i}.")}
    h = norm(x, w["attn_norm.weight"])
    q = rope((h @ w["attn_q.weight"].T).reshape(n, heads, dh))
    k = rope((h @ w["attn_k.weight"].T).reshape(n, kv, dh))
    v = (h @ w["attn_v.weight"].T).reshape(n, kv, dh)
    k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dh)
    scores = np.where(mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    att = np.einsum("hts,shd->thd", p, v).reshape(n, d)
    x = x + att @ w["attn_output.weight"].T
    h = norm(x, w["ffn_norm.weight"])
    gate = h @ w["ffn_gate.weight"].T
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ w["ffn_up.weight"].T)
             ) @ w["ffn_down.weight"].T
  return norm(x, t["output_norm.weight"]) @ t["token_embd.weight"].T


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
  held = _write_tiny(path)
  return path, held, gguf_model.read(path, max_len=64)


def test_config_and_tokenizer_from_the_file(tiny):
  _, _, model = tiny
  c = model.config
  assert (c.vocab, c.d_model, c.n_layers, c.n_heads, c.kv_heads, c.d_ff,
          c.mlp, c.rope_base, c.max_len) == (len(_vocab()), D, LAYERS, H, KV,
                                             FF, "swiglu", BASE, 64)
  assert c.norm_eps == pytest.approx(EPS)
  assert (model.bos, model.eos) == (1, 2)
  tok = model.tokenizer
  text = "<|im_start|>user\n the 1234 heé!<|im_end|>\n"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  # Control tokens whole, merges applied, digits one by one.
  assert ids[0] == 1 and 2 in ids.tolist()
  assert _vocab().index("Ġthe") in ids.tolist()
  digits = [_vocab()[i] for i in ids if _vocab()[i] in "1234"]
  assert digits == ["1", "2", "3", "4"]      # the "1 2" merge never applies


def test_weights_are_the_files_unpermuted(tiny):
  _, held, model = tiny
  p = model.params
  np.testing.assert_array_equal(p.embed, held["token_embd.weight"])
  q_rows = np.asarray(p.wqkv[1, :, :H]).reshape(D, H * DH).T
  np.testing.assert_array_equal(
      gguf_model.permute(q_rows, H), held["blk.1.attn_q.weight"])
  k_rows = np.asarray(p.wqkv[1, :, H:H + KV]).reshape(D, KV * DH).T
  np.testing.assert_array_equal(
      gguf_model.permute(k_rows, KV), held["blk.1.attn_k.weight"])
  np.testing.assert_array_equal(np.asarray(p.w_in[0, :, FF:]).T,
                                held["blk.0.ffn_up.weight"])
  w = np.random.default_rng(1).normal(size=(3 * 8, 5))
  np.testing.assert_array_equal(
      gguf_model.unpermute(gguf_model.permute(w, 3), 3), w)


def test_forms_equal_an_independent_numpy_forward(tiny):
  """forward, extend (chunked) and the slab's rows all equal llama.cpp's
  arithmetic on the file's own rows (float64), to float32 rounding."""
  _, held, model = tiny
  c = model.config
  tokens = np.random.default_rng(3).integers(0, c.vocab, 40).astype(np.int32)
  want = _numpy_forward(held, tokens, H, KV, c.norm_eps, c.rope_base)
  arch = tf.arch_of(c)
  params = jax.tree.map(jnp.asarray, model.params)
  got = np.asarray(tf.forward(params, tokens[None], arch)[0])
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 2e-5 * scale
  cache = tf.empty_cache(c)
  rows_a, cache = tf.feed(params, cache, tokens[:29], 0, arch)
  rows_b, cache = tf.feed(params, cache, tokens[29:], 29, arch)
  chunked = np.concatenate([np.asarray(rows_a), np.asarray(rows_b)])
  assert np.abs(chunked - want).max() <= 2e-5 * scale
  target = pair.TransformerTarget(params, c)
  batch = target.batch(2)
  rows = np.asarray(batch.rows([5, 6], [tokens[:20], tokens[:33]],
                               np.stack([tokens[20:27], tokens[33:40]])))
  assert np.abs(rows[0] - want[19:27]).max() <= 2e-5 * scale
  assert np.abs(rows[1] - want[32:40]).max() <= 2e-5 * scale


def test_refusals(tiny, tmp_path):
  path, _, _ = tiny
  with pytest.raises(ValueError, match="architecture"):
    bad = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(bad), "gpt2")
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf_model.read(bad)
  with pytest.raises(ValueError, match="n_kv_heads"):
    tf.Config(vocab=8, d_model=8, n_layers=1, n_heads=4, d_ff=8, max_len=8,
              n_kv_heads=3)
  with pytest.raises(ValueError, match="mlp"):
    tf.Config(vocab=8, d_model=8, n_layers=1, n_heads=4, d_ff=8, max_len=8,
              mlp="relu")
  assert gguf_model.read(path, max_len=10_000).config.max_len == 512


def test_locate_says_how_to_install(monkeypatch, tmp_path):
  def absent(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", absent)
  with pytest.raises(gguf_model.ModelMissing) as caught:
    gguf_model.locate(gguf_model.SMOLLM2)
  message = str(caught.value)
  assert "\n" not in message and "requirements-models.txt" in message

  class Dist:
    version = gguf_model.SMOLLM2.version

    @staticmethod
    def locate_file(member):
      path = tmp_path / member
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_bytes(b"not the pinned file")
      return path
  monkeypatch.setattr(importlib.metadata, "distribution", lambda n: Dist)
  with pytest.raises(gguf_model.ModelMissing, match="SHA-256"):
    gguf_model.locate(gguf_model.SMOLLM2)
  Dist.version = "0.0.1"
  with pytest.raises(gguf_model.ModelMissing, match="pinned"):
    gguf_model.locate(gguf_model.SMOLLM2)


def _installed():
  try:
    return gguf_model.locate(gguf_model.SMOLLM2, check=False)
  except gguf_model.ModelMissing as missing:
    pytest.skip(str(missing))


@pytest.fixture(scope="module")
def smollm2():
  return gguf_model.read(_installed(), max_len=128)


def test_smollm2_answers_in_english(smollm2):
  """The pinned file (checked) answers a chat prompt greedily in English,
  and its rows equal the numpy forward on the file's own tensors."""
  gguf_model.locate(gguf_model.SMOLLM2)        # the SHA-256 too
  m = smollm2
  assert (m.config.n_layers, m.config.kv_heads, m.config.vocab) == (
      30, 3, 49152)
  ids = m.tokenizer.encode(gguf_model.chat("What is the capital of France?"))
  arch = tf.arch_of(m.config)
  params = jax.tree.map(jnp.asarray, m.params)
  rows, cache = tf.feed(params, tf.empty_cache(m.config), ids, 0, arch)
  out, pos = [int(jnp.argmax(rows[-1]))], len(ids)
  while out[-1] != m.eos and len(out) < 12:
    row, cache = tf.extend(params, cache, np.asarray(out[-1:], np.int32), pos,
                           arch)
    out.append(int(jnp.argmax(row[-1])))
    pos += 1
  assert "Paris" in m.tokenizer.decode(out)
  reader = gguf.GGUFReader(str(_installed()))
  held = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                             np.float32).reshape(
                                 tuple(int(n) for n in reversed(t.shape)))
          for t in reader.tensors}
  want = _numpy_forward(held, ids[:12], 9, 3, m.config.norm_eps,
                        m.config.rope_base)
  got = np.asarray(tf.forward(params, ids[None, :12], arch)[0])
  assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_smollm2_logits_match_transformers():
  """transformers' own GGUF loading of the same file (its dequantization
  and its LlamaForCausalLM) against ours: the documented bound is 1e-4 of
  the largest logit."""
  path = _installed()
  python = os.environ.get("DYADIC_JAX_HF_PYTHON", sys.executable)
  script = textwrap.dedent(f"""
      import json, os, sys
      import torch, transformers
      torch.set_num_threads(2)
      folder, name = os.path.split({str(path)!r})
      model = transformers.AutoModelForCausalLM.from_pretrained(
          folder, gguf_file=name, torch_dtype=torch.float32)
      ids = json.loads(sys.stdin.read())
      with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].numpy()
      print(json.dumps(out.tolist()))
  """)
  probe = subprocess.run([python, "-c", "import torch, transformers, accelerate"],
                         capture_output=True, check=False)
  if probe.returncode:
    pytest.skip(f"{python} has no torch, transformers and accelerate "
                "(DYADIC_JAX_HF_PYTHON names one that has)")
  m = gguf_model.read(path, max_len=64)
  ids = m.tokenizer.encode(gguf_model.chat("Name a color."))[:24]
  done = subprocess.run([python, "-c", script], input=json.dumps(
      [int(i) for i in ids]), capture_output=True, text=True, check=True)
  theirs = np.asarray(json.loads(done.stdout.strip().splitlines()[-1]))
  ours = np.asarray(tf.forward(jax.tree.map(jnp.asarray, m.params),
                               ids[None], tf.arch_of(m.config))[0])
  assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
