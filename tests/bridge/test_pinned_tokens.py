"""The committed tokens of every way of generating, held to a recorded run.

One small fixed-seed generation per mode on the toy pipeline pair (V 64):
one process with sparse, dense and greedy rows (`generate.Local`), with
adaptive depth too, the target-only baseline, and the bridge over a
loopback link (`Bridged`) whose plan sharer turns some verified rows into
target-only fallbacks and records every plan, which a follower rank's
`Verifier` then replays (it must commit what the leader committed); and
the bridge with two rounds in flight, fixed and adaptive depth. (The rank
links' tokens are held equal to one process's by
tests/experiments/test_pp1_pipeline.py.) A refactor of the round keeps
these tokens; a change of behaviour regenerates the fixture on purpose:

    python -m tests.bridge.test_pinned_tokens

which rewrites tests/bridge/pinned_tokens.json from the code as it is.
"""

import functools
import json
import pathlib

import numpy as np

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import generate, hello, verifier_session
from dyadic_jax.models import toy_pair
from dyadic_jax.wire.layouts import Feature, Mode, Representation
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness as h

FIXTURE = pathlib.Path(__file__).with_name("pinned_tokens.json")
V = 64
PROMPTS = [[1, 2, 3], [4], [5, 6]]
RUN = dict(max_new_tokens=8, seed=3)
RULE = dj.AdaptiveDepth(max_depth=3, step_cost=0.3, min_depth=1)
ADAPTIVE = hello.DEFAULT_FEATURES | Feature.ADAPTIVE_DEPTH


@functools.lru_cache(maxsize=None)
def _pair():
  return toy_pair.make_models(toy_pair.ModelConfig(vocab=V, max_depth=3))


def _caps(representation, mode=Mode.SAMPLED,
          features=hello.DEFAULT_FEATURES):
  return bridge.Capabilities(mode=mode, vocab=V, max_depth=3,
                             max_requests=2, representation=representation,
                             max_support=8, features=features)


def _local(representation, mode=Mode.SAMPLED, admission=None):
  target, draft = _pair()
  link = generate.Local(draft, target, _caps(representation, mode),
                        admission=admission)
  return generate.generate(link, PROMPTS, **RUN)


def _bridged_two_in_flight(representation, features=hello.DEFAULT_FEATURES,
                           admission=None):
  """Tokens of a bridged run with two groups in flight (3 prompts, 2 a
  group)."""
  target, draft = _pair()
  caps = _caps(representation, features=features)
  served = h.serve(bridge.Worker(
      caps, bridge.draft_proposer(draft, caps, admission=admission),
      secret=h.SECRET))
  verifier = bridge.Verifier(caps, served.address, target=target,
                             secret=h.SECRET, timeout_s=h.GENEROUS_S)
  try:
    verifier.open()
    out = generate.generate(generate.Bridged(verifier), PROMPTS,
                            in_flight=2, **RUN)
  finally:
    served.close()
    verifier.close()
  assert verifier.counters.events("overlapped") > 0
  assert verifier.counters.events("fallbacks") == 0
  return out


class _Recording:
  """A leader's plan sharer: every third plan falls back on its first row
  (as if its q had timed out), and every plan is kept for a follower."""

  def __init__(self, caps):
    self.caps = caps
    self.plans = []

  def share(self, plan):
    if len(self.plans) % 3 == 2:
      codes = plan.codes.copy()
      codes[0] = Code.TIMEOUT
      plan = plan._replace(codes=codes)
    self.plans.append(plan)
    return plan

  def stop(self):
    r = self.caps.max_requests
    plan = verifier_session.empty_plan(self.caps, [0] * r, [(0, 0)] * r,
                                       [0] * r, self.caps.max_depth)
    self.plans.append(plan._replace(stop=np.ones((), np.int32)))


class _Replay:
  """A follower's plan sharer: the leader's plans, in order."""

  def __init__(self, plans):
    self.plans = iter(plans)

  def share(self, plan):
    assert plan is None     # a follower only receives
    return next(self.plans)

  def stop(self):
    raise AssertionError("a follower never stops the others")


def _bridged_with_fallbacks_and_follower():
  """(leader's tokens, follower's tokens) of a bridged run (sparse)."""
  target, draft = _pair()
  caps = _caps(Representation.SPARSE)
  served = h.serve(bridge.Worker(caps, bridge.draft_proposer(draft, caps),
                                 secret=h.SECRET))
  sharer = _Recording(caps)
  leader = bridge.Verifier(caps, served.address, target=target,
                           secret=h.SECRET, timeout_s=h.GENEROUS_S,
                           sharer=sharer)
  try:
    leader.open()
    # One round in flight: the sharer's faults hit every third plan, and
    # with two groups the plans hold other requests.
    out = generate.generate(generate.Bridged(leader), PROMPTS, in_flight=1,
                            **RUN)
    leader.stop_followers()
  finally:
    served.close()
    leader.close()
  assert leader.counters.events("fallbacks") > 0
  seeds = {i: generate.request_seed(RUN["seed"], i)
           for i in range(len(PROMPTS))}
  follower = bridge.Verifier(
      caps, None, target=target, secret=None, sharer=_Replay(sharer.plans),
      request_factory=lambda rid: (PROMPTS[rid], seeds[rid]))
  follower.follow()
  n = RUN["max_new_tokens"]
  followed = [follower.requests[i].tokens[len(p):][:n]
              for i, p in enumerate(PROMPTS)]
  return out, followed


def run_modes():
  """{mode: per prompt, its new tokens} of today's code."""
  target, _ = _pair()
  out = {
      "local_sparse": _local(Representation.SPARSE),
      "local_dense": _local(Representation.DENSE),
      "local_greedy": _local(Representation.SPARSE, Mode.GREEDY),
      "target_only": generate.target_only(target, PROMPTS, **RUN),
      "local_sparse_adaptive": _local(Representation.SPARSE,
                                      admission=RULE),
      "bridged_sparse_two_in_flight": _bridged_two_in_flight(
          Representation.SPARSE),
      "bridged_dense_adaptive_two_in_flight": _bridged_two_in_flight(
          Representation.DENSE, ADAPTIVE, RULE),
  }
  bridged, followed = _bridged_with_fallbacks_and_follower()
  out["bridged_sparse_fallbacks"] = bridged
  tokens = {k: [[int(t) for t in x] for x in r.tokens]
            for k, r in out.items()}
  tokens["follower_rank"] = [[int(t) for t in x] for x in followed]
  return tokens


def test_every_mode_commits_the_recorded_tokens():
  want = json.loads(FIXTURE.read_text())
  got = run_modes()
  assert sorted(got) == sorted(want)
  for mode in want:
    assert got[mode] == want[mode], mode
  # The follower rank commits what its leader committed.
  assert got["follower_rank"] == got["bridged_sparse_fallbacks"]


def dumps(tokens):
  """The fixture's text: one line per mode."""
  return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}"
                             for k, v in sorted(tokens.items())) + "\n}\n"


if __name__ == "__main__":
  FIXTURE.write_text(dumps(run_modes()))
  print(f"wrote {FIXTURE}")
