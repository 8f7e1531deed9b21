"""The byte-level BPE wrapper: exact round trips, save/load, training."""

import numpy as np
import pytest

from dyadic_jax.models import tokenizer as tokenizer_lib

_TRAIN = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
] * 20

_HELD_OUT_LIKE = [
    "def f(x):\n\treturn x  # tab-indented\r\n",
    "    leading spaces, trailing spaces    \n\n\n",
    "s = 'naïve café – Ωμέγα 中文 ✓ 🐍'\n",
    "\x00\x7f\u200b zero-width and control bytes",
    "",
    " ",
]


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.train(_TRAIN, 300)


@pytest.mark.parametrize("text", _HELD_OUT_LIKE)
def test_round_trip_is_exact(tok, text):
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.ndim == 1
  assert np.all((0 <= ids) & (ids < tok.vocab))
  assert tok.decode(ids) == text


def test_training_learns_merges_and_reserves_end_of_text(tok):
  assert 257 < tok.vocab <= 300
  assert tok.end_of_text == 0
  text = "def add(a, b):\n    return a + b\n"
  assert tok.encode(text).size <= len(text.encode()) / 2
  assert tokenizer_lib.END_OF_TEXT not in tok.decode(tok.encode(text))


def test_save_load_round_trip(tok, tmp_path):
  path = tmp_path / "tokenizer.json"
  tok.save(path)
  back = tokenizer_lib.load(path)
  assert back.vocab == tok.vocab
  for text in _HELD_OUT_LIKE + _TRAIN[:3]:
    np.testing.assert_array_equal(back.encode(text), tok.encode(text))
  batch = back.encode_batch(_TRAIN[:3])
  for ids, text in zip(batch, _TRAIN[:3]):
    np.testing.assert_array_equal(ids, tok.encode(text))


def test_deterministic_and_checked():
  a = tokenizer_lib.train(_TRAIN, 280)
  b = tokenizer_lib.train(_TRAIN, 280)
  assert a.to_json() == b.to_json()
  with pytest.raises(ValueError, match="vocab must be >= 258"):
    tokenizer_lib.train(_TRAIN, 100)
