"""`bridge.generate`: one process, the bridge and a vocabulary mesh commit
the same tokens for the same seeds; streaming, eos, batching, baseline."""

import functools

import numpy as np
import pytest

from dyadic_jax import bridge
from dyadic_jax.bridge import generate
from dyadic_jax.models import toy_pair
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


@pytest.mark.parametrize("representation",
                         [Representation.SPARSE, Representation.DENSE])
def test_one_process_bridge_and_mesh_commit_the_same_tokens(representation):
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
    bridged = generate.generate(generate.Bridged(verifier), PROMPTS, **kw)
  finally:
    served.close()
    verifier.close()
  assert verifier.counters.events("fallbacks") == 0
  for a, b, c in zip(local.tokens, bridged.tokens, meshed.tokens):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
  assert [len(t) for t in local.tokens] == [12] * len(PROMPTS)
  # Drafts were accepted (the toy draft tracks its target), and every
  # round committed at least its corrected or bonus token.
  assert local.accepted.sum() > 0
  assert local.rounds == bridged.rounds


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


def test_bad_input_is_refused():
  link = _local(Representation.SPARSE)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate.generate(link, PROMPTS, max_new_tokens=0)
  with pytest.raises(ValueError, match="depth"):
    generate.generate(link, PROMPTS, max_new_tokens=3, depth=9)
  with pytest.raises(ValueError, match="tokenizer"):
    generate.generate(link, ["text"], max_new_tokens=3)
  target, draft = _pair()
  with pytest.raises(ValueError, match="differ"):
    generate.Local(draft, target, bridge.Capabilities(vocab=V + 1))


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
