"""A reference decoder-only transformer with a rollback-free KV cache.

Plain JAX pytrees; every array is float32 (or int32 for tokens) by explicit
dtype, so the same code traces identically inside `jax.enable_x64(True)`.

Architecture: token embedding (tied with the output projection), then
`n_layers` pre-RMSNorm blocks (causal multi-head self-attention with rotary
position embeddings, then a GELU MLP), a final RMSNorm and the logits.

Two entry points compute the same function:

  * `forward(params, tokens[B, T])`: the training form, causal over T.
  * `extend(params, cache, tokens[C], start)`: the decoding form. It writes
    the keys and values of the C tokens at positions start..start+C-1 of a
    fixed-size `Cache` and lets token i attend to every position <=
    start + i. Cache entries at positions >= start + C are never read for
    these rows, so rolling back to a shorter prefix is just passing a
    smaller `start` next time: stale entries are masked until overwritten.

Contract: for any tokens t[0..n) and any split of [0, n) into consecutive
chunks fed by `extend` in order, the rows equal `forward(params, t[None])[0]`
up to float32 rounding (the tests bound the difference by 1e-4).
"""

import dataclasses
import math
import typing

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

_F32 = jnp.float32
_I32 = jnp.int32
_ROPE_BASE = 10000.0
_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Shape of a transformer.

  Attributes:
    vocab: V, the number of tokens.
    d_model: the residual width; a multiple of n_heads.
    n_layers: number of blocks.
    n_heads: attention heads; d_model / n_heads must be even (rotary pairs).
    d_ff: hidden width of the MLP.
    max_len: the longest sequence (positions 0..max_len-1); the cache size.
  """
  vocab: int
  d_model: int
  n_layers: int
  n_heads: int
  d_ff: int
  max_len: int

  def __post_init__(self):
    for name in ("vocab", "d_model", "n_layers", "n_heads", "d_ff",
                 "max_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Config: {name} must be an int >= 1, got {value!r}")
    if self.vocab < 2:
      raise ValueError(f"Config: vocab must be >= 2, got {self.vocab}")
    if self.d_model % self.n_heads:
      raise ValueError(f"Config: d_model {self.d_model} is not a multiple of "
                       f"n_heads {self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"Config: head dim {self.head_dim} must be even "
                       "(rotary embeddings rotate pairs)")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def to_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


class Params(typing.NamedTuple):
  """Weights; per-layer arrays are stacked on a leading axis of size L."""
  embed: jax.Array       # f32[V, d]     tokens in, and (tied) logits out
  attn_norm: jax.Array   # f32[L, d]
  wqkv: jax.Array        # f32[L, d, 3, H, dh] query, key, value projections
  wo: jax.Array          # f32[L, H, dh, d]
  mlp_norm: jax.Array    # f32[L, d]
  w_in: jax.Array        # f32[L, d, f]
  w_out: jax.Array       # f32[L, f, d]
  final_norm: jax.Array  # f32[d]


class Cache(typing.NamedTuple):
  """Keys and values of every position; fixed shape, no length inside.

  Which prefix is valid is the caller's bookkeeping (the `start` it passes
  to `extend`), so a rollback changes no array.
  """
  k: jax.Array  # f32[L, max_len, H, dh]
  v: jax.Array  # f32[L, max_len, H, dh]


def param_count(params: Params) -> int:
  """Number of scalars in params."""
  return sum(int(x.size) for x in jax.tree.leaves(params))


def init_shapes(config: Config) -> dict[str, tuple[int, ...]]:
  """The shape of each `Params` field for config (no arrays made)."""
  shapes = jax.eval_shape(lambda: init(config, jax.random.key(0)))
  return {name: tuple(s.shape) for name, s in shapes._asdict().items()}


def init(config: Config, key: jax.Array) -> Params:
  """Random parameters: N(0, 0.02) weights, residual outputs scaled by
  1/sqrt(2L) so the residual stream's variance does not grow with depth."""
  d, f, n = config.d_model, config.d_ff, config.n_layers
  h, dh = config.n_heads, config.head_dim
  k_emb, k_qkv, k_o, k_in, k_out = jax.random.split(key, 5)
  std = 0.02
  res_std = std / math.sqrt(2 * n)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, _F32)
  return Params(
      embed=normal(k_emb, (config.vocab, d), std),
      attn_norm=jnp.ones((n, d), _F32),
      wqkv=normal(k_qkv, (n, d, 3, h, dh), std),
      wo=normal(k_o, (n, h, dh, d), res_std),
      mlp_norm=jnp.ones((n, d), _F32),
      w_in=normal(k_in, (n, d, f), std),
      w_out=normal(k_out, (n, f, d), res_std),
      final_norm=jnp.ones((d,), _F32))


