"""Checkpoints of a draft/target pair: safetensors weights plus JSON metadata.

A checkpoint directory holds

    target.safetensors   the target's `transformer.Params`, float16
    draft.safetensors    the draft's, float16
    tokenizer.json       the shared byte-level BPE (`tokenizer.Tokenizer`)
    config.json          both `transformer.Config`s, the tokenizer file name,
                         and whatever the trainer records (corpus
                         fingerprint, command, held-out loss, date ...)

Weights are stored in float16 to halve the file (the shipped pair must stay
small) and upcast to float32 on load: a loaded weight differs from the saved
float32 one by at most its float16 rounding, |w| * 2^-11 relative (plus the
float16 subnormal step 2^-24 near zero). `safetensors` (the [models]
extra) is imported inside the functions.
"""

import json
import os
import typing

import jax.numpy as jnp
import numpy as np

from dyadic_jax import extras
from dyadic_jax.models import transformer

TARGET_FILE = "target.safetensors"
DRAFT_FILE = "draft.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"

_PathLike = str | os.PathLike[str]


def save_params(path: _PathLike, params: transformer.Params) -> None:
  """Writes params to a safetensors file, each array as float16."""
  st_numpy = extras.load("safetensors.numpy", "dyadic_jax.models.checkpoint")
  arrays = {name: np.asarray(value, np.float32).astype(np.float16)
            for name, value in params._asdict().items()}
  # Written by open(), not save_file, so the file gets the umask's mode
  # (save_file makes it owner-only: 0600).
  with open(path, "wb") as f:
    f.write(st_numpy.save(arrays))


def load_params(path: _PathLike,
                config: transformer.Config) -> transformer.Params:
  """Reads a `save_params` file as float32 params, checked against config.

  Raises:
    ValueError: a tensor is missing, extra, or of the wrong shape.
  """
  st_numpy = extras.load("safetensors.numpy", "dyadic_jax.models.checkpoint")
  arrays = st_numpy.load_file(os.fspath(path))
  expected = transformer.init_shapes(config)
  if set(arrays) != set(expected):
    raise ValueError(f"load_params: {path} holds tensors {sorted(arrays)}, "
                     f"expected {sorted(expected)}")
  for name, shape in expected.items():
    if name == "wqkv" and arrays[name].shape == legacy_wqkv(shape):
      arrays[name] = arrays[name].reshape(shape)
    if arrays[name].shape != shape:
      raise ValueError(f"load_params: {path}: {name} has shape "
                       f"{arrays[name].shape}, the config says {shape}")
  return transformer.Params(**{
      name: jnp.asarray(arrays[name].astype(np.float32))
      for name in transformer.Params._fields})


def legacy_wqkv(shape: tuple[int, ...]) -> tuple[int, ...] | None:
  """The (L, d, 3, H, dh) layout checkpoints of the project's own family
  were saved in before grouped-query attention, for the fused (L, d, 3H,
  dh) shape (the same bytes); None where the heads are not three equal
  groups."""
  n, d, heads, dh = shape
  return (n, d, 3, heads // 3, dh) if heads % 3 == 0 else None


def write_config(path: _PathLike, config: dict[str, typing.Any]) -> None:
  """Writes the metadata dict as indented, key-sorted JSON."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, sort_keys=True)
    f.write("\n")


def read_config(path: _PathLike) -> dict[str, typing.Any]:
  """Reads `write_config`'s JSON."""
  with open(path, encoding="utf-8") as f:
    return dict(json.load(f))


def model_config(meta: dict[str, typing.Any],
                 role: str) -> transformer.Config:
  """The `transformer.Config` of role ("target" or "draft") in metadata."""
  return transformer.Config(**meta[role])
