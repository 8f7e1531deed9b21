"""Row modes: a batch of vocabulary rows one row at a time, or all at once.

An op like `allocate_dense` makes ~25 passes over each [V] row (status,
exact sums, bisection counts). Batched over [B, V], every pass streams the
whole batch through memory; one row at a time (about 1 MB in float64 at
V = 129280), the row stays in cache across all passes. On XLA CPU that is
2-3x faster (experiments/bench_core.py). Accelerators keep the batched form.

The mode is a switch, so that CPU can run (and CI can test) the
accelerator's batched programs:

  DYADIC_JAX_ROWS=auto     (default) loop on CPU, batched elsewhere
  DYADIC_JAX_ROWS=loop     one row at a time (`lax.map`) on every backend
  DYADIC_JAX_ROWS=batched  the whole batch at once on every backend

The environment variable is read once, when this module is imported; a bad
value raises ValueError then. `scope(mode)` overrides it for a scope (one
thread). The setting is part of every `jax.jit` cache key (a
`jax.make_user_context`), so a jitted function, the library's or the
caller's, never serves a program traced in the other mode. Both modes give
the same bits: every row runs the same program either way
(docs/numerics.md, "Row modes and accelerator-only branches").

`row_op` makes the same hold under `jax.vmap`: its batching rule folds the
vmapped axis into the rows instead of widening every step of the row loop.
"""

import contextlib
import threading
from typing import Callable, Iterator, Sequence

import jax
from jax import lax
import numpy as np

# ROWS_ENV and SETTINGS are this module's too: the setting's names.
from dyadic_jax.rowsetting import (ROWS_ENV, SETTINGS, check_setting,
                                   setting_from_env)



class _ClearingContext:
  """Fallback for a JAX without `make_user_context`: a per-thread setting.

  A change of setting cannot enter the jit cache key here, so entering and
  leaving a scope with a different setting clears JAX's caches instead
  (correct, and slow only when the mode changes).
  """

  def __init__(self, default: str):
    self._default = default
    self._local = threading.local()

  @property
  def value(self) -> str:
    return getattr(self._local, "value", self._default)

  @contextlib.contextmanager
  def __call__(self, setting: str) -> Iterator[None]:
    before = self.value
    if setting != before:
      jax.clear_caches()
    self._local.value = setting
    try:
      yield
    finally:
      self._local.value = before
      if setting != before:
        jax.clear_caches()


def _make_context(default: str, *, keyed: bool = True):
  """The setting's holder: part of the jit key when this JAX supports it."""
  make = getattr(jax, "make_user_context", None)
  if keyed and make is not None:
    return make(default_value=default)
  return _ClearingContext(default)


_SETTING = _make_context(setting_from_env())


def jit_keyed() -> bool:
  """True when the row setting is in the jit cache key (not the fallback)."""
  return not isinstance(_SETTING, _ClearingContext)


def setting() -> str:
  """The row setting in effect here: "auto", "loop" or "batched"."""
  return _SETTING.value


def row_mode() -> str:
  """The mode in effect here, "auto" resolved: "loop" or "batched"."""
  s = _SETTING.value
  if s == "auto":
    return "loop" if jax.default_backend() == "cpu" else "batched"
  return s


@contextlib.contextmanager
def scope(mode: str) -> Iterator[str]:
  """Scoped row setting ("auto", "loop" or "batched") for this thread.

  Ops traced inside the scope use it; jit caches are keyed on it, so an
  op called in both modes compiles once per mode. Yields the resolved
  mode.
  """
  with _SETTING(check_setting("scope", mode)):
    yield row_mode()


def map_rows(fn: Callable, *args: jax.Array, core_ndims: Sequence[int]):
  """fn(*args), one leading-batch element at a time in "loop" mode.

  core_ndims[i] is the number of trailing per-row axes of args[i] (1 for a
  [V] row, 0 for a per-row scalar); the leading axes form the batch shape,
  the same for every argument. fn must accept any batch shape (including
  none) and return a pytree of arrays led by that batch shape. In
  "batched" mode (and for a batch of at most one row) fn runs once on the
  whole batch.
  """
  a0, c0 = args[0], core_ndims[0]
  batch = a0.shape[:a0.ndim - c0]
  n = int(np.prod(batch, dtype=np.int64))
  if n <= 1 or row_mode() == "batched":
    return fn(*args)
  flat = [a.reshape((n,) + a.shape[a.ndim - c:])
          for a, c in zip(args, core_ndims)]
  out = lax.map(lambda xs: fn(*xs), flat)
  return jax.tree.map(lambda o: o.reshape(batch + o.shape[1:]), out)


def fold_vmap(fn: Callable) -> Callable:
  """fn with a vmap rule that widens its batch instead of its steps.

  Under `jax.vmap` the vmapped axis becomes one more leading batch axis of
  every argument (unbatched arguments are broadcast), and fn runs once on
  the widened batch. fn must take any leading batch shape.
  """
  op = jax.custom_batching.custom_vmap(fn)

  @op.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [a if batched else jax.numpy.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched in zip(args, in_batched)]
    out = op(*args)
    return out, jax.tree.map(lambda _: True, out)

  return op


def row_op(fn: Callable, core_ndims: Sequence[int]) -> Callable:
  """fn as a row op: `map_rows` on call, and a vmap rule that keeps rows
  (`fold_vmap`)."""
  return fold_vmap(lambda *args: map_rows(fn, *args, core_ndims=core_ndims))
