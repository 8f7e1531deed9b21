"""The model protocols and their adapters (the body of `dyadic_jax.models`).

Imports no JAX: see the package's docstring.
"""

from __future__ import annotations

import typing

import numpy as np

if typing.TYPE_CHECKING:
  import jax

State = typing.Any   # a model's per-request handle (None: stateless)


@typing.runtime_checkable
class TargetModel(typing.Protocol):
  """What the verifier needs: logits of the rows of one drafted chain."""

  @property
  def vocab(self) -> int:
    """V, the size of every logit row."""
    ...

  def init_state(self) -> State:
    """An empty per-request handle (e.g. a KV cache); None when stateless."""
    ...

  def logits(self, state: State, prefix: np.ndarray,
             draft: np.ndarray) -> tuple[jax.Array, State]:
    """(float32[len(draft) + 1, V] target logits, the request's new handle).

    Args:
      state: the request's handle (`init_state()` on its first call).
      prefix: int32[P], P >= 1, the committed tokens (prompt first).
      draft: int32[D], D >= 0, the drafted tokens x_1..x_D.

    Row i scores the position after prefix + draft[:i], with the target's
    processors applied; row D is the bonus row. The handle may cache any
    prefix of prefix + draft; the next call for the same request reuses
    the longest cached prefix of its own `prefix` (the rejected tail is
    rolled back, never recomputed).
    """
    ...


# sample(logits f32[B, V], step int32[], aux) -> (token int32[B], status
# int32[B]): a traceable draw for `TargetBatch.decode`.
Sampler = typing.Callable[[typing.Any, typing.Any, typing.Any],
                          tuple[typing.Any, typing.Any]]


@typing.runtime_checkable
class TargetBatch(typing.Protocol):
  """Many requests' target handles in one place, scored in one call.

  A `TargetModel` may offer one as `target.batch(capacity)`; the round
  engine then scores every request of a round with one `rows` call, and
  the target-only baseline decodes with `decode`. Per-request handles live
  inside it, under the caller's request ids, until `drop`.
  """

  def rows(self, rids: typing.Sequence[int],
           prefixes: typing.Sequence[np.ndarray],
           drafts: np.ndarray) -> jax.Array:
    """f32[B, D + 1, V]: row [b, i] scores the position after prefixes[b]
    + drafts[b, :i] (as `TargetModel.logits`, request by request; at most
    `capacity` distinct rids a call, drafts int32[B, D]). A batch may hold
    fewer handles than requests: one it gave up is rebuilt from the
    prefix, slower, never different."""
    ...

  def decode(self, rids: typing.Sequence[int],
             prefixes: typing.Sequence[np.ndarray],
             steps: int | typing.Sequence[int], sample: Sampler,
             aux: typing.Any) -> tuple[jax.Array, jax.Array]:
    """(token int32[B, S], status int32[B, S]): `steps` target-only steps
    of every request in one call (an int, or one count per request: S is
    the largest, and a request's columns past its own count are token -1,
    status 0; only its own steps must fit its context). Step s feeds each
    request's last token (prefixes[b][-1], then its step s - 1 token) and
    draws the next with `sample(rows f32[B, V], s, aux)`; the handles end
    covering each prefix + its first steps - 1 tokens (the last is not
    fed)."""
    ...

  def drop(self, rid: int) -> None:
    """Forgets request `rid`'s handle (its slot is free again)."""
    ...

  def holds(self, rid: int) -> bool:
    """Whether it holds request `rid`'s handle (a `models.pool` routes
    calls by it)."""
    ...