def empty_cache(config: Config) -> Cache:
  """A zero cache (nothing valid)."""
  shape = (config.n_layers, config.max_len, config.n_heads, config.head_dim)
  return Cache(k=jnp.zeros(shape, _F32), v=jnp.zeros(shape, _F32))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(ms + _F32(_NORM_EPS)) * scale


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotates x[..., T, H, dh] by its positions int32[T] (half-split pairs)."""
  half = x.shape[-1] // 2
  freqs = _F32(_ROPE_BASE) ** (-jnp.arange(half, dtype=_F32) / _F32(half))
  angles = positions.astype(_F32)[:, None] * freqs[None, :]  # [T, half]
  cos = jnp.cos(angles)[:, None, :]                          # [T, 1, half]
  sin = jnp.sin(angles)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array,
            mask: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(dh)) v; q[..., T, H, dh], k/v[..., S, H, dh],
  mask bool[T, S] (True: may attend)."""
  scale = _F32(1.0 / math.sqrt(q.shape[-1]))
  scores = jnp.einsum("...thd,...shd->...hts", q, k) * scale
  scores = jnp.where(mask, scores, _F32(-1e30))
  weights = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("...hts,...shd->...thd", weights, v)


def _mlp(params: Params, layer: int, x: jax.Array) -> jax.Array:
  h = _rms_norm(x, params.mlp_norm[layer])
  return jax.nn.gelu(h @ params.w_in[layer]) @ params.w_out[layer]


