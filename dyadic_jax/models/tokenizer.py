"""A byte-level BPE tokenizer: a thin wrapper over HF `tokenizers`.

Byte-level means every string round-trips exactly (decode(encode(s)) == s
for any unicode and whitespace): unknown characters fall back to their
UTF-8 bytes, which are all in the base alphabet. `tokenizers` (the [models]
extra) is imported inside the functions, so importing this module (or the
core) costs nothing without it.

Token 0 is the special `END_OF_TEXT` ("<|endoftext|>"), used to separate
documents in training; `encode` never produces it from plain text.
"""

import os
import typing
from collections.abc import Iterable

import numpy as np

from dyadic_jax import extras

END_OF_TEXT = "<|endoftext|>"


def _tokenizers() -> typing.Any:
  return extras.load("tokenizers", "dyadic_jax.models.tokenizer")


class Tokenizer:
  """An `encode`/`decode` pair over a trained `tokenizers.Tokenizer`."""

  def __init__(self, hf_tokenizer: typing.Any):
    self._tok = hf_tokenizer

  @property
  def vocab(self) -> int:
    """Number of token ids (the models' V)."""
    return int(self._tok.get_vocab_size())

  @property
  def end_of_text(self) -> int:
    """The id of `END_OF_TEXT`."""
    return int(self._tok.token_to_id(END_OF_TEXT))

  def encode(self, text: str) -> np.ndarray:
    """int32[n] token ids of text."""
    return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    """`encode` of each text (parallel inside `tokenizers`)."""
    return [np.asarray(e.ids, dtype=np.int32)
            for e in self._tok.encode_batch(texts)]

  def decode(self, ids: typing.Any) -> str:
    """The text of token ids (any int sequence or array)."""
    return str(self._tok.decode([int(i) for i in np.asarray(ids).ravel()],
                                skip_special_tokens=False))

  def to_json(self) -> str:
    """The tokenizer.json text (what `save` writes)."""
    return str(self._tok.to_str())

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes tokenizer.json to path."""
    with open(path, "w", encoding="utf-8") as f:
      f.write(self.to_json())


def train(texts: Iterable[str], vocab: int) -> Tokenizer:
  """Trains a byte-level BPE of at most `vocab` ids on texts.

  Deterministic for the same texts in the same order. vocab must exceed the
  256 byte tokens plus the special token.
  """
  if vocab < 258:
    raise ValueError(f"tokenizer.train: vocab must be >= 258, got {vocab}")
  tokenizers = _tokenizers()
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = tokenizers.Tokenizer(models.BPE())
  # add_prefix_space=False: the text's own spaces are kept byte for byte.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab, special_tokens=[END_OF_TEXT], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer=trainer)
  return Tokenizer(tok)


def from_json(text: str) -> Tokenizer:
  """A tokenizer from tokenizer.json text."""
  tokenizers = _tokenizers()
  return Tokenizer(tokenizers.Tokenizer.from_str(text))


def load(path: str | os.PathLike[str]) -> Tokenizer:
  """Reads a tokenizer.json written by `Tokenizer.save`."""
  with open(path, encoding="utf-8") as f:
    return from_json(f.read())
