"""Speculative generation a user calls: prompts in, new tokens out.

    link = generate.Local(draft, target, caps)        # one process
    link = generate.Bridged(verifier)                 # over the bridge
    out = generate.generate(link, prompts, max_new_tokens=128, eos=eos)

A *link* runs rounds of a batch of requests. `Local` runs the worker's
proposer (`draft_proposer`, the draft's handles) and the verifier's side
(the round engine, `engine.Engine`: the target's handles, `verify_batch`)
in this process, with no wire: a proposal's q goes to verification as the
exact counts it was drawn from. `Bridged` runs them through a `Verifier`
connected to a worker (`python -m experiments.bridge_worker
--model=...`), q on the wire, validated and audited, and the same engine
behind it; this module imports the ZeroMQ driver only to name its type. Both use the bridge's key schedule (generation 0,
rounds 1, 2, ...; PROPOSAL and verification keys of (seed, generation,
round)), so for the same seeds and models they commit the same tokens,
and so does a vocabulary mesh (`verify_fn` of `sharding`).

`target_only` is the baseline: one token per target call, drawn by the
target-only sampler with the TARGET_ONLY key of each position (the
engine's fallback keys).

Every round's cost is split into what the bridge's two hosts spend:
the draft's steps, the target's verify pass, verification, and the rest
(host bookkeeping; over the bridge, the exchange).
"""

import collections
import time
import typing

import jax
import numpy as np

from dyadic_jax import models, rowops, verification
from dyadic_jax.constants import M
from dyadic_jax.bridge import engine as engine_lib
from dyadic_jax.bridge import hello, proposer as proposer_lib
from dyadic_jax.errors import raise_for_status
from dyadic_jax.wire import qformats

if typing.TYPE_CHECKING:   # the ZeroMQ driver, for its type only
  from dyadic_jax.bridge import verifier as verifier_lib

_U64 = (1 << 64) - 1
# One round's cost split (seconds), as `Result.seconds` and `Link.seconds`.
PARTS = ("draft", "target", "verify", "exchange", "host")


class Committed(typing.NamedTuple):
  """What one round committed for one request."""
  rid: int
  tokens: tuple[int, ...]   # appended to the request, in order
  accepted: int             # drafted tokens among them


class Link(typing.Protocol):
  """Runs rounds for requests (`Local`, `Bridged`)."""
  caps: hello.Capabilities
  seconds: collections.defaultdict[str, float]

  def add(self, rid: int, prompt: typing.Sequence[int], seed: int) -> None:
    ...

  def remove(self, rid: int) -> None:
    ...

  def round(self, rids: typing.Sequence[int], depth: int
            ) -> list[Committed]:
    ...


class Result(typing.NamedTuple):
  """What `generate` or `target_only` produced.

  tokens: per prompt, its new tokens (max_new_tokens, or fewer ending with
    eos). rounds: the link's rounds (target calls of `target_only`).
  accepted: drafted tokens committed by each request-round (empty for
    target_only). seconds: wall time, and its split over `PARTS`.
  """
  tokens: list[np.ndarray]
  rounds: int
  accepted: np.ndarray
  seconds: dict[str, float]

  @property
  def new_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def tokens_per_second(self) -> float:
    return self.new_tokens / max(self.seconds["wall"], 1e-9)


def request_seed(seed: int, index: int) -> int:
  """The RNG seed of prompt `index` of a `generate(seed=seed)` call."""
  return (int(seed) * 1_000_003 + index) & _U64


def _block(x: typing.Any) -> typing.Any:
  return jax.block_until_ready(x)


class _Clock:
  """Adds the seconds of `with clock(part):` blocks to a Counter."""

  def __init__(self, seconds: collections.defaultdict[str, float]) -> None:
    self.seconds = seconds
    self.part = ""
    self.start = 0.0

  def __call__(self, part: str) -> "_Clock":
    self.part = part
    return self

  def __enter__(self) -> None:
    self.start = time.perf_counter()

  def __exit__(self, *exc: typing.Any) -> None:
    self.seconds[self.part] += time.perf_counter() - self.start


class _Request:
  __slots__ = ("seed", "tokens", "round")

  def __init__(self, prompt: typing.Sequence[int], seed: int) -> None:
    self.seed = int(seed)
    self.tokens = [int(t) for t in prompt]
    self.round = 0


