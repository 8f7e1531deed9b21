"""The model interfaces a deployment implements to plug into the pipeline.

A verifier needs a *target*: the logits of every row of one drafted chain,
after the target's own processors (penalties, grammar masks ...), exactly
as its target-only sampler would see them. A worker needs a *draft*: one
step at a time, each step the logits of the position after the token it is
given. Both sides carry a per-request handle (a KV cache, or nothing),
which the callers keep per request and hand back on the request's next
round:

  * `dyadic_jax.bridge.Verifier(caps, address, target=target)` keeps one
    `TargetModel` handle per request (`target_fn=` takes a stateless
    `(prefix, draft) -> rows` function instead: `Stateless`);
  * a target may also offer `batch(capacity)`, a `TargetBatch`: every
    request's handle in one place, a round's rows in one call (the
    transformer pair's slab, `batched`);
  * `dyadic_jax.bridge.draft_proposer(draft, caps)` keeps one `DraftModel`
    handle per request and traces `step` D times in one jitted call
    (a bare `prev_token -> logits` function is a `Markov` draft).

Both are structural `typing.Protocol`s: any object with these attributes
qualifies, no base class is needed. Two pairs implement them, side by
side in this package: `toy_pair` (deterministic, stateless, any V, no
downloads) and `pair` (the trained transformer pair with KV caches,
`transformer`, `batched`, `checkpoint`, `tokenizer`; `hf_layout` exports it for
transformers).

This package imports no JAX (tests/test_layers.py holds it so): the
protocols can be read, and implemented, without starting it; `Markov`
imports jax.numpy when it steps. The protocols and adapters live in
`protocols.py`; this package re-exports them.

Contract the verification relies on (docs/numerics.md): row i of
`TargetModel.logits(state, prefix, draft)` is the target's distribution of
the token after prefix + draft[:i], the same row `sample_target` would use
for that position; the draft's q may be arbitrary (it changes acceptance,
never the output distribution), so a draft that lost its context (a
handle rolled back to nothing) is slower, never wrong.
"""

from dyadic_jax.models.protocols import (DraftModel, Markov, MarkovState,
                                        Sampler, State, Stateless,
                                        TargetBatch, TargetModel, as_draft,
                                        as_target)

__all__ = ["DraftModel", "Markov", "MarkovState", "Sampler", "State",
           "Stateless", "TargetBatch", "TargetModel", "as_draft",
           "as_target"]