@typing.runtime_checkable
class DraftModel(typing.Protocol):
  """What the worker needs: a per-request handle and a traceable step."""

  @property
  def vocab(self) -> int:
    """V, the size of every logit row."""
    ...

  def init_state(self) -> State:
    """An empty per-request handle: a pytree of fixed-shape arrays (the
    proposer's jit traces it)."""
    ...

  def catch_up(self, state: State, context: np.ndarray | None,
               last_token: int, anchor: int) -> State:
    """Host side, before a round's draw: the handle ready for
    `step(state, last_token)`.

    Args:
      state: the handle the request's previous draw returned (after its D
        steps), or `init_state()`.
      context: int32[anchor], the committed prefix (context[-1] ==
        last_token), or None where the worker does not know it.
      last_token: the last committed token x_0.
      anchor: the absolute position of x_1.
    """
    ...

  def step(self, state: State, token: jax.Array
           ) -> tuple[jax.Array, State]:
    """jax-traceable: (float32[V] logits of the position after `token`, the
    handle with `token` appended). The proposer calls it D times in one
    jitted call: first with x_0, then with each drafted token."""
    ...


class Stateless(typing.NamedTuple):
  """A `TargetModel` of a plain `(prefix, draft) -> rows` function."""
  fn: typing.Callable[[np.ndarray, np.ndarray], jax.Array]
  vocab: int = 0

  def init_state(self) -> None:
    return None

  def logits(self, state: None, prefix: np.ndarray,
             draft: np.ndarray) -> tuple[jax.Array, None]:
    del state
    return self.fn(prefix, draft), None


class MarkovState(typing.NamedTuple):
  """A `Markov` draft's handle: x_0, the anchor and the step count."""
  last_token: jax.typing.ArrayLike   # int32[]
  anchor: jax.typing.ArrayLike       # int64[]
  steps: jax.typing.ArrayLike        # int32[]: steps taken this round


class Markov(typing.NamedTuple):
  """A `DraftModel` of a sequential head on the previous token plus an
  optional parallel backbone (a DSpark-style draft): step i's logits are
  head(x_{i-1}) + backbone(x_0, anchor, depth)[i]. No cache: the handle
  only counts the steps of a round.

  head: jax-traceable `prev_token int32[] -> float32[V]`.
  backbone: None, or jax-traceable `(last_token int32[], anchor int64[],
    depth) -> float32[depth, V]`, base logits of every drafted position
    at once from the committed context.
  depth: the backbone's static depth (the session's max depth).
  """
  head: typing.Callable[[jax.Array], jax.Array]
  backbone: typing.Callable[[typing.Any, typing.Any, int], jax.Array] | None
  depth: int
  vocab: int = 0

  def init_state(self) -> MarkovState:
    return MarkovState(np.int32(0), np.int64(0), np.int32(0))

  def catch_up(self, state: MarkovState, context: np.ndarray | None,
               last_token: int, anchor: int) -> MarkovState:
    del state, context   # a Markov draft sees x_0 and the anchor only
    return MarkovState(np.int32(last_token), np.int64(anchor), np.int32(0))

  def step(self, state: MarkovState, token: jax.Array
           ) -> tuple[jax.Array, MarkovState]:
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    logits = self.head(token)
    if self.backbone is not None:
      # The whole [depth, V] block each step: the D steps of one traced
      # chain compute the same expression, which XLA computes once.
      base = self.backbone(state.last_token, state.anchor, self.depth)
      logits = logits + jnp.take(base, state.steps, axis=0)
    return logits, state._replace(steps=jnp.asarray(state.steps) + 1)


def as_target(target: TargetModel | typing.Callable[
    [np.ndarray, np.ndarray], jax.Array]) -> TargetModel:
  """`target` itself if it is a `TargetModel`, else `Stateless(target)`."""
  if hasattr(target, "init_state"):
    return typing.cast(TargetModel, target)
  return Stateless(typing.cast(typing.Callable, target))


def as_draft(draft: DraftModel | typing.Callable[[jax.Array], jax.Array],
             *, backbone: typing.Callable[[jax.Array, jax.Array, int],
                                          jax.Array] | None = None,
             depth: int = 0) -> DraftModel:
  """`draft` itself if it is a `DraftModel`, else `Markov(draft, backbone,
  depth)` (a bare head, with an optional backbone)."""
  if hasattr(draft, "step"):
    if backbone is not None:
      raise ValueError("as_draft: a DraftModel brings its own backbone")
    return typing.cast(DraftModel, draft)
  return Markov(typing.cast(typing.Callable, draft), backbone, depth)
