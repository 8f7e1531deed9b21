"""Collectives in compiled programs: what each sharded op moves.

Reads the text of a compiled HLO module (`program(op, *args)`, or any
`jax.jit(f).lower(...).compile().as_text()`). Used by the tests (no collective may move vocabulary-sized
data) and by experiments/bench_sharding.py (bytes per collective). Counts
are per call site in the program text; a site inside a loop runs once per
iteration.
"""

import functools
import re
import typing

import jax

_COLLECTIVES = ("all-reduce", "all-gather", "collective-permute",
                "all-to-all", "reduce-scatter")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
          "f64": 8}
_DEF = re.compile(r"^\s*%?[\w.\-]+ = (\(.*?\)|\S+) (" + "|".join(_COLLECTIVES)
                  + r")\(")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")


def program(op: typing.Callable, *args: typing.Any, **static: typing.Any
            ) -> str:
  """Compiled HLO text of op(*args, **static) (a public op: its host checks
  run at trace time), with 64-bit mode on as the ops scope it. `static`
  holds the Python arguments (k, mesh, ...), fixed in the program."""
  with jax.enable_x64(True):
    return str(jax.jit(functools.partial(op, **static)).lower(
        *args).compile().as_text())


class Collective(typing.NamedTuple):
  """One collective call site of a compiled program."""
  kind: str                          # all-reduce, all-gather, ...
  shapes: tuple[tuple[int, ...], ...]
  nbytes: int                        # bytes of the result, all operands


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective call site of a compiled HLO module's text."""
  found = []
  for line in hlo_text.splitlines():
    m = _DEF.match(line)
    if not m:
      continue
    shapes, nbytes = [], 0
    for dtype, dims in _ARRAY.findall(m.group(1)):
      shape = tuple(int(d) for d in dims.split(",") if d)
      n = 1
      for d in shape:
        n *= d
      shapes.append(shape)
      nbytes += n * _BYTES[dtype]
    found.append(Collective(m.group(2), tuple(shapes), nbytes))
  return found


def largest_dimension(found: list[Collective]) -> int:
  """The largest array dimension any collective moves (0 if none)."""
  return max((d for c in found for s in c.shapes for d in s), default=0)
