"""`bridge.generate`: one process, the bridge and a vocabulary mesh commit
the same tokens for the same seeds; streaming, eos, batching, baseline."""

import functools

import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import generate
from dyadic_jax.models import toy_pair
from dyadic_jax.wire import qformats
from dyadic_jax.wire.layouts import Representation
import sharding
from tests import bridge_harness as h
from tests import meshes

V = 64
PROMPTS = [[1, 2, 3], [4], [5, 6], [7], [8, 9, 10]]


@functools.lru_cache(maxsize=None)
def _pair():
  return toy_pair.make_models(toy_pair.ModelConfig(vocab=V, max_depth=4))


def _caps(representation):
  return bridge.Capabilities(vocab=V, max_depth=4, max_requests=2,
                             representation=representation, max_support=8)


def _local(representation, **kw):
  target, draft = _pair()
  return generate.Local(draft, target, _caps(representation), **kw)


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("representation",
                         [Representation.SPARSE, Representation.DENSE])
def test_one_process_bridge_and_mesh_commit_the_same_tokens(representation,
                                                           in_flight):
  """Over the bridge with one round in flight or two (the worker drafts
  one group while the verifier verifies the other), the same tokens as
  one process: a request's keys are its own, whatever its group."""
  kw = dict(max_new_tokens=12, seed=5)
  local = generate.generate(_local(representation), PROMPTS, **kw)
  mesh = meshes.vocab_mesh(2)
  meshed = generate.generate(_local(representation, verify_fn=functools.
                                    partial(sharding.verify_batch,
                                            mesh=mesh)), PROMPTS, **kw)
  target, draft = _pair()
  caps = _caps(representation)
  served = h.serve(bridge.Worker(caps, bridge.draft_proposer(draft, caps),
                                 secret=h.SECRET))
  verifier = bridge.Verifier(caps, served.address, target=target,
                             secret=h.SECRET, timeout_s=h.GENEROUS_S)
  try:
    verifier.open()
    bridged = generate.generate(generate.Bridged(verifier), PROMPTS,
                                in_flight=in_flight, **kw)
  finally:
    served.close()
    verifier.close()
  assert verifier.counters.events("fallbacks") == 0
  # Two in flight did overlap: rounds began while another was out.
  assert (verifier.counters.events("overlapped") > 0) == (in_flight == 2)
  for a, b, c in zip(local.tokens, bridged.tokens, meshed.tokens):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
  assert [len(t) for t in local.tokens] == [12] * len(PROMPTS)
  # Drafts were accepted (the toy draft tracks its target), and every
  # round committed at least its corrected or bonus token.
  assert local.accepted.sum() > 0
  assert local.accepted.sum() == bridged.accepted.sum()


def test_streaming_eos_and_the_split():
  link = _local(Representation.SPARSE)
  seen = []
  out = generate.generate(link, PROMPTS[:3], max_new_tokens=30,
                          seed=1, on_round=seen.append)
  # Streamed rounds add up to what was returned (before trimming).
  streamed = {}
  for done in seen:
    for c in done:
      streamed.setdefault(c.rid, []).extend(c.tokens)
      assert 1 <= len(c.tokens) == c.accepted + 1 <= 5
  for i, tokens in enumerate(out.tokens):
    np.testing.assert_array_equal(tokens, streamed[i][:30])
  # An eos token ends its request and is kept; the run is the same up to it.
  eos = int(out.tokens[0][3])
  cut = generate.generate(_local(Representation.SPARSE), PROMPTS[:3],
                          max_new_tokens=30, seed=1, eos=eos)
  first = list(out.tokens[0]).index(eos)
  np.testing.assert_array_equal(cut.tokens[0], out.tokens[0][:first + 1])
  assert set(out.seconds) == set(generate.PARTS) | {"wall"}
  assert out.seconds["draft"] > 0 and out.seconds["target"] > 0
  assert abs(sum(out.seconds[p] for p in generate.PARTS)
             - out.seconds["wall"]) < 1e-6


