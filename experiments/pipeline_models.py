"""The PP1 pipeline's models: a processed toy target and a DSpark-style draft.

No downloads; deterministic in the model seed; any vocabulary size.

Target (the verifier's side): the low-rank bigram of `toy_models`, then the
target's processors, applied unchanged to every row the verifier scores:

  * repetition penalty rho >= 1 on every token already in the context
    (prompt, committed tokens and the drafted tokens before the row): a
    positive logit is divided by rho, a negative one multiplied;
  * an optional grammar-style mask: after token a, token b is forbidden
    when (a + b) % grammar_modulus == 0 (a fixed regular constraint; the
    row keeps at least V - ceil(V / modulus) tokens).

Draft (the worker's side), DSpark-style: a parallel backbone gives base
logits for all D positions at once from the committed context (the last
committed token and the anchor), and a sequential low-rank Markov head adds
a bias from x_{i-1}:

    draft_i = head(x_{i-1}) + backbone(x_0, anchor)[i]
    head(prev) = bigram(prev) + (1 - closeness) * noise(prev)
    backbone(x_0, anchor)[i] = (1 - closeness) * position_noise_i(x_0)

so closeness = 1 makes the draft the target's bigram without its
processors, and closeness = 0 adds perturbations as large as the signal.

Plug in your own models through `TargetModel` and `DraftModel`.
"""

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from experiments import toy_models


class TargetModel(typing.Protocol):
  """What the verifier needs: logits of the rows of one drafted chain."""

  vocab: int

  def logits(self, prefix, draft):
    """float32[len(draft) + 1, V]: row i scores the position after
    prefix + draft[:i], with the target's processors applied."""


class DraftModel(typing.Protocol):
  """What the worker needs (jax-traceable callables)."""

  vocab: int

  def head(self, prev_token):
    """float32[V]: the sequential (Markov) part after prev_token."""

  def backbone(self, last_token, anchor, depth):
    """float32[depth, V]: base logits of every drafted position at once,
    or None for a purely sequential draft."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shapes, seed and knobs of the toy pair.

  Attributes:
    vocab: V.
    seed: seed of every factor.
    closeness: draft closeness to the target's bigram in [0, 1].
    repetition_penalty: rho >= 1 (1 disables the processor).
    grammar_modulus: 0 disables the mask; m >= 2 forbids b after a when
      (a + b) % m == 0.
    max_depth: positions the backbone produces.
  """
  vocab: int = toy_models.DEFAULT_VOCAB
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
  toy: toy_models.ToyModel
  config: ModelConfig

  @property
  def vocab(self):
    return self.config.vocab

  def logits(self, prefix, draft):
    prefix = np.asarray(prefix, np.int32)
    seen = np.zeros(self.vocab, bool)   # host side: no recompile per length
    seen[prefix] = True
    return _target_rows(self.toy, jnp.int32(prefix[-1]), jnp.asarray(seen),
                        jnp.asarray(draft, jnp.int32),
                        jnp.float32(self.config.repetition_penalty),
                        self.config.grammar_modulus)

  def row(self, prefix):
    """The target row after `prefix` alone (the target-only sampler's)."""
    return self.logits(prefix, np.zeros(0, np.int32))[0]


@functools.partial(jax.jit, static_argnums=(5,))
def _target_rows(toy, last, seen, draft, penalty, modulus):
  vocab = toy.out.shape[-1]
  chain = jnp.concatenate([last[None], draft])           # x_0, x_1..x_D
  rows = toy_models.target_logits(toy, chain)            # [D+1, V]
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
  """DSpark-style draft: parallel backbone + sequential Markov head."""
  toy: toy_models.ToyModel
  config: ModelConfig
  position_noise: jax.Array     # f32[max_depth, r, V]

  @property
  def vocab(self):
    return self.config.vocab

  def head(self, prev_token):
    return toy_models.draft_logits(self.toy, prev_token,
                                   jnp.float32(self.config.closeness))

  def backbone(self, last_token, anchor, depth):
    del anchor  # the toy's backbone depends on x_0 only
    r = self.toy.emb.shape[-1]
    x0 = self.toy.pert_emb[last_token] / jnp.sqrt(jnp.float32(r))
    base = jnp.einsum("r,drv->dv", x0, self.position_noise[:depth])
    return (1.0 - self.config.closeness) * base


def make_models(config):
  """(ToyTarget, ToyDraft) of a ModelConfig; deterministic in its seed."""
  toy = toy_models.make_toy(toy_models.ToyConfig(
      vocab=config.vocab, seed=config.seed, closeness=config.closeness))
  r = toy.emb.shape[-1]
  noise = jax.random.normal(jax.random.key(config.seed + 1),
                            (config.max_depth, r, config.vocab), jnp.float32)
  noise = noise * toy_models._LOGIT_STD  # pylint: disable=protected-access
  return ToyTarget(toy, config), ToyDraft(toy, config, noise)
