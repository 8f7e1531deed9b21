"""A trained draft/target pair behind the `TargetModel`/`DraftModel` protocols.

Both adapters run a `transformer` with its KV cache; neither applies any
processor (the target's rows are its plain logits, temperature 1).

**Target** (`TransformerTarget`). The per-request handle is a `TargetState`:
the cache and the host-side tokens it covers (positions 0..n-1). The
invariant is "the cache covers everything fed": `logits(state, prefix,
draft)` keeps the longest common prefix of those tokens and `prefix`, but
at most P - 1 tokens (the row after prefix[-1] must be computed, so that
token is always refed), then feeds the rest of prefix + draft in one
bucketed pass. In the steady state the kept part is the whole committed
prefix but its last token, so one `extend` of [prefix[-1], x_1..x_D] gives
the D + 1 rows; a rejected tail is never recomputed, only overwritten. A
request longer than max_len is refused (ValueError naming the limit): a
target row must see its whole context.

**Draft** (`TransformerDraft`). The handle is a `DraftState`, a pytree of
fixed-shape arrays (the proposer traces `step` under `jax.jit`): the cache,
the tokens it holds, their count, and the draft's weights (passed as an
argument of the jitted proposer rather than closed over, so they are not
baked into its program as constants). `catch_up` is host side: it keeps the
longest common prefix of the cached tokens and context[:-1] and feeds the
rest. Context beyond what fits is truncated from the left: the draft sees a
window that starts at a multiple of half its capacity (capacity = max_len -
max_depth, the room `step` needs), so the window, and with it the cache,
moves only every capacity / 2 tokens. The draft's q may be anything; the
output distribution does not depend on it.
"""

import pathlib
import typing

import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax.models import batched
from dyadic_jax.models import checkpoint
from dyadic_jax.models import gguf_model
from dyadic_jax.models import tokenizer as tokenizer_lib
from dyadic_jax.models import transformer
from dyadic_jax.models import vocab_map as vocab_map_lib

CHECKPOINT_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints"


def _tokens(name: str, value: typing.Any, vocab: int) -> np.ndarray:
  """value as int32[n], every id in [0, vocab), or a ValueError naming it."""
  array = np.asarray(value)
  if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
    raise ValueError(f"{name} must be a 1-D integer array, got "
                     f"{array.dtype}{list(array.shape)}")
  array = array.astype(np.int32)
  if array.size and (array.min() < 0 or array.max() >= vocab):
    raise ValueError(f"{name} holds ids outside [0, {vocab})")
  return array


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two 1-D arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if diff.size else n


class TargetState(typing.NamedTuple):
  """A target request's handle: the cache and the tokens it covers."""
  cache: transformer.Cache
  tokens: np.ndarray  # int32[n]: the cache holds positions 0..n-1


class TransformerTarget:
  """`TargetModel` over a transformer (no processors)."""

  def __init__(self, params: transformer.Params, config: transformer.Config):
    self.params = params
    self.config = config
    # The per-request path reads its blocks unstacked (stacked, each call
    # copied every block's weights: 0.7 s a step for SmolLM2).
    self.weights = transformer.unstack(params)

  @property
  def vocab(self) -> int:
    return self.config.vocab

  @property
  def max_len(self) -> int:
    """The longest prefix + draft a request may reach."""
    return self.config.max_len

  def batch(self, capacity: int) -> batched.SlabTarget:
    """A `TargetBatch` of up to `capacity` requests (`batched`)."""
    return batched.SlabTarget(self.params, self.config, capacity)

  def init_state(self) -> TargetState:
    """An empty handle (covers nothing)."""
    return TargetState(cache=transformer.empty_cache(self.config),
                       tokens=np.zeros((0,), np.int32))

  def logits(self, state: TargetState | None, prefix: typing.Any,
             draft: typing.Any) -> tuple[jax.Array, TargetState]:
    """(f32[D + 1, V] rows, the handle covering prefix + draft).

    Row i scores the position after prefix + draft[:i]. state None is an
    empty handle.

    Raises:
      ValueError: prefix empty, a bad array or id, or P + D > max_len.
    """
    if state is None:
      state = self.init_state()
    prefix = _tokens("prefix", prefix, self.vocab)
    draft = _tokens("draft", draft, self.vocab)
    if prefix.size == 0:
      raise ValueError("prefix must hold at least one token")
    full = np.concatenate([prefix, draft])
    if full.size > self.max_len:
      raise ValueError(
          f"prefix ({prefix.size}) + draft ({draft.size}) tokens exceed the "
          f"target's max_len {self.max_len}")
    keep = min(common_prefix(state.tokens, prefix), prefix.size - 1)
    rows, cache = transformer.feed(self.weights, state.cache, full[keep:],
                                   keep, transformer.arch_of(self.config))
    return rows[-(draft.size + 1):], TargetState(cache=cache, tokens=full)