def test_target_only_is_the_target_alone():
  target, _ = _pair()
  out = generate.target_only(target, PROMPTS[:2], max_new_tokens=6, seed=2)
  assert [len(t) for t in out.tokens] == [6, 6] and out.rounds == 12
  again = generate.target_only(target, PROMPTS[:2], max_new_tokens=6, seed=2)
  for a, b in zip(out.tokens, again.tokens):
    np.testing.assert_array_equal(a, b)


def test_wrong_calls_are_refused_up_front():
  """Issue 40: each of these was accepted (a text became one request per
  character, depth=0 the default, 2^70 the seed 0, an empty list a NaN
  mean) or failed late; each is now a TypeError or ValueError that names
  the argument and its range, before any round."""
  target, _ = _pair()
  link = _local(Representation.SPARSE)
  calls = [
      (TypeError, r"prompts is a list of prompts.*pass \['import json'\]",
       dict(prompts="import json")),
      (TypeError, r"prompts\[0\] must be a text or a sequence of token ids",
       dict(prompts=[1, 2, 3])),
      (ValueError, r"prompts is empty", dict(prompts=[])),
      (ValueError, r"prompts\[1\] is empty", dict(prompts=[[1], []])),
      (ValueError, rf"prompts\[0\] holds token {V}, outside \[0, {V}\)",
       dict(prompts=[[1, V]])),
      (ValueError, r"prompts\[0\] holds token -1", dict(prompts=[[-1]])),
      (ValueError, r"max_new_tokens must be >= 1, got 0",
       dict(max_new_tokens=0)),
      (TypeError, r"max_new_tokens must be an int", dict(max_new_tokens=2.5)),
      (ValueError, r"depth must be in \[1, 4\], got 0", dict(depth=0)),
      (ValueError, r"depth must be in \[1, 4\], got 9", dict(depth=9)),
      (ValueError, rf"eos must be in \[0, {V - 1}\], got {V}",
       dict(eos=V)),
      (ValueError, r"eos must be in .*got -1", dict(eos=-1)),
      (ValueError, r"seed must be in \[0, 18446744073709551615\], got "
       r"1180591620717411303424", dict(seed=2**70)),
      (ValueError, r"seed must be in .*got -1", dict(seed=-1)),
      (TypeError, r"seed must be an int", dict(seed="0")),
      (ValueError, r"prompts\[0\] is a text: it needs tokenizer=",
       dict(prompts=["text"])),
  ]
  for error, message, change in calls:
    kw = dict(prompts=PROMPTS[:1], max_new_tokens=3) | change
    with pytest.raises(error, match=f"^generate: {message}"):
      generate.generate(link, kw.pop("prompts"), **kw)
    kw = dict(prompts=PROMPTS[:1], max_new_tokens=3) | change
    kw.pop("depth", None)
    if "depth" not in change:
      with pytest.raises(error, match=f"^target_only: {message}"):
        generate.target_only(target, kw.pop("prompts"), **kw)
  assert not link.requests and not link.seconds   # nothing ran
  _, draft = _pair()
  with pytest.raises(ValueError, match="differ"):
    generate.Local(draft, target, bridge.Capabilities(vocab=V + 1))


