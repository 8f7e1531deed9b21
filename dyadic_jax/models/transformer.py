"""A reference decoder-only transformer with a rollback-free KV cache.

Plain JAX pytrees; every array is float32 (or int32 for tokens) by explicit
dtype, so the same code traces identically inside `jax.enable_x64(True)`.

Architecture: token embedding (tied with the output projection), then
`n_layers` pre-RMSNorm blocks (causal self-attention with rotary position
embeddings, then an MLP), a final RMSNorm and the logits. Two families
share the code, chosen by `Config`: the project's own pair (multi-head
attention, a GELU MLP, RoPE base 1e4, norm eps 1e-6) and the Llama family
(grouped-query attention with `n_kv_heads` key/value heads, a SwiGLU MLP,
the RoPE base and norm eps of the model; `gguf_model` loads one).

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
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

_F32 = jnp.float32
_I32 = jnp.int32
MLPS = ("gelu", "swiglu")


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
    n_kv_heads: key/value heads (grouped-query attention: each serves
      n_heads / n_kv_heads query heads); 0 means n_heads.
    mlp: "gelu" (one input projection) or "swiglu" (gate and up, fused).
    rope_base: the rotary embeddings' base.
    norm_eps: the RMSNorms' epsilon.
  """
  vocab: int
  d_model: int
  n_layers: int
  n_heads: int
  d_ff: int
  max_len: int
  n_kv_heads: int = 0
  mlp: str = "gelu"
  rope_base: float = 10000.0
  norm_eps: float = 1e-6

  def __post_init__(self):
    for name in ("vocab", "d_model", "n_layers", "n_heads", "d_ff",
                 "max_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Config: {name} must be an int >= 1, got {value!r}")
    kv = self.n_kv_heads
    if not isinstance(kv, int) or isinstance(kv, bool) or kv < 0 or (
        kv and self.n_heads % kv):
      raise ValueError(f"Config: n_kv_heads must be 0 or an int dividing "
                       f"n_heads {self.n_heads}, got {kv!r}")
    if self.mlp not in MLPS:
      raise ValueError(f"Config: mlp must be one of {MLPS}, got {self.mlp!r}")
    for name in ("rope_base", "norm_eps"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or \
          not 0 < value < math.inf:
        raise ValueError(f"Config: {name} must be a finite number > 0, got "
                         f"{value!r}")
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

  @property
  def kv_heads(self) -> int:
    """Key/value heads (n_kv_heads, or n_heads where it is 0)."""
    return self.n_kv_heads or self.n_heads

  @property
  def mlp_width(self) -> int:
    """Columns of `Params.w_in`: d_ff, or 2 d_ff (gate | up) for SwiGLU."""
    return 2 * self.d_ff if self.mlp == "swiglu" else self.d_ff

  def to_dict(self) -> dict[str, typing.Any]:
    """The fields; the defaulted ones only where they differ (a
    checkpoint of the project's own family keeps its six fields)."""
    full = dataclasses.asdict(self)
    defaults = {f.name: f.default for f in dataclasses.fields(self)
                if f.default is not dataclasses.MISSING}
    return {k: v for k, v in full.items()
            if k not in defaults or v != defaults[k]}


class Params(typing.NamedTuple):
  """Weights; per-layer arrays are stacked on a leading axis of size L."""
  embed: jax.Array       # f32[V, d]     tokens in, and (tied) logits out
  attn_norm: jax.Array   # f32[L, d]
  wqkv: jax.Array        # f32[L, d, H + 2 Hkv, dh] query heads, then key
                         # heads, then value heads: one fused projection
  wo: jax.Array          # f32[L, H, dh, d]
  mlp_norm: jax.Array    # f32[L, d]
  w_in: jax.Array        # f32[L, d, f] (GELU) or f32[L, d, 2f] (SwiGLU:
                         # gate, then up, fused)
  w_out: jax.Array       # f32[L, f, d]
  final_norm: jax.Array  # f32[d]


class Cache(typing.NamedTuple):
  """Keys and values of every position; fixed shape, no length inside.

  Which prefix is valid is the caller's bookkeeping (the `start` it passes
  to `extend`), so a rollback changes no array.
  """
  k: jax.Array  # f32[L, max_len, Hkv, dh]
  v: jax.Array  # f32[L, max_len, Hkv, dh]


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
  heads = h + 2 * config.kv_heads
  k_emb, k_qkv, k_o, k_in, k_out = jax.random.split(key, 5)
  std = 0.02
  res_std = std / math.sqrt(2 * n)
  normal = lambda k, shape, s: s * jax.random.normal(k, shape, _F32)
  return Params(
      embed=normal(k_emb, (config.vocab, d), std),
      attn_norm=jnp.ones((n, d), _F32),
      wqkv=normal(k_qkv, (n, d, heads, dh), std),
      wo=normal(k_o, (n, h, dh, d), res_std),
      mlp_norm=jnp.ones((n, d), _F32),
      w_in=normal(k_in, (n, d, config.mlp_width), std),
      w_out=normal(k_out, (n, f, d), res_std),
      final_norm=jnp.ones((d,), _F32))


def empty_cache(config: Config) -> Cache:
  """A zero cache (nothing valid)."""
  shape = (config.n_layers, config.max_len, config.kv_heads, config.head_dim)
  return Cache(k=jnp.zeros(shape, _F32), v=jnp.zeros(shape, _F32))


class Arch(typing.NamedTuple):
  """What a traced forward needs beyond the weights' shapes (static,
  hashable). Heads, key/value heads and the MLP's kind are read off the
  shapes (`wo`, `wqkv`, `w_in` against `w_out`)."""
  rope_base: float = 10000.0
  norm_eps: float = 1e-6


def arch_of(config: Config) -> Arch:
  """config's `Arch`."""
  return Arch(float(config.rope_base), float(config.norm_eps))


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(ms + _F32(eps)) * scale


def _rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotates x[..., T, H, dh] by its positions int32[..., T] (half-split
  pairs; positions [T] or with x's leading batch axes)."""
  half = x.shape[-1] // 2
  freqs = _F32(base) ** (-jnp.arange(half, dtype=_F32) / _F32(half))
  angles = positions.astype(_F32)[..., None] * freqs  # [..., T, half]
  cos = jnp.cos(angles)[..., None, :]                 # [..., T, 1, half]
  sin = jnp.sin(angles)[..., None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
  """q[..., T, H, dh] as [..., T, Hkv, G, dh]: query head j reads key/value
  head j // G (G = H / Hkv consecutive query heads share one)."""
  *lead, t, h, dh = q.shape
  return q.reshape(*lead, t, kv_heads, h // kv_heads, dh)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array,
            mask: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(dh)) v; q[..., T, H, dh], k/v[..., S, Hkv, dh],
  mask bool[T, S] or [..., 1, T, S] (True: may attend)."""
  scale = _F32(1.0 / math.sqrt(q.shape[-1]))
  if k.shape[-2] == q.shape[-2]:
    scores = jnp.einsum("...thd,...shd->...hts", q, k) * scale
    scores = jnp.where(mask, scores, _F32(-1e30))
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("...hts,...shd->...thd", weights, v)
  g = _grouped(q, k.shape[-2])
  scores = jnp.einsum("...tkgd,...skd->...kgts", g, k) * scale
  scores = jnp.where(mask[..., None, :, :], scores, _F32(-1e30))
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("...kgts,...skd->...tkgd", weights, v)
  return out.reshape(q.shape)


class Layer(typing.NamedTuple):
  """One block's weights (a `Params` field's slice at one layer)."""
  attn_norm: jax.Array   # f32[d]
  wqkv: jax.Array        # f32[d, H + 2 Hkv, dh]
  wo: jax.Array          # f32[H, dh, d]
  mlp_norm: jax.Array    # f32[d]
  w_in: jax.Array        # f32[d, f] or f32[d, 2f]
  w_out: jax.Array       # f32[f, d]


class Unstacked(typing.NamedTuple):
  """`Params` with the layers as separate arrays (`unstack`)."""
  embed: jax.Array
  layers: tuple[Layer, ...]
  final_norm: jax.Array


def layer_of(params: Params, i: int) -> Layer:
  """Block i's weights. Inside a jit each slice of a stacked array is a
  copy that XLA CPU does not fuse into the matmuls reading it."""
  return Layer(params.attn_norm[i], params.wqkv[i], params.wo[i],
               params.mlp_norm[i], params.w_in[i], params.w_out[i])


def unstack(params: Params) -> Unstacked:
  """The per-layer arrays, sliced once (for decoding: a one-token step
  at batch 1 is several times faster than slicing `Params` per call)."""
  return Unstacked(params.embed,
                   tuple(layer_of(params, i)
                         for i in range(params.wqkv.shape[0])),
                   params.final_norm)


def _layers(params: "Params | Unstacked") -> typing.Sequence[Layer]:
  """Each block's weights: the unstacked ones as they are (no copy), a
  stacked `Params`'s sliced (a copy per call inside a jit)."""
  if isinstance(params, Unstacked):
    return params.layers
  return [layer_of(params, i) for i in range(params.wqkv.shape[0])]


def _mlp(layer: Layer, x: jax.Array, arch: Arch) -> jax.Array:
  h = _rms_norm(x, layer.mlp_norm, arch.norm_eps)
  f = layer.w_out.shape[0]
  a = h @ layer.w_in
  if a.shape[-1] == f:
    return jax.nn.gelu(a) @ layer.w_out
  return (jax.nn.silu(a[..., :f]) * a[..., f:]) @ layer.w_out


def _qkv(layer: Layer, x: jax.Array, positions: jax.Array, arch: Arch
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Rotated queries f32[..., T, H, dh] and keys, and values, each
  f32[..., T, Hkv, dh]."""
  h = _rms_norm(x, layer.attn_norm, arch.norm_eps)
  d, heads, dh = layer.wqkv.shape
  n_q = layer.wo.shape[0]
  n_kv = (heads - n_q) // 2
  if n_kv == n_q:
    # The (q, k, v) axis after T: XLA CPU computes this layout without a
    # transpose of the product.
    qkv = jnp.einsum("...td,dchk->...tchk", h,
                     layer.wqkv.reshape(d, 3, n_q, dh))
    q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
  else:
    qkv = jnp.einsum("...td,dnk->...tnk", h, layer.wqkv)
    q, k, v = (qkv[..., :n_q, :], qkv[..., n_q:n_q + n_kv, :],
               qkv[..., n_q + n_kv:, :])
  return (_rope(q, positions, arch.rope_base),
          _rope(k, positions, arch.rope_base), v)


def _attn_out(layer: Layer, att: jax.Array) -> jax.Array:
  return jnp.einsum("...thk,hkd->...td", att, layer.wo)


def _block(layer: Layer, x: jax.Array, positions: jax.Array,
           attend: typing.Callable[[jax.Array, jax.Array, jax.Array],
                                   jax.Array], arch: Arch) -> jax.Array:
  """One pre-norm block; attend(q, k, v) does the attention (and any
  cache write) for this layer."""
  q, k, v = _qkv(layer, x, positions, arch)
  x = x + _attn_out(layer, attend(q, k, v))
  return x + _mlp(layer, x, arch)


def _logits(params: Params | Unstacked, x: jax.Array,
            arch: Arch) -> jax.Array:
  return _rms_norm(x, params.final_norm, arch.norm_eps) @ params.embed.T


@functools.partial(jax.jit, static_argnames="arch")
def _forward(params: Params, tokens: jax.Array, arch: Arch) -> jax.Array:
  t = tokens.shape[-1]
  positions = jnp.arange(t, dtype=_I32)
  mask = positions[:, None] >= positions[None, :]
  x = params.embed[tokens]
  for layer in _layers(params):
    x = _block(layer, x, positions,
               lambda q, k, v: _attend(q, k, v, mask), arch)
  return _logits(params, x, arch)


def forward(params: Params, tokens: ArrayLike, arch: Arch = Arch()
            ) -> jax.Array:
  """Causal logits f32[B, T, V] of tokens int32[B, T] (training form).

  T must not exceed the config's max_len (the positions trained on).
  arch: the config's `arch_of` (the default is the project's own family).
  """
  return _forward(params, jnp.asarray(tokens, _I32), arch)


@functools.partial(jax.jit, static_argnames="arch")
def _extend(params: "Params | Unstacked", cache: Cache, tokens: jax.Array, start: jax.Array,
            arch: Arch) -> tuple[jax.Array, Cache]:
  c = tokens.shape[0]
  max_len = cache.k.shape[1]
  positions = start + jnp.arange(c, dtype=_I32)
  # Token i sees every cached position up to its own; later ones (stale
  # entries of a rolled-back tail, or this chunk's later tokens) are masked.
  mask = jnp.arange(max_len, dtype=_I32)[None, :] <= positions[:, None]
  x = params.embed[tokens]
  new_k, new_v = [], []

  def attend(i, q, k, v):
    k_all = jax.lax.dynamic_update_slice_in_dim(cache.k[i], k, start, 0)
    v_all = jax.lax.dynamic_update_slice_in_dim(cache.v[i], v, start, 0)
    new_k.append(k_all)
    new_v.append(v_all)
    return _attend(q, k_all, v_all, mask)

  for i, layer in enumerate(_layers(params)):
    x = _block(layer, x, positions, functools.partial(attend, i), arch)
  return _logits(params, x, arch), Cache(k=jnp.stack(new_k),
                                         v=jnp.stack(new_v))


def extend_traced(params: "Params | Unstacked", cache: Cache, tokens: ArrayLike,
                  start: ArrayLike, arch: Arch = Arch()
                  ) -> tuple[jax.Array, Cache]:
  """`extend` without its host-side bound check (for use under a trace).

  start + C must be <= max_len; past it, `dynamic_update_slice` clamps the
  write and the rows are garbage (never an error inside JAX).
  """
  return _extend(params, cache, jnp.asarray(tokens, _I32),
                 jnp.asarray(start, _I32), arch)


def extend(params: "Params | Unstacked", cache: Cache, tokens: ArrayLike, start: int,
           arch: Arch = Arch()) -> tuple[jax.Array, Cache]:
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
  return extend_traced(params, cache, tokens, start, arch)


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


def feed(params: "Params | Unstacked", cache: Cache, tokens: typing.Any,
         start: int, arch: Arch = Arch()) -> tuple[jax.Array, Cache]:
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
    logits, cache = extend_traced(params, cache, chunk, start + offset,
                                  arch)
    rows.append(logits[:real])
    offset += real
  return (rows[0] if len(rows) == 1 else jnp.concatenate(rows)), cache


# The batched decoding form: many requests' caches in one `Slab`, each
# request at its own length, one call for all of them.


class Slab(typing.NamedTuple):
  """The caches of N requests, one slot each; fixed shape.

  One array per layer (XLA CPU then updates each in place and reads its
  span without copying the rest), heads before positions (attention
  reads each (slot, head)'s keys as one contiguous block). As with
  `Cache`, which prefix of a slot is valid is the caller's bookkeeping
  (the starts it passes to `extend_slots`).
  """
  k: tuple[jax.Array, ...]  # L x f32[N, Hkv, max_len, dh]
  v: tuple[jax.Array, ...]  # L x f32[N, Hkv, max_len, dh]


def empty_slab(config: Config, slots: int) -> Slab:
  """A zero slab of `slots` caches (nothing valid)."""
  shape = (slots, config.kv_heads, config.max_len, config.head_dim)
  return Slab(k=tuple(jnp.zeros(shape, _F32)
                      for _ in range(config.n_layers)),
              v=tuple(jnp.zeros(shape, _F32)
                      for _ in range(config.n_layers)))


def span_bucket(end: int, max_len: int, smallest: int = 64) -> int:
  """The attention span for rows whose last position is end - 1: the
  smallest power of two >= end (at least `smallest`), capped at max_len.
  Few distinct spans keep the compiles few (log2(max_len / smallest) + 1)."""
  span = max(smallest, 1 << max(0, end - 1).bit_length())
  return min(span, max_len)


def extend_slots_traced(weights: Unstacked, slab: Slab, tokens: ArrayLike,
                        starts: ArrayLike, span: int, arch: Arch = Arch()
                        ) -> tuple[jax.Array, Slab]:
  """`extend` of slots 0..B-1 at once, each at its own start (traceable).

  Args:
    weights: the weights, `unstack`ed.
    slab: the caches; slot b holds row b's prefix.
    tokens: int32[B, C], B <= N: row b's tokens at positions starts[b] +
      0..C-1.
    starts: int32[B]; a start >= max_len makes row b idle (its writes are
      dropped, its logits garbage): a slot that holds a request this call
      does not serve keeps its entries.
    span: static; every active row's positions are < span <= max_len, and
      attention reads cache positions [0, span) only (`span_bucket`).
    arch: static, the config's `arch_of`.

  Returns:
    (f32[B, C, V] logits, the slab with those positions written). Row b
    equals `extend(params, slot b's cache, tokens[b], starts[b])` up to
    float32 rounding.
  """
  tokens, starts = jnp.asarray(tokens, _I32), jnp.asarray(starts, _I32)
  b, c = tokens.shape
  positions = starts[:, None] + jnp.arange(c, dtype=_I32)[None, :]  # [B, C]
  mask = (jnp.arange(span, dtype=_I32)[None, None, :]
          <= positions[:, :, None])[:, None]                    # [B, 1, C, S]
  x = weights.embed[tokens]                                     # [B, C, d]
  k_slab, v_slab = list(slab.k), list(slab.v)
  rows = jnp.arange(b, dtype=_I32)[:, None, None]
  heads = jnp.arange(k_slab[0].shape[1], dtype=_I32)[None, None, :]
  where = (rows, heads, positions[:, :, None])                   # [B, C, H]

  def attend(i, q, k, v):
    # Scatter only the C new entries per row and read only the span: with
    # the slab donated the update is in place.
    k_slab[i] = k_slab[i].at[where].set(k, mode="drop")
    v_slab[i] = v_slab[i].at[where].set(v, mode="drop")
    k_ctx, v_ctx = k_slab[i][:b, :, :span], v_slab[i][:b, :, :span]
    scale = _F32(1.0 / math.sqrt(q.shape[-1]))
    if k.shape[-2] == q.shape[-2]:
      scores = jnp.einsum("bthd,bhsd->bhts", q, k_ctx) * scale
      weights_ = jax.nn.softmax(jnp.where(mask, scores, _F32(-1e30)),
                                axis=-1)
      return jnp.einsum("bhts,bhsd->bthd", weights_, v_ctx)
    g = _grouped(q, k.shape[-2])                             # [B, C, K, G, dh]
    scores = jnp.einsum("btkgd,bksd->bkgts", g, k_ctx) * scale
    weights_ = jax.nn.softmax(
        jnp.where(mask[:, :, None], scores, _F32(-1e30)), axis=-1)
    return jnp.einsum("bkgts,bksd->btkgd", weights_, v_ctx).reshape(q.shape)

  for i, layer in enumerate(weights.layers):
    x = _block(layer, x, positions, functools.partial(attend, i), arch)
  return _logits(weights, x, arch), Slab(k=tuple(k_slab), v=tuple(v_slab))


_extend_slots = jax.jit(extend_slots_traced, static_argnames=("span", "arch"),
                        donate_argnames="slab")


def extend_slots(weights: Unstacked, slab: Slab, tokens: typing.Any,
                 starts: typing.Any, counts: typing.Any = None,
                 arch: Arch = Arch()) -> tuple[jax.Array, Slab]:
  """`extend_slots_traced` jitted, its span bucketed from the active rows'
  ends.

  counts: int32[B], the real tokens of each row (default: all C); the
    rest of a row is padding, whose writes land past the row's real
    positions (entries no row reads before they are written again, as a
    rolled-back tail's) or are dropped past max_len, and whose logits are
    garbage. Rows of different lengths share one call this way.

  The slab passed in is donated (invalid after the call): use the one
  returned. One compile per (B, C, span).

  Raises:
    ValueError: shapes that disagree, more rows than slots, or an active
      row (start < max_len) with start < 0 or start + count > max_len.
  """
  tokens = np.asarray(tokens, np.int32)
  starts = np.asarray(starts, np.int32)
  n, max_len = int(slab.k[0].shape[0]), int(slab.k[0].shape[2])
  if tokens.ndim != 2 or starts.shape != (tokens.shape[0],) or \
      tokens.shape[0] > n:
    raise ValueError(f"extend_slots: tokens {tokens.shape} and starts "
                     f"{starts.shape} disagree or exceed {n} slots")
  counts = np.full(starts.shape, tokens.shape[1], np.int32) if counts is \
      None else np.asarray(counts, np.int32)
  active = starts < max_len
  ends = starts[active] + counts[active]
  end = int(ends.max()) if ends.size else 1
  if ends.size and (starts[active].min() < 0 or end > max_len):
    raise ValueError(f"extend_slots: positions up to {end - 1} do not fit "
                     f"the cache of max_len {max_len}")
  return _extend_slots(weights, slab, tokens, starts,
                       span=span_bucket(end, max_len), arch=arch)
