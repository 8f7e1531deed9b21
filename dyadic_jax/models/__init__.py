"""The model interfaces a deployment implements to plug into the pipeline.

A verifier needs a *target*: the logits of every row of one drafted chain,
after the target's own processors (penalties, grammar masks ...), exactly
as its target-only sampler would see them. A worker needs a *draft*: a
sequential head on the previous token and, optionally, a parallel backbone
that scores all D positions at once (a DSpark-style draft). The bridge
calls them through these shapes:

  * `dyadic_jax.bridge.Verifier(caps, address, target_fn=target.logits)`;
  * `dyadic_jax.bridge.draft_proposer(draft.head, caps,
    backbone_fn=draft.backbone)`, traced under `jax.jit`.

Both are structural `typing.Protocol`s: any object with these attributes
qualifies, no base class is needed. `dyadic_jax.testing.toy_models` holds a
deterministic pair that implements them (no downloads, any V).

Contract the verification relies on (docs/numerics.md): row i of
`TargetModel.logits(prefix, draft)` is the target's distribution of the
token after prefix + draft[:i], the same row `sample_target` would use for
that position; the draft's q may be arbitrary (it changes acceptance, never
the output distribution).
"""

import typing

import jax
import numpy as np


@typing.runtime_checkable
class TargetModel(typing.Protocol):
  """What the verifier needs: logits of the rows of one drafted chain."""

  @property
  def vocab(self) -> int:
    """V, the size of every logit row."""
    ...

  def logits(self, prefix: np.ndarray, draft: np.ndarray) -> jax.Array:
    """float32[len(draft) + 1, V] target logits of one drafted chain.

    Args:
      prefix: int32[P], P >= 1, the committed tokens (prompt first).
      draft: int32[D], D >= 0, the drafted tokens x_1..x_D.

    Row i scores the position after prefix + draft[:i], with the target's
    processors applied; row D is the bonus row.
    """
    ...


@typing.runtime_checkable
class DraftModel(typing.Protocol):
  """What the worker needs (jax-traceable callables)."""

  @property
  def vocab(self) -> int:
    """V, the size of every logit row."""
    ...

  def head(self, prev_token: jax.Array) -> jax.Array:
    """float32[V]: the sequential (Markov) part after prev_token int32[]."""
    ...

  def backbone(self, last_token: jax.Array, anchor: jax.Array,
               depth: int) -> jax.Array | None:
    """float32[depth, V] base logits of every drafted position at once.

    Args:
      last_token: int32[], the committed token before the anchor.
      anchor: int64[], the absolute position of x_1.
      depth: static D.

    Returns None for a purely sequential draft.
    """
    ...