def test_a_request_longer_than_the_context_is_refused_before_any_round():
  """Issue 40: max_new_tokens=10**6 generated until the target refused a
  prefix past its max_len, losing every token made. The bound is checked
  up front, and it is exact: the longest call it allows runs."""
  from dyadic_jax.models import pair  # pylint: disable=g-import-not-at-top
  from dyadic_jax.models import transformer  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  config = transformer.Config(vocab=V, d_model=8, n_layers=1, n_heads=2,
                              d_ff=8, max_len=16)
  params = transformer.init(config, jax.random.key(0))
  target = pair.TransformerTarget(params, config)
  draft = pair.TransformerDraft(params, config, max_depth=2)
  caps = bridge.Capabilities(vocab=V, max_depth=2, max_requests=2,
                             representation=Representation.SPARSE,
                             max_support=8)
  link = generate.Local(draft, target, caps)
  prompts = [[1, 2, 3], [4]]
  # 3 + 12 - 1 + 2 = 16 = max_len: fits (depth 2 drafted at 11 new).
  with pytest.raises(ValueError, match=(
      r"^generate: prompts\[0\] \(3 tokens\) \+ max_new_tokens 13 - 1 \+ "
      r"depth 2 = 17 tokens exceed the target's context, max_len 16 "
      r"\(max_new_tokens <= 12 fits\)")):
    generate.generate(link, prompts, max_new_tokens=13)
  with pytest.raises(ValueError, match=r"max_new_tokens 10000000 .*<= 13 fits"):
    generate.generate(link, prompts, max_new_tokens=10**7, depth=1)
  with pytest.raises(ValueError, match=(
      r"^target_only: prompts\[0\] \(3 tokens\) \+ max_new_tokens 15 - 1 = "
      r"17 tokens exceed the target's context, max_len 16")):
    generate.target_only(target, prompts, max_new_tokens=15)
  assert not link.requests and not link.seconds
  out = generate.generate(link, prompts, max_new_tokens=12, seed=3)
  assert [len(t) for t in out.tokens] == [12, 12]
  base = generate.target_only(target, prompts, max_new_tokens=14)
  assert [len(t) for t in base.tokens] == [14, 14]


class _Interrupt(Exception):
  """Stands for a KeyboardInterrupt (not raised for real under pytest)."""


@pytest.mark.parametrize("where", ["on_round", "in_round"])
@pytest.mark.parametrize("interrupt", [_Interrupt, KeyboardInterrupt])
def test_a_link_serves_the_next_call_after_an_interrupted_one(where,
                                                              interrupt):
  """Issue 40: after a KeyboardInterrupt the same link refused every call
  ("duplicate request 0"). The interrupted call removes its requests; the
  next call on the link commits what a fresh link commits."""
  link = _local(Representation.SPARSE)
  fresh = generate.generate(_local(Representation.SPARSE), PROMPTS[:3],
                            max_new_tokens=6, seed=4)
  rounds = [0]

  def stop(*_):
    rounds[0] += 1
    if rounds[0] == 2:
      raise interrupt("stop")

  kw = {}
  if where == "on_round":
    kw["on_round"] = stop
  else:
    inner = link.round
    link.round = lambda rids, depth: (stop(), inner(rids, depth))[1]
  with pytest.raises(interrupt):
    generate.generate(link, PROMPTS[:3], max_new_tokens=6, seed=4, **kw)
  assert not link.requests and not link.engine.states
  if where == "in_round":
    link.round = inner
  again = generate.generate(link, PROMPTS[:3], max_new_tokens=6, seed=4)
  for a, b in zip(fresh.tokens, again.tokens):
    np.testing.assert_array_equal(a, b)


def test_a_bridged_link_serves_the_next_call_after_an_interrupted_one():
  target, draft = _pair()
  caps = _caps(Representation.SPARSE)
  served = h.serve(bridge.Worker(caps, bridge.draft_proposer(draft, caps),
                                 secret=h.SECRET))
  verifier = bridge.Verifier(caps, served.address, target=target,
                             secret=h.SECRET, timeout_s=h.GENEROUS_S)
  try:
    verifier.open()
    link = generate.Bridged(verifier)

    def stop(done):
      raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
      generate.generate(link, PROMPTS[:3], max_new_tokens=6, seed=4,
                        on_round=stop)
    again = generate.generate(link, PROMPTS[:3], max_new_tokens=6, seed=4)
  finally:
    served.close()
    verifier.close()
  # The session's round tags only grow (no key is used twice), so the
  # second call draws anew: it must run whole, with no fallback.
  assert [len(t) for t in again.tokens] == [6, 6, 6]
  assert verifier.counters.events("fallbacks") == 0, (
      str(verifier.counters.snapshot()))