class Local:
  """Both sides in this process, no wire (see the module docstring)."""

  def __init__(self, draft: models.DraftModel,
               target: models.TargetModel, caps: hello.Capabilities, *,
               verify_fn: engine_lib.VerifyFn = verification.verify_batch,
               executor: rowops.Executor = rowops.LOCAL,
               observe: typing.Callable[..., None] | None = None) -> None:
    """observe: called after each round with (rids, proposals, target rows,
    outcomes (accepted, token)): what a benchmark screens (untimed)."""
    if draft.vocab != caps.vocab or target.vocab != caps.vocab:
      raise ValueError(f"Local: draft V {draft.vocab}, target V "
                       f"{target.vocab} and session V {caps.vocab} differ")
    self.caps = caps
    self.propose = proposer_lib.draft_proposer(draft, caps,
                                               executor=executor)
    self.engine = engine_lib.Engine(caps, target, verify_fn=verify_fn)
    self.observe = observe
    self.requests: dict[int, _Request] = {}
    self.seconds: collections.defaultdict[str, float] = (
        collections.defaultdict(float))
    self._clock = _Clock(self.seconds)

  def add(self, rid: int, prompt: typing.Sequence[int], seed: int) -> None:
    if rid in self.requests or not len(prompt):
      raise ValueError(f"Local.add: duplicate request {rid} or no prompt")
    self.requests[rid] = _Request(prompt, seed)

  def remove(self, rid: int) -> None:
    self.requests.pop(rid)
    self.engine.drop(rid)

  def round(self, rids: typing.Sequence[int], depth: int
            ) -> list[Committed]:
    clock = self._clock
    reqs = [self.requests[r] for r in rids]
    proposals = []
    for rid, req in zip(rids, reqs):
      req.round += 1
      with clock("draft"):
        proposals.append(self.propose(
            req.seed, 0, req.round, len(req.tokens), req.tokens[-1], depth,
            request=rid, context=np.asarray(req.tokens, np.int32)))
    # Generation 0 throughout: nothing is lost without a wire.
    chains = [engine_lib.Chain(rid, req.tokens, req.seed, 0, req.round)
              for rid, req in zip(rids, reqs)]
    with clock("target"):
      logits = _block(self.engine.target_rows(
          chains, [p.tokens for p in proposals]))
    with clock("verify"):
      outcomes = self._verify(chains, proposals, logits)
    if self.observe is not None:
      with clock("observe"):      # not the round's: left out of the wall
        self.observe(rids, proposals, logits, outcomes)
    out = []
    with clock("host"):
      for rid, req, p, (accepted, token) in zip(rids, reqs, proposals,
                                                outcomes):
        committed = tuple(int(t) for t in p.tokens[:accepted]) + (token,)
        req.tokens.extend(committed)
        out.append(Committed(rid, committed, accepted))
    return out

  def _verify(self, chains: list[engine_lib.Chain],
              proposals: list[qformats.Rows],
              logits: list[jax.Array]) -> list[tuple[int, int]]:
    """The engine's verification of the drawn rows (a refusal raises)."""
    rows = qformats.Rows(
        np.stack([p.tokens for p in proposals]),
        np.stack([np.asarray(p.n) for p in proposals]),
        None if proposals[0].ids is None
        else np.stack([np.asarray(p.ids) for p in proposals]))
    counts = None
    if proposals[0].values is not None:
      # The drawn q rows are exact multiples of 1 / M: their counts.
      counts = np.stack([np.rint(np.asarray(p.values, np.float64) * M)
                         for p in proposals]).astype(np.int32)
    got = self.engine.verify(chains, logits, rows, counts)
    raise_for_status("verify_fn", got.status)
    return [(int(a), int(t)) for a, t in zip(got.accepted, got.token)]


class Bridged:
  """Rounds through a `bridge.Verifier` connected to a worker."""

  def __init__(self, verifier: "verifier_lib.Verifier") -> None:
    self.verifier = verifier
    self.caps = verifier.caps
    self.seconds: collections.defaultdict[str, float] = (
        collections.defaultdict(float))

  def add(self, rid: int, prompt: typing.Sequence[int], seed: int) -> None:
    self.verifier.add_request(rid, prompt, seed)

  def remove(self, rid: int) -> None:
    self.verifier.remove_request(rid)

  def round(self, rids: typing.Sequence[int], depth: int
            ) -> list[Committed]:
    start = time.perf_counter()
    results = self.verifier.round(rids, depth)
    self.seconds["exchange"] += time.perf_counter() - start
    return [Committed(r.rid, r.committed, r.accepted) for r in results]


def _encode(prompts: typing.Sequence[typing.Any],
            tokenizer: typing.Any) -> list[list[int]]:
  out = []
  for p in prompts:
    if isinstance(p, str):
      if tokenizer is None:
        raise ValueError("generate: a text prompt needs tokenizer=")
      p = tokenizer.encode(p)
    out.append([int(t) for t in p])
  return out


