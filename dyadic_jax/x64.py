"""Scoped 64-bit mode for the library's entry points.

The contract needs float64 weights and int64/uint64 sums, but flipping the
process-wide `jax_enable_x64` flag would change the dtypes of a caller's own
code. Instead every public op traces and runs inside `jax.enable_x64(True)`,
a context manager that only affects what is traced and compiled while it is
active. The caller's flag is left as it was; outputs are concrete arrays
whose dtypes say what they are (weights float64, counts/tokens/status int32).

`jax.vmap` over an op works as is. Inside a caller's own `jax.jit` the op's
part of the program is compiled when the caller's function is, outside this
scope, so there the caller must provide 64-bit mode: run the jitted call
under `with jax.enable_x64(True):` (or set `jax_enable_x64` globally). An op
staged into a 32-bit jit raises `X64Required` at trace time instead of
failing obscurely at compile time.
"""

import functools
from typing import Any, Callable, TypeVar

import jax


class X64Required(RuntimeError):
  """A library op was staged into a jit trace while 64-bit mode was off."""


def _staging():
  """True when the current trace (or a parent) stages into a jaxpr (jit)."""
  try:
    from jax._src import core  # pylint: disable=g-import-not-at-top
    trace = core.trace_ctx.trace
  except (ImportError, AttributeError):  # pragma: no cover - future JAX
    return False
  while trace is not None:
    if type(trace).__name__ == "DynamicJaxprTrace":
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


_F = TypeVar("_F", bound=Callable[..., Any])


def scoped(fn: _F, name: str | None = None) -> _F:
  """Decorator: run `fn` with 64-bit types enabled for its own trace only.

  `name` is the op's name in the X64Required message (default: fn's name).
  """
  name = name or fn.__name__

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if not jax.config.jax_enable_x64 and _staging():
      raise X64Required(
          f"dyadic_jax.{name} was called inside jax.jit with 64-bit "
          "mode off; call your jitted function under "
          "`with jax.enable_x64(True):` (or set jax_enable_x64) so that the "
          "float64/int64 parts of the op compile as specified")
    with jax.enable_x64(True):
      return fn(*args, **kwargs)

  return wrapper  # type: ignore[return-value]