class _Bounded:
  """A target that declares a context (`max_len`), else the toy one."""

  def __init__(self, target, max_len):
    self._target, self.max_len = target, max_len

  def __getattr__(self, name):
    return getattr(self._target, name)


def test_both_links_report_their_targets_context():
  """generate reads `link.max_len` through getattr with a default, so a
  link that lost sight of its target (it moved into the round engine)
  would skip the context check without a word."""
  target, draft = _pair()
  target = _Bounded(target, 16)
  caps = _caps(Representation.SPARSE)
  assert generate.Local(draft, target, caps).max_len == 16
  verifier = bridge.Verifier(caps, None, target=target, secret=None)
  assert generate.Bridged(verifier).max_len == 16


def test_round_keys_are_the_schedules_keys():
  import jax  # pylint: disable=g-import-not-at-top
  from dyadic_jax import rng  # pylint: disable=g-import-not-at-top
  from dyadic_jax.bridge import engine  # pylint: disable=g-import-not-at-top
  seeds, gens, rounds = ([0, 5, 2**64 - 1, 123456789012345],
                         [0, 3, 2**32 - 1, 7], [1, 2, 3, 2**32 - 1])
  for got, s, g, r in zip(engine.round_keys(seeds, gens, rounds), seeds,
                          gens, rounds):
    np.testing.assert_array_equal(jax.random.key_data(got),
                                  jax.random.key_data(rng.round_key(s, g, r)))


class _OneByOne:
  """A model with its slab hidden: the per-request handles' path."""

  def __init__(self, model):
    self._model = model

  def __getattr__(self, name):
    if name == "batch":
      raise AttributeError(name)
    return getattr(self._model, name)


@functools.lru_cache(maxsize=None)
def _stdlib():
  from dyadic_jax.models import pair   # pylint: disable=g-import-not-at-top
  return pair.load_pair("stdlib", max_depth=3)


STDLIB_PROMPTS = ["import os\n", "def main(argv):\n    ", "class A:\n",
                  "x = [i for i"]


@pytest.mark.parametrize("batch, chunk, with_eos", [(1, 16, False),
                                                    (4, 7, False),
                                                    (2, 4, True)])
def test_batched_target_only_commits_what_one_request_decode_does(
    batch, chunk, with_eos):
  """The slab's fused decode (`TargetBatch.decode`) against one `logits`
  call per token: the same tokens, eos and the end of each chunk
  included (rows differ by float rounding only: docs/numerics.md, 12)."""
  p = _stdlib()
  kw = dict(max_new_tokens=12, seed=4, tokenizer=p.tokenizer)
  one = generate.target_only(_OneByOne(p.target), STDLIB_PROMPTS, **kw)
  eos = None
  if with_eos:     # a token the second request draws 6th: it ends early
    eos = kw["eos"] = int(one.tokens[1][5])
    one = generate.target_only(_OneByOne(p.target), STDLIB_PROMPTS, **kw)
  fused = generate.target_only(p.target, STDLIB_PROMPTS, batch=batch,
                               chunk=chunk, **kw)
  for a, b in zip(one.tokens, fused.tokens):
    np.testing.assert_array_equal(a, b)
  if eos is not None:
    assert any(len(t) < 12 for t in fused.tokens)   # eos ended one early


@pytest.mark.parametrize("representation",
                         [Representation.SPARSE, Representation.DENSE])
