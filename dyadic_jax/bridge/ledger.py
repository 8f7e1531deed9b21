"""The verifier's requests' committed state: the source of truth of a run.

A `Ledger` holds each request's committed tokens, seed, digest and tags
(generation, round), which exchange in flight owns it, and the next
generation of each removed id; it hands out each round's tags, classifies
an answer's tag against them and applies a round's outcome. The session
(`verifier_session.VerifierSession`) keeps HELLO, frame authentication
and routing, and counts; the ledger never counts and never encodes a
frame. A (request, generation, round) tag only ever grows: a removed id
that comes back continues after its last generation, and a fallback or a
reset moves a request to a new generation (round 0), so no key of a
failed exchange can be drawn again.

No socket, clock or JAX here (tests/test_layers.py).
"""

import dataclasses
import typing

from dyadic_jax.bridge import digest as digest_lib
from dyadic_jax.bridge.exchange import Exchange
from dyadic_jax.wire.layouts import ALL_REQUESTS
from dyadic_jax.wire.refusals import Code

__all__ = ["Ledger", "Request", "RoundResult"]

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


@dataclasses.dataclass
class Request:
  """One request's committed state on the verifier (the source of truth)."""
  rid: int
  seed: int
  tokens: list[int]            # committed tokens, prompt first
  generation: int = 0
  round: int = 0
  context_version: int = 0
  digest: bytes = b""
  # (session, generation) whose first round carried a CONTEXT (or found
  # the prefix too long for one): the worker may hold the prefix.
  context_sent: tuple[int, int] | None = None

  @property
  def anchor(self) -> int:
    return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What one round committed for one request."""
  rid: int
  generation: int
  round: int
  anchor: int
  committed: tuple[int, ...]   # tokens appended to the request, in order
  accepted: int                # drafted tokens among them
  fallback: bool               # True: proposal discarded, target-only token
  code: Code | None            # why it was discarded


class Ledger:
  """Every live request's committed state, and which exchange owns it."""

  def __init__(self, vocab: int) -> None:
    self.vocab = vocab
    self.requests: dict[int, Request] = {}
    self.retired: dict[int, int] = {}     # removed rid -> next generation
    self.owner: dict[int, Exchange] = {}  # rid -> its exchange in flight

  def add(self, rid: int, prompt: typing.Sequence[int], seed: int) -> None:
    if rid in self.requests or not 0 <= rid < ALL_REQUESTS:
      raise ValueError(f"add_request: bad or duplicate request id {rid}")
    prompt = [int(t) for t in prompt]
    if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab:
      raise ValueError("add_request: prompt needs tokens in [0, V)")
    if not 0 <= int(seed) <= _U64:
      raise ValueError(f"add_request: seed {seed} is not a uint64")
    generation = self.retired.pop(rid, 0)
    self.requests[rid] = Request(rid, int(seed), prompt,
                                 generation=generation,
                                 digest=digest_lib.of(prompt))

  def remove(self, rid: int) -> None:
    req = self.requests.pop(rid)
    self.retired[rid] = req.generation + 1

  def generation(self, rid: int) -> int:
    """`rid`'s generation, live or retired (what a RESET is tagged with)."""
    req = self.requests.get(rid)
    return req.generation if req is not None else self.retired.get(rid, 0)

  def bump(self, req: Request) -> None:
    """A new generation, no round of it yet."""
    if req.generation >= _U32:
      raise RuntimeError(f"request {req.rid}: generations exhausted")
    req.generation, req.round = req.generation + 1, 0

  def bump_all(self, rids: typing.Iterable[int] | None = None) -> None:
    for rid in list(self.requests) if rids is None else rids:
      self.bump(self.requests[rid])

  def advance(self, rids: typing.Sequence[int]) -> list[Request]:
    """The requests of a new round, each moved to its next round (a new
    generation where the rounds are exhausted)."""
    reqs = [self.requests[r] for r in rids]
    for req in reqs:
      if req.round >= _U32:
        self.bump(req)
      req.round += 1
    return reqs

  def own(self, ex: Exchange) -> None:
    self.owner.update((r, ex) for r in ex.rids)

  def release(self, ex: Exchange) -> None:
    for rid in ex.rids:
      del self.owner[rid]

  # -- tags ------------------------------------------------------------------

  def classify(self, rid: int, tag: tuple[int, int]) -> Code | None:
    """None if `tag` is the tag of `rid` in its exchange in flight, else
    the refusal."""
    ex = self.owner.get(rid)
    want = None if ex is None else ex.tags.get(rid)
    if want is None:      # a request of no exchange in flight: late if older
      req = self.requests.get(rid)
      if req is None:
        return (Code.STALE_GENERATION if rid in self.retired
                else Code.BAD_SEQUENCE)
      want = (req.generation, req.round + 1)
      if tag >= want:
        return Code.BAD_SEQUENCE
    elif tag > want:
      return Code.BAD_SEQUENCE
    if tag[0] < want[0]:
      return Code.STALE_GENERATION
    return None if tag == want else Code.DUPLICATE_ROUND

  def late(self, tag: tuple[int, int]) -> Code | None:
    """STALE_GENERATION / DUPLICATE_ROUND if `tag` is no request's current
    tag but an older one of some request in flight; else None."""
    if not self.owner:
      return None
    codes = [self.classify(rid, tag) for rid in self.owner]
    if None in codes:
      return None
    older = [c for c in codes if c != Code.BAD_SEQUENCE]
    return older[0] if older else None

  # -- commits ---------------------------------------------------------------

  def commit(self, rid: int, tag: tuple[int, int], code: int,
             accepted: int, drafted: typing.Sequence[int],
             token: int) -> RoundResult:
    """Applies one plan row: `accepted` of `drafted` and `token` (0 of
    them where `code` discards the proposal: a new generation)."""
    req = self.requests[rid]
    req.generation, req.round = tag          # a follower mirrors them
    accepted = 0 if code else int(accepted)
    committed = tuple(drafted[:accepted]) + (int(token),)
    anchor = req.anchor
    req.tokens.extend(committed)
    req.digest = digest_lib.extend(req.digest, committed)
    if code:
      self.bump(req)
    return RoundResult(rid, tag[0], tag[1], anchor, committed, accepted,
                       bool(code), Code(code) if code else None)
