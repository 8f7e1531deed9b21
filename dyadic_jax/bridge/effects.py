"""The typed records the protocol sessions hand to their drivers.

The sessions (`worker_session.WorkerSession`,
`verifier_session.VerifierSession`) never touch a socket, a thread, a
clock or JAX: they take messages (and the time, as an argument) and return
these records; a driver performs them and reports back.

    Send     bytes to put on the transport as one message
    Propose  the worker must draw one request's proposal into `rows`
    Stage    the verifier must validate (and audit) the staged rows
    Verify   the verifier must run a round's `Plan` (verify or fall back)

One round's data keeps one shape from the staging slot to `QFormat.to_q`:
`qformats.Rows` (tokens, n, ids, values), staged in a `Stage`, copied into
the `Plan` (its `rows`, without the float q) next to the validated
`counts`, a JAX array (`Counts`).
"""

import typing

import numpy as np

from dyadic_jax.wire import qformats

# Validated q of a batch: int32[R, D, w], a JAX array (one device's, or split
# over a vocabulary mesh) or a host one (a host validator's); None where a
# round has none (a fallback, greedy).
Counts = typing.Optional[qformats.Counts]
# One message's bytes: a frame built here, or a view of a worker slot.
Message = bytes | bytearray | memoryview


class Send(typing.NamedTuple):
  """One message to send. slot: the worker slot buffer it lives in (the
  driver calls `WorkerSession.released(slot)` once the transport let go of
  it), or None."""
  message: Message
  slot: int | None = None


class Propose(typing.NamedTuple):
  """Draw request `request`'s proposal with the PROPOSAL keys of (seed,
  generation, round, anchor + i) into `rows` (writable views of the REPLY
  frame: tokens, n and the q rows), then call `WorkerSession.finish`.
  entry: its place in the answer (the key of `finish`'s `failed`).
  context: the request's committed prefix, int32[anchor] (prompt first,
  its last token `last_token`; read only), on a session that agreed on
  CONTEXT frames when the worker holds it; else None. adaptive: the
  session agreed on ADAPTIVE_DEPTH: the driver may draw d in [1, depth]
  rows under its stopping rule, written to rows[:d], and tells `finish`
  d (its `lengths`); else exactly `depth`."""
  entry: int
  request: int
  seed: int
  generation: int
  round: int
  anchor: int
  last_token: int
  depth: int
  rows: qformats.Rows
  context: np.ndarray | None = None
  adaptive: bool = False

  @property
  def call(self) -> "Call":
    """Its draw coordinates, as a batched draw takes them (context: the
    committed prefix, or None when the worker holds none)."""
    return Call(self.seed, self.generation, self.round, self.anchor,
                self.last_token, self.request,
                typing.cast(np.ndarray, self.context))


class Call(typing.NamedTuple):
  """One request's draw coordinates (seed, generation, round, anchor, last
  token: its PROPOSAL keys) and its context: its part of a batched draw
  (`drafting.DraftProposer.many`; a STEP message's `Propose.call`s)."""
  seed: int
  generation: int
  round: int
  anchor: int
  last_token: int
  request: int
  context: np.ndarray      # int32[anchor], ending in last_token


class Plan(typing.NamedTuple):
  """What every verifier rank does in one round (fixed shapes, R requests).

  The leader builds it after validation; a multi-rank verifier broadcasts
  it (`bridge.ranks`), so all ranks run exactly the same verification or
  fallback calls (the verdict travels with q: no rank can commit while
  another falls back). codes[r] is 0 for a request whose q validated, else
  the `Code` that discarded its proposal; only the rows of requests whose
  code is 0 are meaningful (the others are never read).

  rows: the staged rows of those requests, copied out of the slot (tokens
  int32[R, D] drafted, n int32[R, D] live entries, ids int32[R, D, k] for
  sparse q, else None; values None: q travels as `counts`). lengths[r]:
  request r's drafted rows d in [1, D] (D but on a session that agreed on
  ADAPTIVE_DEPTH): only rows[r, :d] and counts[r, :d] are its chain, the
  correction or bonus row the target's row d. key: the session's number
  of the round (`Exchange.key`, `Verify.key`; fallback rounds are
  numbered too): the one name of a round from its begin to every rank.
  """
  rids: np.ndarray       # int32[R]
  tags: np.ndarray       # int64[R, 2]  (generation, round)
  codes: np.ndarray      # int32[R]
  rows: qformats.Rows    # [R, D, ...], values None
  counts: Counts         # int32[R, D, w] validated q, or None
  stop: np.ndarray       # int32[]: 1 tells follower ranks to return
  lengths: np.ndarray    # int32[R] rows of each request's chain (<= D)
  key: int = 0           # the round's number in its session


class Stage(typing.NamedTuple):
  """Validate the staged rows of an exchange, then call
  `VerifierSession.staged(verdict, key)`.

  rows: the staging slot's Rows [R, D, ...] (tokens, n, ids, values);
  pending: bool[R], the requests whose rows arrived framed correctly (the
  others already failed, with `codes`); draws: uint32[R, D] PROPOSAL draws
  of the sampling audit, or None (audit off, or a greedy session); key:
  the exchange's (`Exchange.key`: which of those in flight).
  """
  rows: qformats.Rows
  pending: np.ndarray
  codes: np.ndarray
  draws: np.ndarray | None = None
  key: int = 0


class Verify(typing.NamedTuple):
  """Run `plan` on every rank, then call `VerifierSession.commit`. key:
  the round it ends (`Exchange.key`; a round without an exchange has its
  own, `VerifierSession.fallback`)."""
  plan: Plan
  key: int = 0
