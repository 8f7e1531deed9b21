"""Checkpoints: the float16 round trip, and the shipped stdlib pair."""

import jax
import numpy as np
import pytest

from dyadic_jax.models import checkpoint
from dyadic_jax.models import pair
from dyadic_jax.models import transformer as tf

CONFIG = tf.Config(vocab=37, d_model=16, n_layers=2, n_heads=2, d_ff=24,
                   max_len=32)
# float16 rounding: relative 2^-11 in the normal range, absolute 2^-25
# below it (subnormal step 2^-24, half of it after rounding).
_REL, _ABS = 2.0**-11, 2.0**-24


def test_round_trip_within_float16_rounding(tmp_path):
  params = tf.init(CONFIG, jax.random.key(3))
  path = tmp_path / "m.safetensors"
  checkpoint.save_params(path, params)
  back = checkpoint.load_params(path, CONFIG)
  for name in tf.Params._fields:
    got, want = np.asarray(getattr(back, name)), np.asarray(getattr(params,
                                                                   name))
    assert got.dtype == np.float32 and got.shape == want.shape
    bound = np.abs(want) * _REL + _ABS
    assert np.all(np.abs(got - want) <= bound), name
  # 2 bytes per weight plus a small header.
  assert path.stat().st_size < 2 * tf.param_count(params) + 2048
  # The umask's mode, as any file this process writes (not owner-only).
  plain = tmp_path / "plain"
  plain.write_bytes(b"")
  assert path.stat().st_mode == plain.stat().st_mode


def test_load_checks_the_config(tmp_path):
  path = tmp_path / "m.safetensors"
  checkpoint.save_params(path, tf.init(CONFIG, jax.random.key(0)))
  other = tf.Config(vocab=37, d_model=16, n_layers=3, n_heads=2, d_ff=24,
                    max_len=32)
  with pytest.raises(ValueError, match="shape"):
    checkpoint.load_params(path, other)


def test_load_dir_round_trip(tmp_path):
  from dyadic_jax.models import tokenizer as tokenizer_lib
  tok = tokenizer_lib.train(["x = 1\n" * 50], 260)
  config = tf.Config(vocab=tok.vocab, d_model=16, n_layers=1, n_heads=2,
                     d_ff=24, max_len=32)
  params = tf.init(config, jax.random.key(1))
  checkpoint.save_params(tmp_path / checkpoint.TARGET_FILE, params)
  checkpoint.save_params(tmp_path / checkpoint.DRAFT_FILE, params)
  tok.save(tmp_path / checkpoint.TOKENIZER_FILE)
  checkpoint.write_config(tmp_path / checkpoint.CONFIG_FILE, {
      "target": config.to_dict(), "draft": config.to_dict(),
      "tokenizer_file": checkpoint.TOKENIZER_FILE})
  loaded = pair.load_dir(tmp_path, max_depth=8)
  assert loaded.target.config == config and loaded.draft.max_depth == 8
  assert loaded.tokenizer.vocab == tok.vocab


def test_shipped_stdlib_pair():
  """The trained checkpoint: sizes, the 8x cost gap, its record."""
  directory = pair.CHECKPOINT_DIR / "stdlib"
  total = sum(f.stat().st_size for f in directory.iterdir())
  assert total <= 16_000_000, f"checkpoint is {total} bytes"
  loaded = pair.load_pair("stdlib")
  meta = loaded.meta
  target_n = tf.param_count(loaded.target.params)
  draft_n = tf.param_count(loaded.draft.params)
  assert meta["params"] == {"target": target_n, "draft": draft_n}
  assert target_n >= 8 * draft_n
  timing = meta["decode_ms_per_token"]
  assert timing["target"]["in_jit"] >= 8 * timing["draft"]["in_jit"]
  assert len(meta["corpus"]["fingerprint"]) == 64
  assert meta["command"].startswith("python -m experiments.train_pair")
  assert loaded.tokenizer.vocab == loaded.target.vocab == loaded.draft.vocab
  for role in ("target", "draft"):
    assert 0 < meta["held_out"][role]["loss"] < np.log(loaded.target.vocab)
  assert meta["held_out"]["target"]["loss"] < meta["held_out"]["draft"]["loss"]
  text = "def greet(name):\n    return f'Hello, {name}!'  # ✓\n"
  assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text
  ids = loaded.tokenizer.encode("import os\n\n\ndef main():\n    ")
  rows, _ = loaded.target.logits(None, ids, ids[:2])
  assert rows.shape == (3, loaded.target.vocab)
  assert np.all(np.isfinite(np.asarray(rows)))
