"""A `transformer` in Hugging Face transformers' layout: `ArceeForCausalLM`
(the project's own family) or `LlamaForCausalLM` (the Llama family).

    hf_config(config)  -> dict                  its config.json
    hf_tensors(params) -> {name: float32 array} its state dict
    save(directory, params, config, tokenizer_json)
    export_pair(checkpoint_dir, out_dir) -> {"target": folder, "draft": ...}

The architecture maps exactly: pre-RMSNorm blocks (eps 1e-6), rotary
embeddings over the whole head with base 1e4 in the half-split form
(transformers' `rotate_half`), a non-gated MLP with tanh GELU
(`hidden_act="gelu_pytorch_tanh"`, `jax.nn.gelu`'s default), tied
embeddings, no biases, as many key/value heads as query heads. The
Llama family maps the same way with its SwiGLU MLP, grouped key/value
heads, RoPE base and norm eps; a draft over a restricted vocabulary
(`vocab_map`) is written over the full vocabulary with an untied output
layer whose rows outside the kept ids are zero (logit 0: close to, not
exactly, the draft's zero weight there). Weights are
written in float32, the dtype the project computes in, so transformers'
logits differ from `transformer.forward`'s by float rounding only
(tests/experiments/test_export_hf.py). Nothing here imports torch or
transformers: the files are plain safetensors and JSON.
"""

import json
import os
import pathlib
import typing

import numpy as np

from dyadic_jax import extras
from dyadic_jax.models import checkpoint
from dyadic_jax.models import transformer
from dyadic_jax.models.tokenizer import END_OF_TEXT

MODEL_FILE = "model.safetensors"


def hf_config(config: transformer.Config) -> dict:
  """The config.json of config's `ArceeForCausalLM` (or, for the Llama
  family, `LlamaForCausalLM`)."""
  if config.mlp == "swiglu":
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base,
        "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": True, "torch_dtype": "float32",
        "use_cache": True, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2}
  return {
      "architectures": ["ArceeForCausalLM"],
      "model_type": "arcee",
      "vocab_size": config.vocab,
      "hidden_size": config.d_model,
      "intermediate_size": config.d_ff,
      "num_hidden_layers": config.n_layers,
      "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_heads,
      "head_dim": config.head_dim,
      "hidden_act": "gelu_pytorch_tanh",
      "max_position_embeddings": config.max_len,
      "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0,
      "rope_scaling": None,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "tie_word_embeddings": True,
      "torch_dtype": "float32",
      "use_cache": True,
      "bos_token_id": None,
      "eos_token_id": 0,        # END_OF_TEXT's id (tokenizer.py)
      "pad_token_id": 0,
  }