def test_slabs_commit_what_per_request_handles_commit(representation):
  """`Local` on the pair's slabs (one target call and one draft call per
  round for the batch) against the same pair one request at a time, with
  requests joining and leaving the batch (5 prompts, 2 slots)."""
  p = _stdlib()
  caps = bridge.Capabilities(vocab=p.target.vocab, max_depth=3,
                             max_requests=2, representation=representation,
                             max_support=16)
  kw = dict(max_new_tokens=10, seed=6, tokenizer=p.tokenizer)
  prompts = STDLIB_PROMPTS + ["for k in d:\n"]
  slabs = generate.generate(generate.Local(p.draft, p.target, caps),
                            prompts, **kw)
  one = generate.generate(generate.Local(_OneByOne(p.draft),
                                         _OneByOne(p.target), caps),
                          prompts, **kw)
  for a, b in zip(one.tokens, slabs.tokens):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(one.accepted, slabs.accepted)


def test_adaptive_depth_drafts_a_prefix_of_the_fixed_chain():
  target, draft = _pair()
  caps = _caps(Representation.SPARSE)
  rule = dj.AdaptiveDepth(max_depth=4, step_cost=0.3, min_depth=1)
  with pytest.raises(ValueError, match="min_depth"):
    bridge.draft_proposer(draft, caps, admission=dj.AdaptiveDepth(
        max_depth=4, step_cost=0.3))
  fixed = bridge.draft_proposer(draft, caps)
  adaptive = bridge.draft_proposer(draft, caps, admission=rule)
  lengths = set()
  same = drawn = 0
  for r in range(12):
    context = np.asarray(PROMPTS[r % 5], np.int32)
    args = (7, 0, r + 1, len(context), int(context[-1]), 4)
    full = fixed(*args, context=context)
    short = adaptive(*args, context=context)
    d = len(short.tokens)
    lengths.add(d)
    # The same PROPOSAL keys and draft: the admitted rows are the fixed
    # chain's, up to the float32 logits of a step jitted on its own (a q
    # count may move by a unit or two; each q is exact as shipped).
    np.testing.assert_allclose(short.values, full.values[:d], atol=1e-5)
    same += int((short.tokens == full.tokens[:d]).sum())
    drawn += d
    # Into a REPLY frame (the bridge's worker): the STEP's depth, always.
    out = qformats.Rows(np.zeros(4, np.int32), np.zeros(4, np.int32),
                        np.zeros((4, caps.width), np.int32),
                        np.zeros((4, caps.width), np.float32))
    adaptive(*args, out=out, context=context)
    np.testing.assert_array_equal(out.tokens, full.tokens)
  assert len(lengths) > 1 and lengths <= {1, 2, 3, 4}
  assert same >= 0.9 * drawn


def test_local_with_adaptive_depth_commits_short_chains():
  rule = dj.AdaptiveDepth(max_depth=4, step_cost=0.3, min_depth=1)
  rows = []

  def observe(rids, proposals, logits, outcomes):
    for p, (accepted, _) in zip(proposals, outcomes):
      rows.append((len(p.tokens), accepted))

  kw = dict(max_new_tokens=16, seed=3)
  out = generate.generate(_local(Representation.DENSE, admission=rule,
                                 observe=observe), PROMPTS, **kw)
  again = generate.generate(_local(Representation.DENSE, admission=rule),
                            PROMPTS, **kw)
  assert [len(t) for t in out.tokens] == [16] * len(PROMPTS)
  for a, b in zip(out.tokens, again.tokens):
    np.testing.assert_array_equal(a, b)
  assert len({d for d, _ in rows}) > 1     # several lengths in a batch
  assert all(0 <= a <= d <= 4 for d, a in rows)


def _over_the_bridge(caps, worker, target, prompts, kw):
  """(generate's result, the verifier) of prompts served by `worker` on
  loopback, verified against `target`; both sides closed after."""
  served = h.serve(worker)
  verifier = bridge.Verifier(caps, served.address, target=target,
                             secret=h.SECRET, timeout_s=h.GENEROUS_S)
  try:
    verifier.open()
    return generate.generate(generate.Bridged(verifier), prompts,
                             **kw), verifier
  finally:
    served.close()
    verifier.close()