def _finished(tokens: list[int], limit: int, eos: int | None) -> bool:
  return len(tokens) >= limit or (eos is not None and eos in tokens)


def _trim(tokens: list[int], limit: int, eos: int | None) -> np.ndarray:
  tokens = tokens[:limit]
  if eos is not None and eos in tokens:
    tokens = tokens[:tokens.index(eos) + 1]
  return np.asarray(tokens, np.int32)


def generate(link: Link, prompts: typing.Sequence[typing.Any], *,
             max_new_tokens: int, eos: int | None = None,
             depth: int | None = None, seed: int = 0,
             tokenizer: typing.Any = None,
             on_round: typing.Callable[[list[Committed]], None]
             | None = None) -> Result:
  """Speculative decoding of every prompt until max_new_tokens or eos.

  Args:
    link: `Local` or `Bridged`.
    prompts: token id sequences, or text with `tokenizer` (an object with
      `encode(text) -> ids`).
    max_new_tokens: new tokens per prompt (>= 1).
    eos: a token that ends its request when committed (kept in the output).
    depth: drafted tokens per round (default: the session's max depth).
    seed: prompt i's requests draw with `request_seed(seed, i)`.
    on_round: called with each round's `Committed` list (streaming).

  Requests run in batches of at most `caps.max_requests`; one that is done
  leaves its batch at once and the next prompt takes its place.
  """
  caps = link.caps
  depth = depth or caps.max_depth
  if max_new_tokens < 1 or not 1 <= depth <= caps.max_depth:
    raise ValueError(f"generate: max_new_tokens {max_new_tokens} >= 1 and "
                     f"depth {depth} in [1, {caps.max_depth}] needed")
  encoded = _encode(prompts, tokenizer)
  new: dict[int, list[int]] = {i: [] for i in range(len(encoded))}
  waiting = collections.deque(range(len(encoded)))
  live: list[int] = []
  accepted: list[int] = []
  rounds = 0
  before = collections.defaultdict(float, link.seconds)
  start = time.perf_counter()
  while waiting or live:
    while waiting and len(live) < caps.max_requests:
      i = waiting.popleft()
      link.add(i, encoded[i], request_seed(seed, i))
      live.append(i)
    done = link.round(live, depth)
    rounds += 1
    for c in done:
      new[c.rid].extend(c.tokens)
      accepted.append(c.accepted)
    if on_round is not None:
      on_round(done)
    for i in [i for i in live if _finished(new[i], max_new_tokens, eos)]:
      live.remove(i)
      link.remove(i)
  wall = time.perf_counter() - start - (link.seconds["observe"]
                                        - before["observe"])
  seconds = {k: link.seconds[k] - before[k] for k in PARTS}
  seconds["host"] += wall - sum(seconds.values())
  seconds["wall"] = wall
  return Result([_trim(new[i], max_new_tokens, eos)
                 for i in range(len(encoded))], rounds,
                np.asarray(accepted, np.int32), seconds)


def target_only(target: models.TargetModel,
                prompts: typing.Sequence[typing.Any], *,
                max_new_tokens: int, eos: int | None = None,
                seed: int = 0, tokenizer: typing.Any = None,
                sample_fn: engine_lib.SampleFn
                = verification.sample_target) -> Result:
  """The baseline: each new token from one target call on its handle,
  drawn by the target-only sampler (TARGET_ONLY key of the position)."""
  encoded = _encode(prompts, tokenizer)
  seconds: collections.defaultdict[str, float] = (
        collections.defaultdict(float))
  clock = _Clock(seconds)
  out, calls = [], 0
  start = time.perf_counter()
  empty = np.zeros(0, np.int32)
  for i, prompt in enumerate(encoded):
    state, tokens = target.init_state(), list(prompt)
    rseed = request_seed(seed, i)
    new: list[int] = []
    while not _finished(new, max_new_tokens, eos):
      with clock("target"):
        rows, state = _block(target.logits(
            state, np.asarray(tokens, np.int32), empty))
      calls += 1
      with clock("verify"):
        key = engine_lib.fallback_keys([rseed], [0], [len(new) + 1],
                                       [len(tokens)])[0]
        token, status = sample_fn(rows[0], key)
        raise_for_status("sample_fn", np.asarray(status))
      tokens.append(int(token))
      new.append(int(token))
    out.append(_trim(new, max_new_tokens, eos))
  wall = time.perf_counter() - start
  split = {k: seconds[k] for k in PARTS}
  split["host"] += wall - sum(split.values())
  split["wall"] = wall
  return Result(out, calls, np.zeros(0, np.int32), split)
