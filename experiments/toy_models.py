"""Deterministic toy target and draft LMs for the experiments (no downloads).

The target is a low-rank bigram model: the logits of the next token depend
only on the previous token,

    target(prev) = scale * emb[prev] @ out          emb f32[V, r], out f32[r, V]

and the draft is the target plus a perturbation of the same shape and scale,

    draft(prev) = target(prev) + (1 - closeness) * scale * pemb[prev] @ pout

so closeness = 1 makes the draft exact and closeness = 0 adds noise as large
as the signal. A row costs one gather of r floats and an r x V product, so
V = 129280 is cheap on a CPU. The factors come from a fixed seed, so every run
sees the same models.
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp

from dyadic_jax import DEFAULT_VOCAB

# Standard deviation of a target logit. At V = 129280 this gives an LM-like
# next-token distribution: entropy ~2.5 nats, top-10 ~80% of the mass, top-32
# ~90%, and a long tail that a sparse draft q must leave out.
_LOGIT_STD = 5.0


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


def make_toy(config):
  """Builds the `ToyModel` of a `ToyConfig` (deterministic in config.seed)."""
  v, r = config.vocab, config.rank
  k_emb, k_out, k_pemb, k_pout = jax.random.split(
      jax.random.key(config.seed), 4)
  # Unit-variance factors scaled so that one logit has std _LOGIT_STD.
  scale = _LOGIT_STD / jnp.sqrt(jnp.float32(r))
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  return ToyModel(
      emb=normal(k_emb, (v, r)) * scale,
      out=normal(k_out, (r, v)),
      pert_emb=normal(k_pemb, (v, r)) * scale,
      pert_out=normal(k_pout, (r, v)),
      closeness=jnp.float32(config.closeness))


@jax.jit
def target_logits(toy, prev_tokens):
  """Target logits f32[..., V] after each of prev_tokens int[...].

  The target is a bigram model: a row depends on its previous token only.
  """
  return toy.emb[prev_tokens] @ toy.out


@jax.jit
def draft_logits(toy, prev_tokens, closeness=None):
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
