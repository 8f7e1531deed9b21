"""The batched slabs (`batched.SlabTarget`, `batched.SlabDraft`): rows of
a batch of mixed lengths equal one uncached forward per request, at every
accept length; the fused decode draws what its sampler draws from them.

test_pair's tiny random-init transformer stands in (the slab's
bookkeeping does not depend on the weights); the reference for every row
is one uncached `forward` over the whole sequence.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dyadic_jax.models import batched, pair
from dyadic_jax.models import transformer as tf

# The tiny transformer and its uncached reference rows, test_pair's.
from tests.models.test_pair import CONFIG, D, TOL, V  # pylint: disable=g-bad-import-order
from tests.models.test_pair import params, reference  # pylint: disable=unused-import


def test_rounds_of_mixed_lengths_equal_recompute(params, reference):
  """4 requests with prompts of 1 to 150 tokens, 30 rounds; each round a
  random subset takes part (the others' slots must keep their entries),
  each request accepts a random 0..D of its drafts (the rejected tail
  rolls back), and some requests end and new ones take their slots."""
  rng = np.random.default_rng(0)
  batch = pair.TransformerTarget(params, CONFIG).batch(4)
  prefixes = {rid: rng.integers(0, V, n).astype(np.int32)
              for rid, n in enumerate([1, 17, 64, 150])}
  accepts = set()
  next_rid = 4
  worst = 0.0
  for _ in range(30):
    rids = sorted(rng.choice(list(prefixes), rng.integers(1, 5),
                             replace=False).tolist())
    drafts = rng.integers(0, V, (len(rids), D)).astype(np.int32)
    got = np.asarray(batch.rows(rids, [prefixes[r] for r in rids], drafts))
    assert got.shape == (len(rids), D + 1, V)
    for j, rid in enumerate(rids):
      full = np.concatenate([prefixes[rid], drafts[j]])
      p = len(prefixes[rid])
      worst = max(worst, np.abs(got[j] - reference(full, p - 1, p + D)).max())
      accepted = int(rng.integers(0, D + 1))
      accepts.add(accepted)
      prefixes[rid] = np.append(full[:p + accepted], rng.integers(0, V))
    if rng.random() < 0.2:              # a request ends, a new one starts
      gone = int(rng.choice(list(prefixes)))
      batch.drop(gone)
      del prefixes[gone]
      prefixes[next_rid] = rng.integers(0, V, rng.integers(1, 40)).astype(
          np.int32)
      next_rid += 1
  assert accepts == set(range(D + 1))
  assert worst < TOL, f"batched vs recomputed max abs diff {worst:.3g}"


def test_steady_rounds_feed_one_chunk(params, monkeypatch):
  """After its prompt, a request's round is part of one call; lagging
  slots (new requests) are brought up first, together."""
  batch = pair.TransformerTarget(params, CONFIG).batch(2)
  calls = []
  real = tf.extend_slots

  def spy(weights, slab, tokens, starts, counts=None, **kwargs):
    calls.append(np.asarray(tokens).shape)
    return real(weights, slab, tokens, starts, counts, **kwargs)
  monkeypatch.setattr(tf, "extend_slots", spy)
  a, b = np.arange(10, dtype=np.int32), np.arange(3, dtype=np.int32)
  batch.rows([0, 1], [a, b], np.zeros((2, D), np.int32))
  # Both slots' lagging tokens (9 and 2) in one call padded to 16, then
  # the round; every call has a row per slot.
  assert calls == [(2, 16), (2, D + 1)]
  calls.clear()
  batch.rows([0, 1], [np.append(a, [0, 5]), np.append(b, 7)],
             np.ones((2, D), np.int32))
  assert calls == [(2, D + 1)]


def test_decode_draws_what_its_sampler_draws(params, reference):
  """Fused steps with an argmax sampler equal greedy decoding on the
  recomputed rows, for 3 requests of different lengths in 2 chunks."""
  batch = pair.TransformerTarget(params, CONFIG).batch(4)
  rng = np.random.default_rng(1)
  prefixes = [rng.integers(0, V, n).astype(np.int32) for n in (5, 70, 33)]

  def argmax(logits, step, aux):
    del step
    return (jnp.argmax(logits, -1).astype(jnp.int32) + aux * 0,
            jnp.zeros(logits.shape[0], jnp.int32))

  for steps in (6, 3):
    tokens, status = batch.decode([7, 8, 9], prefixes, steps, argmax,
                                  np.zeros(3, np.int32))
    tokens = np.asarray(tokens)
    assert tokens.shape == (3, steps) and not np.asarray(status).any()
    for j, p in enumerate(prefixes):
      full = np.concatenate([p, tokens[j]])
      rows = reference(full, len(p) - 1, len(full) - 1)
      assert np.array_equal(np.argmax(rows, -1), tokens[j])
    prefixes = [np.concatenate([p, t]) for p, t in zip(prefixes, tokens)]


def test_decode_runs_each_request_its_own_steps(params, reference):
  """Issue 50.6: one call, each request its own step count; a request
  3 steps from the context edge (6 would not fit) beside one of 6
  steps, then 1 step from it. Each row's own steps are greedy on recomputed
  rows, its later columns -1 (status 0), and the next call continues
  from what each was fed."""
  batch = pair.TransformerTarget(params, CONFIG).batch(4)
  rng = np.random.default_rng(2)
  edge = CONFIG.max_len
  prefixes = [rng.integers(0, V, n).astype(np.int32)
              for n in (5, edge - 3, 33)]

  def argmax(logits, step, aux):
    del step
    return (jnp.argmax(logits, -1).astype(jnp.int32) + aux * 0,
            jnp.zeros(logits.shape[0], jnp.int32))

  with pytest.raises(ValueError, match=f"exceed the target's max_len {edge}"):
    batch.decode([7, 8, 9], prefixes, 6, argmax, np.zeros(3, np.int32))
  for own in ([6, 3, 1], [2, 1, 4]):
    tokens, status = batch.decode([7, 8, 9], prefixes, own, argmax,
                                  np.zeros(3, np.int32))
    tokens = np.asarray(tokens)
    assert tokens.shape == (3, max(own)) and not np.asarray(status).any()
    for j, (p, n) in enumerate(zip(prefixes, own)):
      assert (tokens[j, n:] == -1).all()
      full = np.concatenate([p, tokens[j, :n]])
      # The rows need every token but the last (at most max_len of them).
      rows = reference(full[:-1], len(p) - 1, len(full) - 1)
      assert np.array_equal(np.argmax(rows, -1), tokens[j, :n])
    prefixes = [np.concatenate([p, t[:n]])
                for p, t, n in zip(prefixes, tokens, own)]
  assert len(prefixes[1]) == edge + 1   # its last token drawn at the edge


def test_a_full_slab_evicts_the_least_recently_used(params, reference):
  """Past capacity the least recently used request outside the call gives
  its slot up; when it returns it is brought up from nothing, its rows
  still those of recompute. A call of more requests than slots, or of one
  request twice, is refused."""
  batch = pair.TransformerTarget(params, CONFIG).batch(2)
  rng = np.random.default_rng(3)
  prefixes = [rng.integers(0, V, n).astype(np.int32) for n in (5, 9, 7)]
  draft = np.zeros((1, 1), np.int32)

  def rows(rid):
    got = np.asarray(batch.rows([rid], [prefixes[rid]], draft))[0]
    full = np.append(prefixes[rid], 0)
    n = len(prefixes[rid])
    assert np.abs(got - reference(full, n - 1, n + 1)).max() < TOL

  rows(0)
  rows(1)
  rows(0)                  # 1 is now the least recently used
  rows(2)                  # evicts 1
  assert set(batch.slot_of) == {0, 2}
  rows(1)                  # evicts 0; 1 is fed again from nothing
  assert set(batch.slot_of) == {1, 2}
  ok = np.zeros(3, np.int32)
  with pytest.raises(ValueError, match="3 requests in one call, capacity 2"):
    batch.rows([0, 1, 2], [ok] * 3, np.zeros((3, 1), np.int32))
  with pytest.raises(ValueError, match="appears twice"):
    batch.rows([1, 1], [ok, ok], np.zeros((2, 1), np.int32))


def test_bad_input_is_refused(params):
  batch = pair.TransformerTarget(params, CONFIG).batch(2)
  with pytest.raises(ValueError, match="exceed the target's max_len 320"):
    batch.rows([1], [np.zeros(318, np.int32)], np.zeros((1, 3), np.int32))
  with pytest.raises(ValueError, match="outside"):
    batch.rows([1], [np.full(3, V, np.int32)], np.zeros((1, 1), np.int32))
  with pytest.raises(ValueError, match="non-empty"):
    batch.rows([1], [np.zeros(0, np.int32)], np.zeros((1, 1), np.int32))
  with pytest.raises(ValueError, match="capacity must be >= 1"):
    batched.SlabTarget(params, CONFIG, 0)


def test_span_bucket():
  assert [tf.span_bucket(n, 512) for n in (1, 64, 65, 200, 512)] == [
      64, 64, 128, 256, 512]
  assert tf.span_bucket(300, 320) == 320


def greedy_chain(slab, depth):
  """A jitted `(weights, slab, feed, *, span) -> (rows [N, depth, V],
  tokens [N, depth], slab)`: a draft slab's chain drawing each x_i by
  argmax (the proposer's shape, without its draws)."""

  @functools.partial(jax.jit, static_argnames="span", donate_argnums=1)
  def chain(weights, slab_, feed, *, span):
    rows, tokens = [], []
    logits, slab_ = slab.kind.first(weights, slab_, feed, span)
    for i in range(depth):
      if i:
        logits, slab_ = slab.kind.step(weights, slab_, feed, token, i, span)
      token = jnp.argmax(logits, -1).astype(jnp.int32)
      rows.append(logits)
      tokens.append(token)
    return jnp.stack(rows, 1), jnp.stack(tokens, 1), slab_
  return chain


def test_draft_slab_rows_equal_recompute(params, reference):
  """`SlabDraft`: the rows of a batched chain (its first call feeding each
  request's new context tokens and x_0, then one token per step) against
  one uncached forward over each request's window, over 12 rounds of
  random accept lengths, one context past the draft's capacity (its
  window moves) and one request idle in some rounds."""
  draft = pair.TransformerDraft(params, CONFIG, max_depth=8)
  slab = draft.batch(3)
  chain = greedy_chain(slab, D)

  rng = np.random.default_rng(2)
  contexts = {rid: rng.integers(0, V, n).astype(np.int32)
              for rid, n in enumerate([1, 40, 300])}
  worst, moved = 0.0, False
  for r in range(12):
    rids = [0, 1, 2] if r % 3 else [0, 2]
    feed, span, slots = slab.prepare(rids, [contexts[i] for i in rids], D)
    rows, tokens, slab.slab = chain(slab.weights, slab.slab, feed,
                                    span=span)
    rows, tokens = np.asarray(rows), np.asarray(tokens)
    slab.finish(slots, tokens[slots])
    for rid, slot in zip(rids, slots):
      context = contexts[rid]
      start = draft.window_start(context.size - 1)
      moved |= start > 0
      full = np.concatenate([context[start:], tokens[slot]])
      n = context.size - start
      worst = max(worst, np.abs(rows[slot] - reference(full, n - 1,
                                                       n - 1 + D)).max())
      accepted = int(rng.integers(0, D + 1))
      contexts[rid] = np.append(np.concatenate([context,
                                                tokens[slot, :accepted]]),
                                rng.integers(0, V))
  assert moved
  assert worst < TOL, f"batched draft vs recomputed max abs diff {worst:.3g}"
