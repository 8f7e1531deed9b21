"""The toy draft/target pair: deterministic models of any V (no downloads).

Beside `pair` (the trained transformer pair), the other implementation of
the protocols of `dyadic_jax.models`.

Two layers, both deterministic in their seed:

**The bigram pair** (`ToyConfig`, `make_toy`, `target_logits`,
`draft_logits`). The target is a low-rank bigram model: the logits of the
next token depend only on the previous token,

    target(prev) = scale * emb[prev] @ out          emb f32[V, r], out f32[r, V]

and the draft is the target plus a perturbation of the same shape and scale,

    draft(prev) = target(prev) + (1 - closeness) * scale * pemb[prev] @ pout

so closeness = 1 makes the draft exact and closeness = 0 adds noise as large
as the signal. A row costs one gather of r floats and an r x V product, so
V = 129280 is cheap on a CPU.

**The pipeline pair** (`ModelConfig`, `make_models`: a `ToyTarget` and a
`ToyDraft`, which implement `dyadic_jax.models.TargetModel` and
`DraftModel`). The target is the bigram above followed by the target's
processors, applied unchanged to every row the verifier scores:

  * repetition penalty rho >= 1 on every token already in the context
    (prompt, committed tokens and the drafted tokens before the row): a
    positive logit is divided by rho, a negative one multiplied;
  * an optional grammar-style mask: after token a, token b is forbidden
    when (a + b) % grammar_modulus == 0 (a fixed regular constraint; the
    row keeps at least V - ceil(V / modulus) tokens).

The draft is DSpark-style: a parallel backbone gives base logits for all D
positions at once from the committed context (the last committed token and
the anchor), and a sequential low-rank Markov head adds a bias from x_{i-1}:

    draft_i = head(x_{i-1}) + backbone(x_0, anchor)[i]
    head(prev) = bigram(prev) + (1 - closeness) * noise(prev)
    backbone(x_0, anchor)[i] = (1 - closeness) * position_noise_i(x_0)

so closeness = 1 makes the draft the target's bigram without its
processors, and closeness = 0 adds perturbations as large as the signal.
"""

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from dyadic_jax.models import protocols
from dyadic_jax.constants import DEFAULT_VOCAB

# Standard deviation of a target logit. At V = 129280 this gives an LM-like
# next-token distribution: entropy ~2.5 nats, top-10 ~80% of the mass, top-32
# ~90%, and a long tail that a sparse draft q must leave out.
LOGIT_STD = 5.0


# ---------------------------------------------------------------------------
# The bigram pair.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig:
  """Shape and seed of a toy target/draft pair.

  Attributes:
    vocab: vocabulary size V.
    rank: rank r of the bigram factors.
    seed: seed of every factor; equal configs give equal models.
    closeness: in [0, 1]; the default closeness of `draft_logits`.
  """
  vocab: int = DEFAULT_VOCAB
  rank: int = 16
  seed: int = 0
  closeness: float = 0.9

  def __post_init__(self):
    if self.vocab < 2:
      raise ValueError(f"ToyConfig: vocab must be >= 2, got {self.vocab}")
    if self.rank < 1:
      raise ValueError(f"ToyConfig: rank must be >= 1, got {self.rank}")
    if not 0.0 <= self.closeness <= 1.0:
      raise ValueError(
          f"ToyConfig: closeness must be in [0, 1], got {self.closeness}")


class ToyModel(typing.NamedTuple):
  """Parameters of a toy target/draft pair (a pytree: jit/vmap friendly)."""
  emb: jax.Array        # f32[V, r]  target input factors
  out: jax.Array        # f32[r, V]  target output factors
  pert_emb: jax.Array   # f32[V, r]  draft perturbation input factors
  pert_out: jax.Array   # f32[r, V]  draft perturbation output factors
  closeness: jax.Array  # f32[]      default draft closeness


def make_toy(config: ToyConfig) -> ToyModel:
  """Builds the `ToyModel` of a `ToyConfig` (deterministic in config.seed)."""
  v, r = config.vocab, config.rank
  k_emb, k_out, k_pemb, k_pout = jax.random.split(
      jax.random.key(config.seed), 4)
  # Unit-variance factors scaled so that one logit has std LOGIT_STD.
  scale = LOGIT_STD / jnp.sqrt(jnp.float32(r))
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  return ToyModel(
      emb=normal(k_emb, (v, r)) * scale,
      out=normal(k_out, (r, v)),
      pert_emb=normal(k_pemb, (v, r)) * scale,
      pert_out=normal(k_pout, (r, v)),
      closeness=jnp.float32(config.closeness))


@jax.jit
def target_logits(toy: ToyModel, prev_tokens: ArrayLike) -> jax.Array:
  """Target logits f32[..., V] after each of prev_tokens int[...].

  The target is a bigram model: a row depends on its previous token only.
  """
  return toy.emb[prev_tokens] @ toy.out


@jax.jit
def draft_logits(toy: ToyModel, prev_tokens: ArrayLike,
                 closeness: ArrayLike | None = None) -> jax.Array:
  """Draft logits f32[..., V] after prev_tokens int[...].

  Args:
    toy: a `ToyModel`.
    prev_tokens: int[...], the previously sampled (or committed) token of each
      row: this is the draft's Markov dependency on x_{i-1}.
    closeness: optional scalar in [0, 1] overriding `toy.closeness`.
  """
  if closeness is None:
    closeness = toy.closeness
  noise = toy.pert_emb[prev_tokens] @ toy.pert_out
  return target_logits(toy, prev_tokens) + (1.0 - closeness) * noise