def test_the_bridge_on_slabs_commits_what_one_process_commits():
  """The shipped pair over the bridge: the worker draws each STEP
  message's proposals in one batched draft call (its proposer's `many`),
  two rounds in flight; the same tokens as `Local` in one process."""
  p = _stdlib()
  caps = bridge.Capabilities(vocab=p.target.vocab, max_depth=3,
                             max_requests=2,
                             representation=Representation.SPARSE,
                             max_support=16)
  kw = dict(max_new_tokens=10, seed=6, tokenizer=p.tokenizer)
  prompts = STDLIB_PROMPTS + ["for k in d:\n"]
  local = generate.generate(generate.Local(p.draft, p.target, caps),
                            prompts, **kw)
  worker = bridge.Worker(caps, bridge.draft_proposer(p.draft, caps),
                         secret=h.SECRET, wants_context=True)
  bridged, verifier = _over_the_bridge(caps, worker, p.target, prompts,
                                       kw)
  assert verifier.counters.events("fallbacks") == 0
  assert verifier.counters.events("overlapped") > 0
  assert worker.counters.events("batched_draws") > 0
  for a, b in zip(local.tokens, bridged.tokens):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.sort(local.accepted),
                                np.sort(bridged.accepted))


def _tiny_transformer_pair(max_len=16, max_depth=2):
  from dyadic_jax.models import pair  # pylint: disable=g-import-not-at-top
  from dyadic_jax.models import transformer  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  config = transformer.Config(vocab=V, d_model=8, n_layers=1, n_heads=2,
                              d_ff=8, max_len=max_len)
  params = transformer.init(config, jax.random.key(0))
  return (pair.TransformerTarget(params, config),
          pair.TransformerDraft(params, config, max_depth=max_depth))


def test_a_tokenizer_or_callback_that_is_none_is_refused_up_front():
  """Issue 51.8: tokenizer="gpt2" ended in an AttributeError traceback,
  on_round=42 in a TypeError after the first round."""
  target, _ = _pair()
  link = _local(Representation.SPARSE)
  with pytest.raises(TypeError, match=r"^generate: tokenizer must be an "
                     r"object with encode\(text\) -> ids.*str 'gpt2'"):
    generate.generate(link, ["import os"], max_new_tokens=2,
                      tokenizer="gpt2")
  with pytest.raises(TypeError, match=r"^target_only: tokenizer must be"):
    generate.target_only(target, ["import os"], max_new_tokens=2,
                         tokenizer="gpt2")
  with pytest.raises(TypeError, match=r"^generate: on_round must be a "
                     r"function .*int 42"):
    generate.generate(link, PROMPTS[:1], max_new_tokens=2, on_round=42)
  assert not link.requests and not link.seconds     # nothing ran


def test_the_context_message_says_what_does_not_fit():
  """Issue 51.8: a prompt that fits the context but leaves no room for
  the drafted tokens was reported as "the prompt alone does not fit"."""
  target, draft = _tiny_transformer_pair(max_len=16, max_depth=2)
  caps = bridge.Capabilities(vocab=V, max_depth=2, max_requests=2,
                             representation=Representation.SPARSE,
                             max_support=8)
  link = generate.Local(draft, target, caps)
  with pytest.raises(ValueError, match=(
      r"prompts\[0\] \(15 tokens\) .* = 17 tokens exceed the target's "
      r"context, max_len 16 \(the prompt fits, but its rounds' 2 drafted "
      r"tokens do not: depth <= 1 with max_new_tokens=1, or a prompt of "
      r"at most 14 tokens\)")) as refused:
    generate.generate(link, [list(range(1, 16))], max_new_tokens=1)
  assert "alone" not in str(refused.value)
  with pytest.raises(ValueError, match=r"\(the prompt alone does not fit\)"):
    generate.generate(link, [list(range(1, 18))], max_new_tokens=1)
  # What the message offers runs.
  out = generate.generate(link, [list(range(1, 16))], max_new_tokens=1,
                          depth=1)
  assert [len(t) for t in out.tokens] == [1]


