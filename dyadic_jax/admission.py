"""Admission: which draft positions get drafted and verified.

Depth is fixed before any draw by default. An adaptive policy may only be a
sequential stopping rule: before x_i is drawn it decides from what already
exists (committed history, measured load, x_1..x_{i-1}, the draft's rows
for positions before i and optionally i itself, estimates from earlier
rounds) whether position i is
admitted; once it stops, it never reopens. `draft_chain` enforces this by
construction: the rule is asked about position i while x_i does not exist
yet, and `AdmissionContext` has no field that could carry it. The draft's
row for position i is a function of the committed history and x_1..x_{i-1}
only (it is the distribution x_i is about to be drawn from), so statistics
of it (`RowStats`) are eligible inputs.

`AdaptiveDepth` is such a rule (off by default: sessions use `FixedDepth`):
it admits position i while the expected number of extra tokens it brings,
estimated from the rows' statistics and per-position acceptance counts of
earlier rounds (`AcceptanceHistory`), pays for one more draft step at the
rate the recorded rounds achieved (docs/numerics.md section 7 has the
proof that the output distribution stays the target's, and
docs/benchmarks.md what it buys on the trained pair).

Why it matters: admitting x_1 only when it is 0 (q = p uniform on {0, 1},
target-only otherwise) outputs 0 with probability 3/4, not 1/2; no verifier
can undo a selection made after looking at the draw (docs/numerics.md
section 7, docs/architecture.md).
"""

import dataclasses
import math
import typing

import numpy as np

# Bins of a row's top probability in `AcceptanceHistory`.
DEFAULT_BINS = 8


class RowStats(typing.NamedTuple):
  """Statistics of the draft's row for one position (before its draw)."""
  top: float        # max_v q(v) of the row, in [0, 1]
  entropy: float    # -sum_v q(v) log q(v), nats


def row_stats(probs: typing.Any) -> RowStats:
  """`RowStats` of a probability row float[V] (any nonnegative row; it is
  normalized here). Raises ValueError on a row with no positive mass or a
  non-finite entry."""
  p = np.asarray(probs, np.float64)
  total = float(p.sum()) if p.size else 0.0
  if not np.all(np.isfinite(p)) or np.any(p < 0) or not total > 0:
    raise ValueError("row_stats: the row needs finite nonnegative entries "
                     "with positive mass")
  p = p / total
  live = p[p > 0]
  return RowStats(float(p.max()), float(-(live * np.log(live)).sum()))


class AcceptanceHistory(typing.NamedTuple):
  """Per-position acceptance counts of earlier rounds (optax-style state).

  Position i of a round is *reached* when x_1..x_{i-1} were all accepted;
  counts are kept per position and per bin of the row's top probability.
  Only rounds that were verified before the current one was drafted may be
  in it: it never holds anything of the round being drafted.
  """
  reached: np.ndarray    # float64[D, B] reached positions
  accepted: np.ndarray   # float64[D, B] of which accepted
  tokens: float          # tokens committed by the recorded rounds
  cost: float            # their cost, in target passes (see `record_round`)


def acceptance_history(max_depth: int,
                       bins: int = DEFAULT_BINS) -> AcceptanceHistory:
  """An empty `AcceptanceHistory` for chains of up to `max_depth`."""
  if max_depth < 1 or bins < 1:
    raise ValueError(f"acceptance_history: max_depth {max_depth} and bins "
                     f"{bins} must be >= 1")
  zeros = np.zeros((max_depth, bins))
  return AcceptanceHistory(zeros, zeros.copy(), 0.0, 0.0)


def _bin(history: AcceptanceHistory, top: float) -> int:
  bins = history.reached.shape[1]
  return min(max(int(top * bins), 0), bins - 1)


def draft_steps(admitted: int, max_depth: int, lookahead: bool) -> int:
  """Draft steps a sequential round computes: one row per admitted
  position, and with `lookahead` the row a stop was decided on too (none
  after max_depth)."""
  return min(admitted + 1, max_depth) if lookahead else admitted


def feature(rows: typing.Sequence[RowStats], position: int,
            lookahead: bool) -> float:
  """What position i's acceptance is binned by: the top probability of
  its own row (`lookahead`), else of the row before it (1.0 at position
  0: no row yet; its estimate is then the position's frequency)."""
  if lookahead:
    return rows[position].top
  return rows[position - 1].top if position else 1.0