def _qkv(params: Params, layer: int, x: jax.Array, positions: jax.Array
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Rotated queries and keys, and values, each f32[..., T, H, dh]."""
  h = _rms_norm(x, params.attn_norm[layer])
  qkv = jnp.einsum("...td,dchk->c...thk", h, params.wqkv[layer])
  return _rope(qkv[0], positions), _rope(qkv[1], positions), qkv[2]


def _attn_out(params: Params, layer: int, att: jax.Array) -> jax.Array:
  return jnp.einsum("...thk,hkd->...td", att, params.wo[layer])


def _logits(params: Params, x: jax.Array) -> jax.Array:
  return _rms_norm(x, params.final_norm) @ params.embed.T


@jax.jit
def _forward(params: Params, tokens: jax.Array) -> jax.Array:
  t = tokens.shape[-1]
  positions = jnp.arange(t, dtype=_I32)
  mask = positions[:, None] >= positions[None, :]
  x = params.embed[tokens]
  for layer in range(params.wqkv.shape[0]):
    q, k, v = _qkv(params, layer, x, positions)
    x = x + _attn_out(params, layer, _attend(q, k, v, mask))
    x = x + _mlp(params, layer, x)
  return _logits(params, x)


def forward(params: Params, tokens: ArrayLike) -> jax.Array:
  """Causal logits f32[B, T, V] of tokens int32[B, T] (training form).

  T must not exceed the config's max_len (the positions trained on).
  """
  return _forward(params, jnp.asarray(tokens, _I32))


@jax.jit
def _extend(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array
            ) -> tuple[jax.Array, Cache]:
  c = tokens.shape[0]
  max_len = cache.k.shape[1]
  positions = start + jnp.arange(c, dtype=_I32)
  # Token i sees every cached position up to its own; later ones (stale
  # entries of a rolled-back tail, or this chunk's later tokens) are masked.
  mask = jnp.arange(max_len, dtype=_I32)[None, :] <= positions[:, None]
  x = params.embed[tokens]
  new_k, new_v = [], []
  for layer in range(params.wqkv.shape[0]):
    q, k, v = _qkv(params, layer, x, positions)
    k_all = jax.lax.dynamic_update_slice_in_dim(cache.k[layer], k, start, 0)
    v_all = jax.lax.dynamic_update_slice_in_dim(cache.v[layer], v, start, 0)
    new_k.append(k_all)
    new_v.append(v_all)
    x = x + _attn_out(params, layer, _attend(q, k_all, v_all, mask))
    x = x + _mlp(params, layer, x)
  return _logits(params, x), Cache(k=jnp.stack(new_k), v=jnp.stack(new_v))


def extend_traced(params: Params, cache: Cache, tokens: ArrayLike,
                  start: ArrayLike) -> tuple[jax.Array, Cache]:
  """`extend` without its host-side bound check (for use under a trace).

  start + C must be <= max_len; past it, `dynamic_update_slice` clamps the
  write and the rows are garbage (never an error inside JAX).
  """
  return _extend(params, cache, jnp.asarray(tokens, _I32),
                 jnp.asarray(start, _I32))


def extend(params: Params, cache: Cache, tokens: ArrayLike, start: int
           ) -> tuple[jax.Array, Cache]:
  """Feeds tokens int32[C] at positions start..start+C-1.

  Returns (f32[C, V] logits, row i scoring the position after token i; the
  cache with those C positions written). Entries at positions < start must
  hold the keys and values of the intended prefix; entries >= start are
  ignored. One compile per C (callers bucket their chunk sizes).

  Raises:
    ValueError: start < 0 or start + C > max_len.
  """
  c = int(jnp.shape(tokens)[0])
  max_len = int(cache.k.shape[1])
  if start < 0 or start + c > max_len:
    raise ValueError(f"extend: positions {start}..{start + c - 1} do not fit "
                     f"the cache of max_len {max_len}")
  return extend_traced(params, cache, tokens, start)


# Chunks fed by `feed` hold at most this many tokens; each is padded up to a
# power of two when that fits below max_len, so a whole decode session
# compiles at most log2(MAX_CHUNK) + 1 shapes of `extend`.
MAX_CHUNK = 128


def _chunk_sizes(n: int, start: int, max_len: int) -> list[tuple[int, int]]:
  """(real, padded) sizes of the chunks that feed n tokens from start."""
  sizes = []
  while n:
    real = min(n, MAX_CHUNK)
    padded = 1 << (real - 1).bit_length()
    if start + padded > max_len:
      # No room for padding at the end of the cache: the largest power of
      # two that fits instead (exact, so a few more calls, no new shapes).
      real = padded = 1 << (real.bit_length() - 1)
    sizes.append((real, padded))
    n -= real
    start += real
  return sizes


def feed(params: Params, cache: Cache, tokens: typing.Any,
         start: int) -> tuple[jax.Array, Cache]:
  """`extend` of any number n >= 1 of tokens, in bucketed chunks.

  Returns (f32[n, V] rows, cache), as one `extend` of all n tokens would.
  Padding tokens (id 0) write entries past start + n only, which no row
  of these tokens reads and which a later feed from start + n overwrites.

  Raises:
    ValueError: n == 0, start < 0 or start + n > max_len.
  """
  tokens = jnp.asarray(tokens, _I32)
  n = int(tokens.shape[0])
  max_len = int(cache.k.shape[1])
  if n == 0 or start < 0 or start + n > max_len:
    raise ValueError(f"feed: {n} tokens from position {start} do not fit the "
                     f"cache of max_len {max_len} (n must be >= 1)")
  rows = []
  offset = 0
  for real, padded in _chunk_sizes(n, start, max_len):
    chunk = tokens[offset:offset + real]
    if padded > real:
      chunk = jnp.concatenate([chunk, jnp.zeros((padded - real,), _I32)])
    logits, cache = extend_traced(params, cache, chunk, start + offset)
    rows.append(logits[:real])
    offset += real
  return (rows[0] if len(rows) == 1 else jnp.concatenate(rows)), cache