# ---------------------------------------------------------------------------
# The pipeline pair: processed target, DSpark-style draft.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shapes, seed and knobs of the pipeline pair.

  Attributes:
    vocab: V.
    seed: seed of every factor.
    closeness: draft closeness to the target's bigram in [0, 1].
    repetition_penalty: rho >= 1 (1 disables the processor).
    grammar_modulus: 0 disables the mask; m >= 2 forbids b after a when
      (a + b) % m == 0.
    max_depth: positions the backbone produces.
  """
  vocab: int = DEFAULT_VOCAB
  seed: int = 0
  closeness: float = 0.9
  repetition_penalty: float = 1.3
  grammar_modulus: int = 0
  max_depth: int = 8

  def __post_init__(self):
    if self.repetition_penalty < 1.0:
      raise ValueError("ModelConfig: repetition_penalty must be >= 1")
    if self.grammar_modulus == 1 or self.grammar_modulus < 0:
      raise ValueError("ModelConfig: grammar_modulus must be 0 or >= 2")


@dataclasses.dataclass(frozen=True)
class ToyTarget:
  """Bigram target with a repetition penalty and an optional grammar mask."""
  toy: ToyModel
  config: ModelConfig

  @property
  def vocab(self) -> int:
    return self.config.vocab

  def init_state(self) -> None:
    return None    # the bigram sees the prefix whole each call: no cache

  def logits(self, state: None, prefix: ArrayLike | typing.Sequence[int],
             draft: ArrayLike | typing.Sequence[int]
             ) -> tuple[jax.Array, None]:
    """(float32[len(draft) + 1, V], None): see
    `dyadic_jax.models.TargetModel`."""
    del state
    return self.rows(prefix, draft), None

  def rows(self, prefix: ArrayLike | typing.Sequence[int],
           draft: ArrayLike | typing.Sequence[int]) -> jax.Array:
    """float32[len(draft) + 1, V], the rows of `logits` (no handle)."""
    prefix = np.asarray(prefix, np.int32)
    seen = np.zeros(self.vocab, bool)   # host side: no recompile per length
    seen[prefix] = True
    return _target_rows(self.toy, jnp.int32(prefix[-1]), jnp.asarray(seen),
                        jnp.asarray(draft, jnp.int32),
                        jnp.float32(self.config.repetition_penalty),
                        self.config.grammar_modulus)

  def row(self, prefix: ArrayLike | typing.Sequence[int]) -> jax.Array:
    """The target row after `prefix` alone (the target-only sampler's)."""
    return self.rows(prefix, np.zeros(0, np.int32))[0]


@functools.partial(jax.jit, static_argnums=(5,))
def _target_rows(toy, last, seen, draft, penalty, modulus):
  vocab = toy.out.shape[-1]
  chain = jnp.concatenate([last[None], draft])           # x_0, x_1..x_D
  rows = target_logits(toy, chain)                       # [D+1, V]
  # Row i sees the prefix and x_1..x_i: a running one-hot OR.
  steps = jnp.zeros((len(chain), vocab), bool).at[
      jnp.arange(1, len(chain)), draft].set(True)
  seen_rows = seen[None] | (jnp.cumsum(steps, axis=0) > 0)
  rows = jnp.where(seen_rows, jnp.where(rows > 0, rows / penalty,
                                        rows * penalty), rows)
  if modulus:
    allowed = (chain[:, None] + jnp.arange(vocab)[None]) % modulus != 0
    rows = jnp.where(allowed, rows, -jnp.inf)
  return rows


@dataclasses.dataclass(frozen=True)
class ToyDraft:
  """DSpark-style draft: parallel backbone + sequential Markov head (a
  `dyadic_jax.models.DraftModel` whose handle counts a round's steps;
  `markov(backbone=False)` is the head alone)."""
  toy: ToyModel
  config: ModelConfig
  position_noise: jax.Array     # f32[max_depth, r, V]

  @property
  def vocab(self) -> int:
    return self.config.vocab

  def markov(self, backbone: bool = True) -> protocols.Markov:
    """This draft as a `models.Markov` (with or without its backbone)."""
    return protocols.Markov(self.head, self.backbone if backbone else None,
                         self.config.max_depth, self.vocab)

  def init_state(self) -> protocols.MarkovState:
    return self.markov().init_state()

  def catch_up(self, state: protocols.MarkovState,
               context: np.ndarray | None, last_token: int,
               anchor: int) -> protocols.MarkovState:
    return self.markov().catch_up(state, context, last_token, anchor)

  def step(self, state: protocols.MarkovState, token: jax.Array
           ) -> tuple[jax.Array, protocols.MarkovState]:
    return self.markov().step(state, token)

  def head(self, prev_token: ArrayLike) -> jax.Array:
    """float32[V]: the Markov head after prev_token int32[]."""
    return draft_logits(self.toy, prev_token,
                        jnp.float32(self.config.closeness))

  def backbone(self, last_token: ArrayLike, anchor: ArrayLike,
               depth: int) -> jax.Array:
    """float32[depth, V]: every position's base logits from x_0."""
    del anchor  # the toy's backbone depends on x_0 only
    r = self.toy.emb.shape[-1]
    x0 = self.toy.pert_emb[last_token] / jnp.sqrt(jnp.float32(r))
    base = jnp.einsum("r,drv->dv", x0, self.position_noise[:depth])
    return (1.0 - self.config.closeness) * base


def make_models(config: ModelConfig) -> tuple[ToyTarget, ToyDraft]:
  """(ToyTarget, ToyDraft) of a ModelConfig; deterministic in its seed."""
  toy = make_toy(ToyConfig(vocab=config.vocab, seed=config.seed,
                           closeness=config.closeness))
  r = toy.emb.shape[-1]
  noise = jax.random.normal(jax.random.key(config.seed + 1),
                            (config.max_depth, r, config.vocab), jnp.float32)
  return ToyTarget(toy, config), ToyDraft(toy, config, noise * LOGIT_STD)