def record_round(history: AcceptanceHistory,
                 rows: typing.Sequence[RowStats], accepted: int,
                 step_cost: float, lookahead: bool) -> AcceptanceHistory:
  """`history` with one verified round added.

  Args:
    rows: the `RowStats` of the admitted positions, in order (d of them).
    accepted: drafted tokens the verifier accepted, in [0, d].
    step_cost: one draft step's cost relative to one target pass; the
      round's cost is 1 + step_cost * `draft_steps(d, D, lookahead)`.
    lookahead: how the rounds were drafted (`AdaptiveDepth.lookahead`):
      decides the bins (`feature`) and the steps.

  Returns:
    a new history (the arrays are copied): positions 0..min(accepted, d-1)
    reached, 0..accepted-1 accepted; one committed token more than
    accepted.
  """
  d = len(rows)
  if not 0 <= accepted <= d <= history.reached.shape[0]:
    raise ValueError(f"record_round: accepted {accepted} of {d} rows, "
                     f"max depth {history.reached.shape[0]}")
  reached, acc = history.reached.copy(), history.accepted.copy()
  for i in range(min(accepted + 1, d)):
    b = _bin(history, feature(rows, i, lookahead))
    reached[i, b] += 1
    acc[i, b] += i < accepted
  cost = 1.0 + step_cost * draft_steps(d, history.reached.shape[0],
                                       lookahead)
  return AcceptanceHistory(reached, acc, history.tokens + accepted + 1,
                           history.cost + cost)


def estimate(history: AcceptanceHistory, position: int, top: float,
             prior_weight: float = 16.0) -> float:
  """Estimated P(x_i accepted | position i reached, its `feature` top).

  The counts of (position, top-probability bin), shrunk toward the bin's
  counts over all positions, shrunk toward all counts, shrunk toward `top`
  itself (before any round: a draft that is right about its mode is
  accepted about that often); each prior weighs `prior_weight`
  observations. The middle level matters: a bin the rule stopped on is
  rarely reached again, and its estimate must follow the pair's overall
  acceptance rather than stay at the cold-start guess.
  """
  b = _bin(history, top)
  overall = ((history.accepted.sum() + prior_weight * top)
             / (history.reached.sum() + prior_weight))
  pooled = ((history.accepted[:, b].sum() + prior_weight * overall)
            / (history.reached[:, b].sum() + prior_weight))
  return float((history.accepted[position, b] + prior_weight * pooled)
               / (history.reached[position, b] + prior_weight))


class AdmissionContext(typing.NamedTuple):
  """Everything a stopping rule may see when deciding about position i.

  No field can carry x_i: `rows[i]` summarizes the row x_i will be drawn
  from, which is computed from x_1..x_{i-1}; `history` holds only rounds
  verified before this one was drafted.
  """
  position: int                 # i, 0-based index of the token to be drawn
  committed: tuple[int, ...]    # committed history before the round
  drafted: tuple[int, ...]      # x_1 .. x_{i-1}, already drawn
  load: float | None = None     # a load figure measured before the round
  rows: tuple[RowStats, ...] = ()   # the draft's rows computed so far:
                                    # 0..i (lookahead) or 0..i-1
  history: AcceptanceHistory | None = None   # earlier rounds' counts