def hf_tensors(params: transformer.Params) -> dict[str, np.ndarray]:
  """params as `ArceeForCausalLM`'s state dict (float32, C order).

  A torch `Linear` holds [out, in] and computes x W^T; the project's
  einsums hold [in, ...out]: every projection is transposed here.
  """
  p = {k: np.asarray(v, np.float32) for k, v in params._asdict().items()}
  layers, d = p["wqkv"].shape[0], p["wqkv"].shape[1]
  heads, f = p["wo"].shape[1], p["w_out"].shape[1]
  kv = (p["wqkv"].shape[2] - heads) // 2
  out = {"model.embed_tokens.weight": p["embed"],
         "model.norm.weight": p["final_norm"]}
  for i in range(layers):
    pre = f"model.layers.{i}."
    wqkv = p["wqkv"][i]                        # [d, H + 2 Hkv, dh]
    parts = {"q": wqkv[:, :heads], "k": wqkv[:, heads:heads + kv],
             "v": wqkv[:, heads + kv:]}
    for name, w in parts.items():
      out[pre + f"self_attn.{name}_proj.weight"] = w.reshape(d, -1).T
    out[pre + "self_attn.o_proj.weight"] = p["wo"][i].reshape(-1, d).T
    out[pre + "input_layernorm.weight"] = p["attn_norm"][i]
    out[pre + "post_attention_layernorm.weight"] = p["mlp_norm"][i]
    w_in = p["w_in"][i]
    if w_in.shape[1] == 2 * f:                 # SwiGLU: gate | up
      out[pre + "mlp.gate_proj.weight"] = w_in[:, :f].T
      out[pre + "mlp.up_proj.weight"] = w_in[:, f:].T
    else:
      out[pre + "mlp.up_proj.weight"] = w_in.T
    out[pre + "mlp.down_proj.weight"] = p["w_out"][i].T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save(directory: str | os.PathLike[str], params: transformer.Params,
         config: transformer.Config, tokenizer_json: str) -> pathlib.Path:
  """Writes a folder `AutoModelForCausalLM.from_pretrained` and
  `AutoTokenizer.from_pretrained` load: config.json, model.safetensors,
  tokenizer.json and tokenizer_config.json. Returns the folder."""
  st_numpy = extras.load("safetensors.numpy", "dyadic_jax.models.hf_layout")
  folder = pathlib.Path(directory)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(hf_config(config), indent=1))
  with open(folder / MODEL_FILE, "wb") as f:
    f.write(st_numpy.save(hf_tensors(params), metadata={"format": "pt"}))
  (folder / "tokenizer.json").write_text(tokenizer_json)
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast",
      "eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT,
      "model_max_length": config.max_len}, indent=1))
  return folder


def save_full_vocab(directory: str | os.PathLike[str],
                    params: transformer.Params, config: transformer.Config,
                    kept: typing.Any, vocab: int) -> pathlib.Path:
  """A draft over a restricted vocabulary (K kept ids, model ids 0..K-1,
  K the "other" input id) as a `LlamaForCausalLM` over all `vocab` ids:
  every input id outside the set embeds as "other", the untied output
  layer has the kept rows and zeros elsewhere. No tokenizer is written
  (the target's is the one to use). Returns the folder."""
  st_numpy = extras.load("safetensors.numpy", "dyadic_jax.models.hf_layout")
  kept = np.asarray(kept, np.int64)
  small = np.asarray(params.embed, np.float32)
  embed = np.repeat(small[kept.size:kept.size + 1], vocab, axis=0)
  embed[kept] = small[:kept.size]
  head = np.zeros_like(embed)
  head[kept] = small[:kept.size]
  tensors = hf_tensors(params._replace(embed=typing.cast(typing.Any, embed)))
  tensors["lm_head.weight"] = head
  folder = pathlib.Path(directory)
  folder.mkdir(parents=True, exist_ok=True)
  hf = {**hf_config(config), "vocab_size": vocab,
        "tie_word_embeddings": False}
  (folder / "config.json").write_text(json.dumps(hf, indent=1))
  with open(folder / MODEL_FILE, "wb") as f:
    f.write(st_numpy.save({k: np.ascontiguousarray(v)
                           for k, v in tensors.items()},
                          metadata={"format": "pt"}))
  return folder


def export_pair(checkpoint_dir: str | os.PathLike[str],
                out_dir: str | os.PathLike[str]) -> dict[str, pathlib.Path]:
  """The pair in a `checkpoint` directory as OUT/target and OUT/draft
  (`save` each, with the pair's tokenizer)."""
  source = pathlib.Path(checkpoint_dir)
  meta = checkpoint.read_config(source / checkpoint.CONFIG_FILE)
  tokenizer_json = (source / meta.get(
      "tokenizer_file", checkpoint.TOKENIZER_FILE)).read_text()
  files = {"target": checkpoint.TARGET_FILE, "draft": checkpoint.DRAFT_FILE}
  folders = {}
  for role, name in files.items():
    config = checkpoint.model_config(meta, role)
    params = checkpoint.load_params(source / name, config)
    folders[role] = save(pathlib.Path(out_dir) / role, params, config,
                         tokenizer_json)
  return folders
