"""A draft over a restricted output vocabulary (`vocab_map`): its rows are
the small model's rows at the kept ids and -inf elsewhere, through the
per-request draft and the batched slab alike (a grouped-query, SwiGLU
config: the Llama family's slab paths too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dyadic_jax.models import pair, vocab_map
from dyadic_jax.models import transformer as tf
from tests.models.test_batched import greedy_chain

V, K, D = 97, 23, 4
CONFIG = tf.Config(vocab=K + 1, d_model=32, n_layers=2, n_heads=4,
                   n_kv_heads=2, d_ff=48, max_len=128, mlp="swiglu",
                   rope_base=5e4, norm_eps=1e-5)
KEPT = np.sort(np.random.default_rng(0).choice(V, K, replace=False)).astype(
    np.int32)


@pytest.fixture(scope="module")
def draft():
  params = tf.init(CONFIG, jax.random.key(1))
  return pair.TransformerDraft(params, CONFIG, max_depth=8,
                               vocab_map=vocab_map.make(KEPT, V), vocab=V)


def _reference(draft, tokens):
  """Full-vocabulary rows of one uncached forward over full ids."""
  small = vocab_map.host_small(draft.vocab_map, tokens)
  rows = np.asarray(tf.forward(draft.params, small[None],
                               tf.arch_of(CONFIG))[0])
  out = np.full((len(tokens), V), -np.inf, np.float32)
  out[:, KEPT] = rows[:, :K]
  return out


def test_make_and_refusals():
  vmap = vocab_map.make(KEPT, V)
  small = vocab_map.host_small(vmap, np.arange(V))
  assert (small[KEPT] == np.arange(K)).all()
  assert (np.delete(small, KEPT) == K).all()
  rows = np.asarray(vocab_map.expand(vmap, jnp.arange(K + 1, dtype=jnp.float32)))
  assert (rows[KEPT] == np.arange(K)).all()
  assert np.isneginf(np.delete(rows, KEPT)).all()     # "other" reaches none
  for bad in ([], [1, 1], [V], [-1], [[1, 2]], [0.5]):
    with pytest.raises(ValueError, match="kept"):
      vocab_map.make(np.asarray(bad), V)
  with pytest.raises(ValueError, match="go together"):
    pair.TransformerDraft(tf.init(CONFIG, jax.random.key(0)), CONFIG,
                          max_depth=8, vocab_map=vmap)


def test_draft_rows_are_the_small_models_at_the_kept_ids(draft):
  rng = np.random.default_rng(3)
  context = rng.integers(0, V, 30).astype(np.int32)   # many ids not kept
  state = draft.catch_up(None, context, int(context[-1]), context.size)
  tokens = list(context)
  step = jax.jit(draft.step)
  for _ in range(D):
    row, state = step(state, jnp.int32(tokens[-1]))
    want = _reference(draft, np.asarray(tokens, np.int32))[-1]
    row = np.asarray(row)
    assert row.shape == (V,)
    assert np.array_equal(np.isneginf(row), np.isneginf(want))
    kept = ~np.isneginf(want)
    assert np.abs(row[kept] - want[kept]).max() < 1e-4
    tokens.append(int(KEPT[np.argmax(row[KEPT])]))


def test_slab_chain_equals_recompute(draft):
  """The batched chain (full ids in, rows over V out) against an uncached
  forward per request, contexts holding ids outside the set."""
  slab = draft.batch(2)
  chain = greedy_chain(slab, D)

  rng = np.random.default_rng(4)
  contexts = {0: rng.integers(0, V, 9).astype(np.int32),
              1: rng.integers(0, V, 40).astype(np.int32)}
  worst = 0.0
  for _ in range(3):
    feed, span, slots = slab.prepare([0, 1], [contexts[0], contexts[1]], D)
    rows, tokens, slab.slab = chain(slab.weights, slab.slab, feed, span=span)
    rows, tokens = np.asarray(rows), np.asarray(tokens)
    slab.finish(slots, tokens[slots])
    for rid, slot in zip((0, 1), slots):
      assert np.isin(tokens[slot], KEPT).all()
      full = np.concatenate([contexts[rid], tokens[slot]])
      want = _reference(draft, full)[contexts[rid].size - 1:][:D]
      assert np.array_equal(np.isneginf(rows[slot]), np.isneginf(want))
      kept = ~np.isneginf(want)
      worst = max(worst, np.abs(rows[slot][kept] - want[kept]).max())
      contexts[rid] = np.append(full[:contexts[rid].size + 2],
                                rng.integers(0, V))
  assert worst < 1e-4


def _llama_forward(t: dict, config: dict, tokens) -> np.ndarray:
  """LlamaForCausalLM's logits [T, V] from its state dict, in numpy
  float64 (x W^T per Linear, rotate_half RoPE, key/value heads repeated,
  SwiGLU, the untied lm_head)."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
  dh, eps, n = config["head_dim"], config["rms_norm_eps"], len(tokens)
  norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w
  half = lambda x: np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
  inv = 1.0 / config["rope_theta"] ** (np.arange(0, dh, 2) / dh)
  ang = np.arange(n)[:, None] * inv[None]
  cos = np.cos(np.concatenate([ang, ang], -1))[:, None]
  sin = np.sin(np.concatenate([ang, ang], -1))[:, None]
  x = t["model.embed_tokens.weight"][tokens]
  causal = np.tril(np.ones((n, n), bool))
  for i in range(config["num_hidden_layers"]):
    pre = f"model.layers.{i}."
    h = norm(x, t[pre + "input_layernorm.weight"])
    q = (h @ t[pre + "self_attn.q_proj.weight"].T).reshape(n, heads, dh)
    k = (h @ t[pre + "self_attn.k_proj.weight"].T).reshape(n, kv, dh)
    v = (h @ t[pre + "self_attn.v_proj.weight"].T).reshape(n, kv, dh)
    q, k = (y * cos + half(y) * sin for y in (q, k))
    k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    s = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(dh),
                 -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    x = x + np.einsum("hts,shd->thd", w, v).reshape(n, -1) @ t[
        pre + "self_attn.o_proj.weight"].T
    h = norm(x, t[pre + "post_attention_layernorm.weight"])
    g = h @ t[pre + "mlp.gate_proj.weight"].T
    x = x + (g / (1 + np.exp(-g)) * (h @ t[pre + "mlp.up_proj.weight"].T)
             ) @ t[pre + "mlp.down_proj.weight"].T
  return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def test_full_vocabulary_export_is_llamas_forward(draft, tmp_path):
  """`hf_layout.save_full_vocab`: the restricted draft as a
  LlamaForCausalLM over all V ids gives our logits at the kept ids and 0
  elsewhere (numpy transcription of transformers' forward; no torch)."""
  import json  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import hf_layout  # pylint: disable=import-outside-toplevel
  safetensors_numpy = pytest.importorskip("safetensors.numpy")
  folder = hf_layout.save_full_vocab(tmp_path / "draft", draft.params, CONFIG,
                                     KEPT, V)
  config = json.loads((folder / "config.json").read_text())
  assert config["architectures"] == ["LlamaForCausalLM"]
  assert (config["vocab_size"], config["num_key_value_heads"]) == (V, 2)
  tensors = safetensors_numpy.load_file(str(folder / hf_layout.MODEL_FILE))
  tokens = np.random.default_rng(5).integers(0, V, 12)
  theirs = _llama_forward(tensors, config, tokens)
  ours = _reference(draft, tokens.astype(np.int32))
  assert np.abs(theirs[:, KEPT] - ours[:, KEPT]).max() < 1e-4
  assert (np.delete(theirs, KEPT, axis=1) == 0).all()