class StoppingRule(typing.Protocol):
  """Decides admit (True) or stop (False) for one position."""

  def admit(self, ctx: AdmissionContext) -> bool:
    ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedDepth:
  """Admit exactly `depth` positions, whatever was drawn."""
  depth: int

  def __post_init__(self) -> None:
    if self.depth < 1:
      raise ValueError(f"FixedDepth: depth must be >= 1, got {self.depth}")

  def admit(self, ctx: AdmissionContext) -> bool:
    return ctx.position < self.depth


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveDepth:
  """Admit position i while its expected extra tokens pay for a step.

  With a_j = `estimate(history, j, feature(rows, j, lookahead))`, position
  i is admitted iff

      a_0 a_1 ... a_{i-1} * a_i  >=  marginal_i * rate,

  the left side the expected tokens that x_i adds (it counts only when
  x_1..x_{i-1} are accepted) and rate the recorded rounds' tokens per
  unit of cost (1, target-only, before any). Without lookahead (the
  default) the rule decides before row i is computed, on rows 0..i-1, and
  marginal_i = step_cost (row i); with lookahead it sees row i itself,
  and marginal_i = step_cost for row i + 1, which it will need to decide
  on i + 1 (0 at the last position), while a stop wastes row i. A stop is
  final (`draft_chain`).

  Attributes:
    max_depth: the negotiated depth: position max_depth is never admitted.
    step_cost: one draft step's cost over one target pass (> 0).
    prior_weight: see `estimate`.
    min_depth: positions always admitted (0: the round may be target-only).
    lookahead: whether position i's decision reads row i's statistics
      (`draft_chain(lookahead=...)` must agree).
  """
  max_depth: int
  step_cost: float
  prior_weight: float = 16.0
  min_depth: int = 0
  lookahead: bool = False

  def __post_init__(self) -> None:
    if not (self.max_depth >= 1 and 0 <= self.min_depth <= self.max_depth
            and math.isfinite(self.step_cost) and self.step_cost > 0
            and self.prior_weight > 0):
      raise ValueError(f"AdaptiveDepth: max_depth {self.max_depth} >= 1, "
                       f"min_depth {self.min_depth} in [0, max_depth], "
                       f"step_cost {self.step_cost} > 0 and prior_weight "
                       f"{self.prior_weight} > 0 needed")

  def admit(self, ctx: AdmissionContext) -> bool:
    i = ctx.position
    if i >= self.max_depth:
      return False
    if i < self.min_depth:
      return True
    if len(ctx.rows) != i + self.lookahead:
      raise ValueError(f"AdaptiveDepth: position {i} needs the statistics "
                       f"of rows 0..{i + self.lookahead - 1}, got "
                       f"{len(ctx.rows)}")
    history = ctx.history
    if history is None:
      history = acceptance_history(self.max_depth)
    gain = 1.0
    for j in range(i + 1):
      gain *= estimate(history, j, feature(ctx.rows, j, self.lookahead),
                       self.prior_weight)
    rate = history.tokens / history.cost if history.cost > 0 else 1.0
    last = self.lookahead and i + 1 == self.max_depth
    return gain >= (0.0 if last else self.step_cost) * rate


def draft_chain(rule: StoppingRule,
                draw: typing.Callable[[int, tuple[int, ...]], int], *,
                max_depth: int, committed: typing.Iterable[int] = (),
                load: float | None = None,
                row: typing.Callable[[int, tuple[int, ...]], RowStats]
                | None = None,
                history: AcceptanceHistory | None = None,
                lookahead: bool = True) -> tuple[int, ...]:
  """Draws a chain under a sequential stopping rule.

  Args:
    rule: a `StoppingRule`.
    draw: callable (position, drafted_prefix) -> token; called only after
      `rule` admitted that position.
    max_depth: hard bound on the chain length (the negotiated depth).
    committed: the committed history, passed to the rule unchanged.
    load: optional load figure measured before the round.
    row: optional callable (position, drafted_prefix) -> `RowStats` of the
      draft's row for that position (it sees the same prefix `draw` will,
      never the draw), called before the rule is asked about that position
      (`lookahead`) or once the rule admitted it, before `draw`.
    history: earlier rounds' counts, passed to the rule unchanged.
    lookahead: see `row`; the context's `rows` hold rows 0..i, or 0..i-1.

  Returns:
    tuple of drawn tokens, length <= max_depth. The rule saw position i
    before x_i existed, and after its first stop nothing more is drawn.
  """
  committed = tuple(committed)
  drafted: list[int] = []
  rows: list[RowStats] = []
  for i in range(max_depth):
    if row is not None and lookahead:
      rows.append(row(i, tuple(drafted)))
    ctx = AdmissionContext(position=i, committed=committed,
                           drafted=tuple(drafted), load=load,
                           rows=tuple(rows), history=history)
    if not rule.admit(ctx):
      break
    if row is not None and not lookahead:
      rows.append(row(i, tuple(drafted)))
    drafted.append(int(draw(i, tuple(drafted))))
  return tuple(drafted)