class DraftState(typing.NamedTuple):
  """A draft request's handle: fixed-shape arrays only (a jit pytree)."""
  cache: transformer.Cache
  tokens: jax.Array            # int32[max_len]: [0, length) are cached
  length: jax.Array            # int32[]
  params: transformer.Params   # the draft's weights (see the module doc)
  vocab_map: vocab_map_lib.VocabMap | None   # a restricted vocabulary


class TransformerDraft:
  """`DraftModel` over a transformer.

  Args:
    params, config: the draft.
    max_depth: the most `step` calls between two `catch_up`s (the proposer's
      D); catch_up leaves that much room in the cache.
    vocab_map: a restricted output vocabulary (`vocab_map`): the model's
      config has K + 1 ids, its rows come out over `vocab` ids, zero
      weight outside the kept ones; None: the model's ids are the
      vocabulary.
    vocab: the full vocabulary's size (with vocab_map only).
  """

  # It drafts from the committed prefix: a worker asks for CONTEXT frames.
  wants_context = True

  def __init__(self, params: transformer.Params, config: transformer.Config,
               max_depth: int = 64,
               vocab_map: vocab_map_lib.VocabMap | None = None,
               vocab: int | None = None):
    if not 1 <= max_depth < config.max_len // 2:
      raise ValueError(f"TransformerDraft: max_depth must be in [1, "
                       f"{config.max_len // 2}), got {max_depth}")
    if (vocab_map is None) != (vocab is None) or (
        vocab_map is not None and vocab_map.to_small.shape != (vocab,)):
      raise ValueError("TransformerDraft: vocab_map and vocab go together "
                       "(a map of vocab ids)")
    self.params = params
    self.config = config
    self.max_depth = max_depth
    self.vocab_map = vocab_map
    self._vocab = config.vocab if vocab is None else vocab

  @property
  def vocab(self) -> int:
    """The vocabulary the draft's rows cover."""
    return self._vocab

  def _model_ids(self, tokens: np.ndarray) -> np.ndarray:
    if self.vocab_map is None:
      return tokens
    return vocab_map_lib.host_small(self.vocab_map, tokens)

  @property
  def capacity(self) -> int:
    """The most context tokens catch_up caches."""
    return self.config.max_len - self.max_depth

  def batch(self, capacity: int) -> batched.SlabDraft:
    """Every request's handle in one slab (`batched.SlabDraft`)."""
    return batched.SlabDraft(self, capacity)

  def init_state(self) -> DraftState:
    """An empty handle (nothing cached)."""
    return DraftState(
        cache=transformer.empty_cache(self.config),
        tokens=jnp.zeros((self.config.max_len,), jnp.int32),
        length=jnp.zeros((), jnp.int32), params=self.params,
        vocab_map=self.vocab_map)

  def window_start(self, n: int) -> int:
    """First context position the draft keeps when it caches n tokens."""
    if n <= self.capacity:
      return 0
    stride = max(1, self.capacity // 2)
    return -(-(n - self.capacity) // stride) * stride

  def catch_up(self, state: DraftState | None, context: typing.Any,
               last_token: int, anchor: int) -> DraftState:
    """The handle ready for `step(state, last_token)` (host side).

    Caches context[:-1] (its last `capacity` tokens at most, see
    `window_start`), reusing the longest common prefix with what the
    handle holds. context None: nothing cached (last_token is then the
    whole prefix the draft sees).

    Raises:
      ValueError: context is not int32[anchor] ending in last_token.
    """
    if state is None:
      state = self.init_state()
    if context is None:
      return state._replace(length=jnp.zeros((), jnp.int32))
    context = _tokens("context", context, self.vocab)
    if context.size != anchor or context.size == 0 or \
        int(context[-1]) != int(last_token):
      raise ValueError(f"context must be int32[anchor={anchor}] ending in "
                       f"last_token={last_token}, got {context.size} tokens")
    body = context[:-1]
    body = body[self.window_start(body.size):]
    tokens = np.array(state.tokens)
    keep = common_prefix(tokens[:int(state.length)], body)
    cache = state.cache
    if keep < body.size:
      _, cache = transformer.feed(self.params, cache,
                                  self._model_ids(body[keep:]), keep,
                                  transformer.arch_of(self.config))
      tokens[keep:body.size] = body[keep:]
    return DraftState(cache=cache, tokens=jnp.asarray(tokens),
                      length=jnp.asarray(body.size, jnp.int32),
                      params=self.params, vocab_map=self.vocab_map)

  def step(self, state: DraftState,
           token: jax.Array) -> tuple[jax.Array, DraftState]:
    """(f32[V] logits after token, the handle with token appended).

    jax-traceable. Past max_len (more steps than max_depth after a
    catch_up) the write is clamped and the logits are garbage: valid
    draws, worse acceptance, never an error.
    """
    token = jnp.asarray(token, jnp.int32).reshape((1,))
    fed = token if state.vocab_map is None else vocab_map_lib.to_small(
        state.vocab_map, token)
    logits, cache = transformer.extend_traced(
        state.params, state.cache, fed, state.length,
        transformer.arch_of(self.config))
    row = logits[0] if state.vocab_map is None else vocab_map_lib.expand(
        state.vocab_map, logits[0])
    return row, state._replace(
        cache=cache, tokens=state.tokens.at[state.length].set(token[0]),
        length=state.length + jnp.int32(1))


class Pair(typing.NamedTuple):
  """A loaded checkpoint."""
  target: TransformerTarget
  draft: TransformerDraft
  tokenizer: tokenizer_lib.Tokenizer
  meta: dict[str, typing.Any]  # config.json


def load_dir(directory: str | pathlib.Path, max_depth: int = 64) -> Pair:
  """The pair saved in a checkpoint directory (see `checkpoint`).

  A folder whose config.json names a GGUF target (`{"target": {"gguf":
  "smollm2", "max_len": ...}}`) holds the draft alone: the target and the
  tokenizer come from the shipped GGUF file (`gguf_model`), the draft is
  over a restricted output vocabulary when the config lists `kept` ids.
  """
  directory = pathlib.Path(directory)
  meta = checkpoint.read_config(directory / checkpoint.CONFIG_FILE)
  if "gguf" in meta.get("target", {}):
    return _load_gguf_pair(directory, meta, max_depth)
  target_config = checkpoint.model_config(meta, "target")
  draft_config = checkpoint.model_config(meta, "draft")
  target = TransformerTarget(checkpoint.load_params(
      directory / checkpoint.TARGET_FILE, target_config), target_config)
  draft = TransformerDraft(checkpoint.load_params(
      directory / checkpoint.DRAFT_FILE, draft_config), draft_config,
                           max_depth=max_depth)
  tok = tokenizer_lib.load(directory / meta.get(
      "tokenizer_file", checkpoint.TOKENIZER_FILE))
  if tok.vocab != target.vocab or tok.vocab != draft.vocab:
    raise ValueError(f"{directory}: tokenizer vocab {tok.vocab}, target "
                     f"{target.vocab}, draft {draft.vocab} differ")
  return Pair(target=target, draft=draft, tokenizer=tok, meta=meta)


def _load_gguf_pair(directory: pathlib.Path, meta: dict[str, typing.Any],
                    max_depth: int) -> Pair:
  spec = gguf_model.SHIPPED[meta["target"]["gguf"]]
  model = gguf_model.read(gguf_model.locate(spec),
                          max_len=int(meta["target"].get("max_len", 2048)))
  target = TransformerTarget(jax.tree.map(jnp.asarray, model.params),
                             model.config)
  config = checkpoint.model_config(meta, "draft")
  params = checkpoint.load_params(directory / checkpoint.DRAFT_FILE, config)
  kept = meta.get("kept")
  vmap = None if kept is None else vocab_map_lib.make(
      np.asarray(kept, np.int32), target.vocab)
  draft = TransformerDraft(params, config, max_depth=max_depth,
                           vocab_map=vmap,
                           vocab=None if vmap is None else target.vocab)
  if draft.vocab != target.vocab:
    raise ValueError(f"{directory}: the draft's vocab {draft.vocab} is not "
                     f"the target's {target.vocab}")
  meta = {**meta, "eos": model.eos, "chat": True}
  return Pair(target=target, draft=draft, tokenizer=model.tokenizer,
              meta=meta)


def load_pair(name: str = "stdlib", max_depth: int = 64) -> Pair:
  """The shipped checkpoint `name` (dyadic_jax/models/checkpoints/<name>/)."""
  return load_dir(CHECKPOINT_DIR / name, max_depth=max_depth)