def test_target_only_allocates_no_batch_wider_than_its_prompts():
  """Issue 51.8: target_only(batch=10**6) tried to allocate the slab of a
  million requests (655 GB) for one prompt."""
  target, _ = _tiny_transformer_pair()
  asked = []
  real = target.batch

  def batch(capacity):
    asked.append(capacity)
    return real(capacity)
  target.batch = batch
  out = generate.target_only(target, [[1, 2], [3]], max_new_tokens=3,
                             batch=10**6)
  assert asked == [2]
  base = generate.target_only(real.__self__, [[1, 2], [3]],
                              max_new_tokens=3, batch=2)
  for a, b in zip(out.tokens, base.tokens):
    np.testing.assert_array_equal(a, b)


def test_a_transformer_drafts_worker_asks_for_the_context_by_default():
  """Issue 50.7: a `bridge.Worker` of a transformer draft built without
  wants_context=True drafted without the committed prefix (exact tokens,
  fewer accepted, no word). Now it asks for CONTEXT by default, so it
  commits what one process commits; wants_context=False is refused."""
  target, draft = _tiny_transformer_pair(max_len=64, max_depth=2)
  caps = bridge.Capabilities(vocab=V, max_depth=2, max_requests=2,
                             representation=Representation.SPARSE,
                             max_support=8)
  proposer = bridge.draft_proposer(draft, caps)
  with pytest.raises(ValueError, match="wants_context=False"):
    bridge.Worker(caps, proposer, secret=h.SECRET, wants_context=False)
  toy_target, toy_draft = _pair()
  toy = bridge.draft_proposer(toy_draft, _caps(Representation.SPARSE))
  assert not bridge.Worker(_caps(Representation.SPARSE), toy,
                           secret=h.SECRET).session.wants_context
  kw = dict(max_new_tokens=8, seed=4)
  prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
  local = generate.generate(generate.Local(draft, target, caps), prompts,
                            **kw)
  worker = bridge.Worker(caps, proposer, secret=h.SECRET)   # no flag
  assert worker.session.wants_context
  bridged, verifier = _over_the_bridge(caps, worker, target, prompts, kw)
  assert verifier.counters.events("fallbacks") == 0
  for a, b in zip(local.tokens, bridged.tokens):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.sort(local.accepted),
                                np.sort(bridged.accepted))
  del toy_target


def test_fused_decode_stops_each_request_at_its_own_edge():
  """Issue 50.6: a request near the context edge sharing a chunk with one
  that just joined ran the newcomer's 16 steps and raised "prefix (61) +
  15 tokens exceed the target's max_len 64" (512 on the stdlib pair),
  although the up-front check passed. Each request now runs its own
  steps: the fused decode commits what one `logits` call per token
  commits."""
  target, _ = _tiny_transformer_pair(max_len=64)
  prompts = [list(range(1, 9)), [t % V for t in range(7, 7 + 64 - 19)],
             list(range(20, 28))]
  kw = dict(max_new_tokens=20, seed=3)
  plain = generate.target_only(_OneByOne(target), prompts, **kw)
  # An eos that ends request 0 within the first chunk and never request 1:
  # request 2 then joins request 1, 16 tokens along, 4 from its end.
  eos = next(int(t) for t in plain.tokens[0][:15]
             if t not in plain.tokens[1])
  kw["eos"] = eos
  one = generate.target_only(_OneByOne(target), prompts, **kw)
  assert len(one.tokens[0]) <= 15 and len(one.tokens[1]) == 20
  fused = generate.target_only(target, prompts, batch=2, chunk=16, **kw)
  for a, b in zip(one.tokens, fused.tokens):
    np.testing.assert_array_equal(a, b)
