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

Both check every argument before the first round (a TypeError or
ValueError naming it and its range), the context included: a target with
a `max_len` (the transformer pair's) must hold each prompt, its new
tokens and a round's drafts. A call that ends early leaves its link
usable (its requests are removed).

Every round's cost is split into what the bridge's two hosts spend:
the draft's steps, the target's verify pass, verification, and the rest
(host bookkeeping; over the bridge, the exchange).
"""

import collections
import functools
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax import admission as admission_lib
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

  @property
  def in_flight(self) -> int:
    """How many rounds (`start`ed, not yet `finish`ed) may be in flight."""
    ...

  def start(self, rids: typing.Sequence[int], depth: int) -> typing.Any:
    """Begins a round of `rids` (no request of another round in flight);
    returns its handle for `finish`."""
    ...

  def finish(self, handle: typing.Any) -> list[Committed]:
    """Completes a round `start` began (in the order they began)."""
    ...

  def abandon(self) -> None:
    """Forgets the rounds in flight (a call that ends early)."""
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
               observe: typing.Callable[..., None] | None = None,
               admission: admission_lib.AdaptiveDepth | None = None
               ) -> None:
    """observe: called after each round with (rids, proposals, target rows,
    outcomes (accepted, token)): what a benchmark screens (untimed).
    admission: None (fixed depth), or an `AdaptiveDepth` the proposer
    drafts under (`draft_proposer`): a round's chains then hold 1..depth
    rows each, verified per length (`Engine.verify`'s `lengths`)."""
    if draft.vocab != caps.vocab or target.vocab != caps.vocab:
      raise ValueError(f"Local: draft V {draft.vocab}, target V "
                       f"{target.vocab} and session V {caps.vocab} differ")
    self.caps = caps
    self.propose = proposer_lib.draft_proposer(draft, caps,
                                               executor=executor,
                                               admission=admission)
    self.engine = engine_lib.Engine(caps, target, verify_fn=verify_fn)
    self.observe = observe
    self.requests: dict[int, _Request] = {}
    self.seconds: collections.defaultdict[str, float] = (
        collections.defaultdict(float))
    self._clock = _Clock(self.seconds)

  @property
  def max_len(self) -> int | None:
    """The target's context (None: it declares none)."""
    return getattr(self.engine.target, "max_len", None)

  def add(self, rid: int, prompt: typing.Sequence[int], seed: int) -> None:
    if rid in self.requests or not len(prompt):
      raise ValueError(f"Local.add: duplicate request {rid} or no prompt")
    self.requests[rid] = _Request(prompt, seed)

  def remove(self, rid: int) -> None:
    self.requests.pop(rid)
    self.engine.drop(rid)
    self.propose.forget(rid)

  # One process does both sides in turn: a round starts when it is
  # finished.
  in_flight = 1

  def start(self, rids: typing.Sequence[int], depth: int
            ) -> tuple[list[int], int]:
    return [int(r) for r in rids], depth

  def finish(self, handle: tuple[list[int], int]) -> list[Committed]:
    return self.round(*handle)

  def abandon(self) -> None:
    pass

  def round(self, rids: typing.Sequence[int], depth: int
            ) -> list[Committed]:
    clock = self._clock
    reqs = [self.requests[r] for r in rids]
    for req in reqs:
      req.round += 1
    with clock("draft"):
      proposals = self.propose.many(
          [proposer_lib.Call(req.seed, 0, req.round, len(req.tokens),
                             req.tokens[-1], rid,
                             np.asarray(req.tokens, np.int32))
           for rid, req in zip(rids, reqs)], depth)
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
    """The engine's verification of the drawn rows (a refusal raises);
    adaptive chains of several lengths are padded to the longest and
    verified per length by the engine, as a bridged verifier's are."""
    lengths = np.asarray([len(p.tokens) for p in proposals])
    depth = int(lengths.max())

    def stack(part: str, dtype: typing.Any) -> typing.Any:
      """The proposals' `part` [R, depth, ...] (zeros past a chain's
      length), or None where they carry none."""
      if getattr(proposals[0], part) is None:
        return None
      first = np.asarray(getattr(proposals[0], part))
      out = np.zeros((len(proposals), depth) + first.shape[1:], dtype)
      for i, p in enumerate(proposals):
        out[i, :lengths[i]] = np.asarray(getattr(p, part))
      return out

    rows = qformats.Rows(stack("tokens", np.int32), stack("n", np.int32),
                         stack("ids", np.int32))
    counts = None
    values = stack("values", np.float64)
    if values is not None:
      # The drawn q rows are exact multiples of 1 / M: their counts.
      counts = np.rint(values * M).astype(np.int32)
    got = self.engine.verify(chains, logits, rows, counts, lengths=lengths)
    raise_for_status("verify_fn", got.status)
    return [(int(a), int(t)) for a, t in zip(got.accepted, got.token)]


class Bridged:
  """Rounds through a `bridge.Verifier` connected to a worker."""

  def __init__(self, verifier: "verifier_lib.Verifier") -> None:
    self.verifier = verifier
    self.caps = verifier.caps
    self.seconds: collections.defaultdict[str, float] = (
        collections.defaultdict(float))

  @property
  def max_len(self) -> int | None:
    """The verifier's target's context (None: it declares none)."""
    return getattr(self.verifier.engine.target, "max_len", None)

  def add(self, rid: int, prompt: typing.Sequence[int], seed: int) -> None:
    self.verifier.add_request(rid, prompt, seed)

  def remove(self, rid: int) -> None:
    self.verifier.remove_request(rid)

  @property
  def in_flight(self) -> int:
    """The verifier's (`Verifier.in_flight`: the session's `max_slots`):
    the worker drafts one round's requests while this side verifies
    another's."""
    return self.verifier.in_flight

  def round(self, rids: typing.Sequence[int], depth: int
            ) -> list[Committed]:
    return self.finish(self.start(rids, depth))

  def start(self, rids: typing.Sequence[int], depth: int
            ) -> "verifier_lib.InFlight":
    begun = time.perf_counter()
    flight = self.verifier.start(rids, depth)
    self.seconds["exchange"] += time.perf_counter() - begun
    return flight

  def finish(self, handle: "verifier_lib.InFlight") -> list[Committed]:
    begun = time.perf_counter()
    results = self.verifier.finish(handle)
    self.seconds["exchange"] += time.perf_counter() - begun
    return [Committed(r.rid, r.committed, r.accepted) for r in results]

  def abandon(self) -> None:
    self.verifier.abandon()


def _check_int(caller: str, name: str, value: typing.Any, lo: int,
               hi: int | None = None) -> int:
  """`value` as an int in [lo, hi] (hi None: no upper bound), else a
  TypeError or ValueError naming `name` and the range."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{caller}: {name} must be an int, got "
                    f"{type(value).__name__} {value!r}")
  value = int(value)
  if value < lo or (hi is not None and value > hi):
    bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise ValueError(f"{caller}: {name} must be {'in ' * (hi is not None)}"
                     f"{bound}, got {value}")
  return value


def _encode(caller: str, prompts: typing.Any, tokenizer: typing.Any,
            vocab: int) -> list[list[int]]:
  """Each prompt's token ids, checked: a non-empty list of non-empty
  prompts (texts with `tokenizer`, or sequences of ids in [0, vocab))."""
  if isinstance(prompts, (str, bytes)):
    # Iterating a text would make one request per character.
    raise TypeError(f"{caller}: prompts is a list of prompts, got one "
                    f"{type(prompts).__name__}: pass [{prompts[:24]!r}]")
  try:
    items = list(prompts)
  except TypeError:
    raise TypeError(f"{caller}: prompts must be a list of prompts, got "
                    f"{type(prompts).__name__}") from None
  if not items:
    raise ValueError(f"{caller}: prompts is empty: nothing to generate")
  out = []
  for i, p in enumerate(items):
    if isinstance(p, str):
      if tokenizer is None:
        raise ValueError(f"{caller}: prompts[{i}] is a text: it needs "
                         "tokenizer=")
      p = tokenizer.encode(p)
    ids = np.asarray(p)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
      raise TypeError(f"{caller}: prompts[{i}] must be a text or a "
                      f"sequence of token ids, got {type(p).__name__} "
                      f"{str(p)[:40]}")
    if not ids.size:
      raise ValueError(f"{caller}: prompts[{i}] is empty (a request starts "
                       "from at least one token)")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
      raise ValueError(f"{caller}: prompts[{i}] holds token "
                       f"{low if low < 0 else high}, outside [0, {vocab})")
    out.append([int(t) for t in ids])
  return out


def _check_context(caller: str, max_len: int | None,
                   encoded: list[list[int]], max_new_tokens: int,
                   depth: int) -> None:
  """Refuses up front a request that would outgrow the target's context.

  A request's last round starts with at most max_new_tokens - 1 new tokens
  and adds `depth` drafted ones (0 for target_only): the target scores
  prompt + max_new_tokens - 1 + depth tokens at most.
  """
  if max_len is None:
    return
  longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
  need = len(encoded[longest]) + max_new_tokens - 1 + depth
  if need > max_len:
    prompt = len(encoded[longest])
    room = max_len - prompt - depth + 1
    if room >= 1:
      fits = f"max_new_tokens <= {room} fits"
    elif prompt > max_len:
      fits = "the prompt alone does not fit"
    else:   # the prompt fits, its drafted tokens do not
      fits = (f"the prompt fits, but its rounds' {depth} drafted tokens do "
              f"not: depth <= {max_len - prompt} with max_new_tokens=1, or "
              f"a prompt of at most {max_len - depth} tokens")
    raise ValueError(
        f"{caller}: prompts[{longest}] ({prompt} tokens) + "
        f"max_new_tokens {max_new_tokens} - 1"
        + (f" + depth {depth}" if depth else "")
        + f" = {need} tokens exceed the target's context, max_len "
        f"{max_len} ({fits})")


def _common(caller: str, prompts: typing.Any, tokenizer: typing.Any,
            vocab: int, max_new_tokens: typing.Any, eos: typing.Any,
            seed: typing.Any) -> list[list[int]]:
  """The checks `generate` and `target_only` share; the encoded prompts."""
  _check_int(caller, "max_new_tokens", max_new_tokens, 1)
  if eos is not None:
    _check_int(caller, "eos", eos, 0, vocab - 1)
  # request_seed keeps 64 bits: a wider seed would alias a smaller one.
  _check_int(caller, "seed", seed, 0, _U64)
  # A str has an encode too (to bytes): a tokenizer's name is no tokenizer.
  if tokenizer is not None and (isinstance(tokenizer, (str, bytes)) or
                                not callable(getattr(tokenizer, "encode",
                                                     None))):
    raise TypeError(f"{caller}: tokenizer must be an object with "
                    "encode(text) -> ids (e.g. a loaded pair's .tokenizer), "
                    f"got {type(tokenizer).__name__} {tokenizer!r:.40}")
  return _encode(caller, prompts, tokenizer, vocab)


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
             | None = None, in_flight: int | None = None) -> Result:
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
    in_flight: rounds in flight at once, in [1, link.in_flight] (default
      link.in_flight: 2 over the bridge where the session allows it, so
      the worker drafts one group while the verifier verifies the other;
      1 for `Local`).

  Requests run in `in_flight` groups of at most `caps.max_requests` each
  (waiting prompts spread over them); one that is done leaves its group
  at once and the next prompt takes its place. Which group a request is
  in changes no token it commits: its keys are its own. A call
  that ends early (an exception, a KeyboardInterrupt) removes its requests
  from the link, so the link serves the next call.

  Raises:
    TypeError: prompts is one text or holds something that is no prompt;
      an argument that must be an int is not; tokenizer has no encode;
      on_round is not callable.
    ValueError: no prompts, an empty prompt or a token outside [0, V);
      max_new_tokens < 1; depth outside [1, caps.max_depth]; eos outside
      [0, V); seed outside [0, 2^64); a prompt + max_new_tokens - 1 +
      depth longer than the target's context (its `max_len`, where the
      target has one), found before any round.
  """
  caps = link.caps
  if on_round is not None and not callable(on_round):
    raise TypeError("generate: on_round must be a function of a round's "
                    f"Committed list, got {type(on_round).__name__} "
                    f"{on_round!r:.40}")
  if depth is not None:
    depth = _check_int("generate", "depth", depth, 1, caps.max_depth)
  depth = caps.max_depth if depth is None else depth
  encoded = _common("generate", prompts, tokenizer, caps.vocab,
                    max_new_tokens, eos, seed)
  _check_context("generate", getattr(link, "max_len", None), encoded,
                 max_new_tokens, depth)
  new: dict[int, list[int]] = {i: [] for i in range(len(encoded))}
  waiting = collections.deque(range(len(encoded)))
  slots = _check_int("generate", "in_flight", link.in_flight
                     if in_flight is None else in_flight, 1, link.in_flight)
  # One group of requests per round in flight; a group's next round
  # starts as soon as its last one is finished, before the other
  # groups' are, so the worker drafts one while this side verifies another.
  groups: list[list[int]] = [[] for _ in range(slots)]
  flying: collections.deque[tuple[int, typing.Any]] = collections.deque()
  accepted: list[int] = []
  rounds = 0
  before = collections.defaultdict(float, link.seconds)
  start = time.perf_counter()
  try:
    while True:
      busy = {g for g, _ in flying}
      for g, live in enumerate(groups):
        if g in busy:
          continue
        # Waiting prompts are spread over the groups (a group holds at
        # most max_requests, and no more than its share).
        share = -(-(len(waiting) + sum(map(len, groups))) // slots)
        while waiting and len(live) < min(caps.max_requests, share):
          i = waiting.popleft()
          link.add(i, encoded[i], request_seed(seed, i))
          live.append(i)
        if live:
          flying.append((g, link.start(live, depth)))
      if not flying:
        break
      g, handle = flying.popleft()
      done = link.finish(handle)
      rounds += 1
      for c in done:
        new[c.rid].extend(c.tokens)
        accepted.append(c.accepted)
      if on_round is not None:
        on_round(done)
      live = groups[g]
      for i in [i for i in live if _finished(new[i], max_new_tokens, eos)]:
        live.remove(i)
        link.remove(i)
  except BaseException:
    # Interrupted: forget this call's requests, or the link would refuse
    # the next call's (same ids) as duplicates. The original error wins.
    try:
      link.abandon()
    except Exception:  # pylint: disable=broad-except
      pass
    for i in [i for live in groups for i in live]:
      try:
        link.remove(i)
      except Exception:  # pylint: disable=broad-except
        pass
    raise
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
                = verification.sample_target, batch: int = 1,
                chunk: int = 16) -> Result:
  """The baseline: each new token from the target alone, drawn by the
  target-only sampler with the TARGET_ONLY key of its position.

  A target that offers `batch(capacity)` (a `models.TargetBatch`, the
  transformer pair's slab) decodes `batch` requests at once, `chunk`
  tokens per call, the draw fused into the call (`TargetBatch.decode`;
  `sample_fn` is traced there); a request that ends (eos, max_new_tokens)
  leaves its batch at the end of the chunk and the next prompt takes its
  place. A request runs its own steps in a chunk, at most the tokens it
  still needs (so never past the target's context, whatever the others
  in its chunk need); tokens drawn past its eos are discarded: every kept
  token is the one its position's key draws from its row. Any other
  target makes one `logits` call per token and request (batch and chunk
  unused).

  Arguments and errors as `generate`'s (no depth: the context bound is
  prompt + max_new_tokens - 1); batch and chunk must be >= 1 (a batch
  wider than the prompts holds as many requests as there are prompts).
  """
  encoded = _common("target_only", prompts, tokenizer, target.vocab,
                    max_new_tokens, eos, seed)
  # A batch is never wider than the prompts: its cache is allocated whole.
  batch = min(_check_int("target_only", "batch", batch, 1), len(encoded))
  chunk = _check_int("target_only", "chunk", chunk, 1)
  _check_context("target_only", getattr(target, "max_len", None), encoded,
                 max_new_tokens, 0)
  seconds: collections.defaultdict[str, float] = (
        collections.defaultdict(float))
  start = time.perf_counter()
  if hasattr(target, "batch"):
    out, calls = _decode_batched(target.batch(batch), encoded,
                                 max_new_tokens, eos, seed, sample_fn,
                                 chunk, _Clock(seconds))
  else:
    out, calls = _decode_each(target, encoded, max_new_tokens, eos, seed,
                              sample_fn, _Clock(seconds))
  wall = time.perf_counter() - start
  split = {k: seconds[k] for k in PARTS}
  split["host"] += wall - sum(split.values())
  split["wall"] = wall
  return Result(out, calls, np.zeros(0, np.int32), split)


def _decode_each(target: models.TargetModel, encoded: list[list[int]],
                 max_new_tokens: int, eos: int | None, seed: int,
                 sample_fn: engine_lib.SampleFn, clock: _Clock
                 ) -> tuple[list[np.ndarray], int]:
  """`target_only` one request and one token per call."""
  out, calls = [], 0
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
  return out, calls


@functools.lru_cache(maxsize=None)
def _fused_draw(sample_fn: engine_lib.SampleFn) -> models.Sampler:
  """A `models.Sampler` drawing what `_decode_each` draws (one object per
  sample_fn: the decode's jit is keyed on it)."""

  def draw(logits: jax.Array, step: jax.Array, aux: typing.Any
           ) -> tuple[jax.Array, jax.Array]:
    seeds, rounds, anchors = aux
    keys = engine_lib.fallback_keys_traced(
        seeds, jnp.zeros_like(rounds), rounds + step.astype(rounds.dtype),
        anchors + step.astype(anchors.dtype))
    return sample_fn(logits, keys)

  return draw


def _decode_batched(batch: models.TargetBatch, encoded: list[list[int]],
                    max_new_tokens: int, eos: int | None, seed: int,
                    sample_fn: engine_lib.SampleFn, chunk: int,
                    clock: _Clock) -> tuple[list[np.ndarray], int]:
  """`target_only` through a `TargetBatch`: chunks of fused steps."""
  capacity = batch.capacity if hasattr(batch, "capacity") else 1
  new: dict[int, list[int]] = {i: [] for i in range(len(encoded))}
  waiting = collections.deque(range(len(encoded)))
  live: list[int] = []
  calls = 0
  draw = _fused_draw(sample_fn)
  while waiting or live:
    while waiting and len(live) < capacity:
      live.append(waiting.popleft())
    # Each request runs its own steps, never past its end: one far along
    # stops at its own edge of the context while a newcomer runs on
    # (within max_len by _check_context).
    own = [min(chunk, max_new_tokens - len(new[i])) for i in live]
    steps = max(own)
    prefixes = [np.asarray(encoded[i] + new[i], np.int32) for i in live]
    aux = (engine_lib.seed_view([request_seed(seed, i) for i in live]),
           np.asarray([len(new[i]) + 1 for i in live], np.uint32),
           np.asarray([len(p) for p in prefixes], np.int64))
    with clock("target"), jax.enable_x64(True):
      drawn, codes = batch.decode(live, prefixes, own, draw, aux)
      tokens, status = np.asarray(drawn), np.asarray(codes)
    calls += steps
    for b, i in enumerate(live):
      if eos is not None and eos in new[i]:
        continue
      raise_for_status("sample_fn", status[b, :own[b]])
      new[i].extend(int(t) for t in tokens[b, :own[b]])
    for i in [i for i in live if _finished(new[i], max_new_tokens, eos)]:
      live.remove(i)
      batch.drop(i)
  return [_trim(new[i], max_new_tokens, eos)
          for i in range(len(encoded))], calls
