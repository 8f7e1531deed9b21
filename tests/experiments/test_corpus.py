"""The stdlib corpus: split by path, fingerprint, held-out prompts."""

import numpy as np
import pytest

from experiments import corpus


class _Bytes:
  """A stand-in tokenizer: one token per UTF-8 byte."""

  def encode(self, text):
    return np.frombuffer(text.encode(), np.uint8).astype(np.int32)


@pytest.fixture
def tree(tmp_path):
  for i in range(200):
    sub = tmp_path / ("pkg" if i % 2 else "") / f"m{i}.py"
    sub.parent.mkdir(exist_ok=True)
    sub.write_text(f"x = {i}\n" * (10 + i))
  (tmp_path / "site-packages").mkdir()
  (tmp_path / "site-packages" / "skip.py").write_text("no = 1\n")
  (tmp_path / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
  return tmp_path


def test_files_split_and_fingerprint(tree):
  files = corpus.load_files(tree)
  paths = [f.path for f in files]
  assert len(files) == 200 and paths == sorted(paths)
  assert not any("site-packages" in p or p == "latin.py" for p in paths)
  train, held = corpus.split(files)
  assert 0 < len(held) < 30 and len(train) + len(held) == 200
  # The split is by path alone: a subset splits the same way.
  _, held_sub = corpus.split(files[:100])
  assert {f.path for f in held_sub} <= {f.path for f in held}
  assert corpus.fingerprint(files) == corpus.fingerprint(files[::-1])
  (tree / "m0.py").write_text("changed\n")
  assert corpus.fingerprint(corpus.load_files(tree)) != corpus.fingerprint(
      files)


def test_held_out_prompts_are_deterministic(tree):
  files = corpus.load_files(tree)
  a = corpus.held_out_prompts(_Bytes(), 5, 40, seed=1, files=files)
  b = corpus.held_out_prompts(_Bytes(), 5, 40, seed=1, files=files)
  assert a.shape == (5, 40) and a.dtype == np.int32
  np.testing.assert_array_equal(a, b)
  held_text = "".join(f.text for f in corpus.split(files)[1])
  assert bytes(a[0].astype(np.uint8)).decode() in held_text
  with pytest.raises(ValueError, match="no held-out file"):
    corpus.held_out_prompts(_Bytes(), 1, 10**6, seed=0, files=files)


def test_training_prompts_come_from_the_training_files(tree):
  """What `adaptive_depth --train_prompts` tunes on: the same cut from the
  other side of the split, never a held-out file's text."""
  files = corpus.load_files(tree)
  train = corpus.prompts(_Bytes(), 5, 40, seed=1, files=files,
                         held_out=False)
  train_text = "".join(f.text for f in corpus.split(files)[0])
  assert train.shape == (5, 40)
  for row in train:
    assert bytes(row.astype(np.uint8)).decode() in train_text
  np.testing.assert_array_equal(train, corpus.prompts(
      _Bytes(), 5, 40, seed=1, files=files, held_out=False))
  with pytest.raises(ValueError, match="no training file"):
    corpus.prompts(_Bytes(), 1, 10**6, seed=0, files=files, held_out=False)


def test_the_real_stdlib_is_there():
  root = corpus.stdlib_root()
  assert (root / "os.py").is_file()
  assert corpus.is_held_out("os.py") in (True, False)
