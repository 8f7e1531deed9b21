"""The reference transformer: config checks, and the cache equals recompute."""

import jax
import numpy as np
import pytest

from dyadic_jax.models import transformer as tf

# float32 rounding of a different summation order; the logits are O(1).
TOL = 1e-4

CONFIG = tf.Config(vocab=61, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                   max_len=160)


@pytest.fixture(scope="module")
def params():
  return tf.init(CONFIG, jax.random.key(0))


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab": 1}, "vocab must be >= 2"),
    ({"d_model": 15}, "not a multiple"),
    ({"d_model": 6, "n_heads": 2}, "must be even"),
    ({"max_len": 0}, "max_len must be an int >= 1"),
    ({"n_layers": 1.5}, "n_layers must be an int"),
])
def test_config_is_validated(kwargs, message):
  base = dict(vocab=8, d_model=8, n_layers=1, n_heads=2, d_ff=8, max_len=8)
  with pytest.raises(ValueError, match=message):
    tf.Config(**{**base, **kwargs})


def test_params_are_float32_under_x64(params):
  with jax.enable_x64(True):
    p64 = tf.init(CONFIG, jax.random.key(0))
    logits = tf.forward(p64, np.zeros((1, 3), np.int32))
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(p64))
  assert logits.dtype == np.float32
  assert tf.init_shapes(CONFIG)["wqkv"] == (2, 16, 6, 8)
  assert tf.param_count(params) == sum(
      int(np.prod(s)) for s in tf.init_shapes(CONFIG).values())


@pytest.mark.parametrize("splits", [[150], [1, 2, 3, 144], [100, 50],
                                    [7, 0, 129, 14]])
def test_any_chunking_equals_forward(params, splits):
  tokens = np.random.default_rng(1).integers(0, 61, 150).astype(np.int32)
  full = np.asarray(tf.forward(params, tokens[None])[0])
  cache = tf.empty_cache(CONFIG)
  rows, start = [], 0
  for n in splits:
    if n:
      out, cache = tf.feed(params, cache, tokens[start:start + n], start)
      rows.append(np.asarray(out))
    start += n
  diff = np.abs(np.concatenate(rows) - full).max()
  assert diff < TOL, f"cached vs recomputed max abs diff {diff:.3g}"


def test_feed_pads_within_the_cache(params):
  # 3 tokens ending at max_len: the pow2 bucket (4) would not fit, the
  # chunking falls back to exact sizes.
  tokens = np.random.default_rng(2).integers(0, 61, 160).astype(np.int32)
  full = np.asarray(tf.forward(params, tokens[None])[0])
  _, cache = tf.feed(params, tf.empty_cache(CONFIG), tokens[:157], 0)
  out, _ = tf.feed(params, cache, tokens[157:], 157)
  assert np.abs(np.asarray(out) - full[157:]).max() < TOL
  assert tf._chunk_sizes(3, 157, 160) == [(2, 2), (1, 1)]
  assert tf._chunk_sizes(5, 0, 160) == [(5, 8)]
  assert tf._chunk_sizes(300, 0, 400) == [(128, 128), (128, 128), (44, 64)]


def test_rollback_overwrites_stale_entries(params):
  rng = np.random.default_rng(3)
  a = rng.integers(0, 61, 40).astype(np.int32)
  b = rng.integers(0, 61, 10).astype(np.int32)
  _, cache = tf.feed(params, tf.empty_cache(CONFIG), a, 0)
  # Roll back to 25 tokens and continue differently: entries 25..39 of `a`
  # are stale and must not leak into the rows.
  out, _ = tf.feed(params, cache, b, 25)
  full = np.asarray(tf.forward(params, np.concatenate([a[:25], b])[None])[0])
  assert np.abs(np.asarray(out) - full[25:]).max() < TOL


def test_extend_refuses_out_of_range(params):
  cache = tf.empty_cache(CONFIG)
  with pytest.raises(ValueError, match="max_len 160"):
    tf.extend(params, cache, np.zeros(4, np.int32), 158)
  with pytest.raises(ValueError, match="do not fit"):
    tf.feed(params, cache, np.zeros(0, np.int32), 0)
