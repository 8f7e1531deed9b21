"""Admission: which draft positions get drafted and verified.

Depth is fixed before any draw by default. An adaptive policy may only be a
sequential stopping rule: before x_i is drawn it decides from what already
exists (committed history, measured load, x_1..x_{i-1}) whether position i is
admitted; once it stops, it never reopens. `draft_chain` enforces this by
construction: the rule is asked about position i while x_i does not exist
yet, and `AdmissionContext` has no field that could carry it.

Why it matters: admitting x_1 only when it is 0 (q = p uniform on {0, 1},
target-only otherwise) outputs 0 with probability 3/4, not 1/2; no verifier
can undo a selection made after looking at the draw (docs/numerics.md
section 7, docs/architecture.md).
"""

import dataclasses
import typing


class AdmissionContext(typing.NamedTuple):
  """Everything a stopping rule may see when deciding about position i."""
  position: int                 # i, 0-based index of the token to be drawn
  committed: tuple[int, ...]    # committed history before the round
  drafted: tuple[int, ...]      # x_1 .. x_{i-1}, already drawn
  load: float | None = None     # a load figure measured before the round


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


def draft_chain(rule: StoppingRule,
                draw: typing.Callable[[int, tuple[int, ...]], int], *,
                max_depth: int, committed: typing.Iterable[int] = (),
                load: float | None = None) -> tuple[int, ...]:
  """Draws a chain under a sequential stopping rule.

  Args:
    rule: a `StoppingRule`.
    draw: callable (position, drafted_prefix) -> token; called only after
      `rule` admitted that position.
    max_depth: hard bound on the chain length (the negotiated depth).
    committed: the committed history, passed to the rule unchanged.
    load: optional load figure measured before the round.

  Returns:
    tuple of drawn tokens, length <= max_depth. The rule saw position i
    before x_i existed, and after its first stop nothing more is drawn.
  """
  committed = tuple(committed)
  drafted: list[int] = []
  for i in range(max_depth):
    ctx = AdmissionContext(position=i, committed=committed,
                           drafted=tuple(drafted), load=load)
    if not rule.admit(ctx):
      break
    drafted.append(int(draw(i, tuple(drafted))))
  return tuple(drafted)
