"""Keeps a long test process under the kernel's limit on memory mappings.

XLA CPU loads each compiled program's machine code into memory mappings
of its own (a few to about fifty per library op; the qualification's
tests added about 240 each on average), and JAX's jit caches keep every
program alive for the life of the process. Linux caps a process's
mappings at vm.max_map_count (65530 by default), and XLA does not
survive reaching it: it dies with SIGABRT or SIGSEGV wherever it next
needs a mapping, compiling the next program or serializing one for the
persistent compilation cache (alone: "LLVM compilation error: Cannot
allocate memory", then SIGSEGV). The GPU qualification on CPU (about 400
tests in one process, tests/qualify_report.py) reached the cap in
tests/sharding/test_ops.py at 4 GB of RSS (issue 42).

So after each test, a process past half its limit drops JAX's in-memory
caches (`jax.clear_caches()`; the programs' mappings go with them) and
collects. Later tests recompile what they need, most of it from the
persistent compilation cache (tests/conftest.py). Programs differ in no
bit for being compiled twice. Registered by tests/conftest.py through
`pytest_plugins`; it imports no JAX itself, and acts only in a process
that has.

DYADIC_JAX_TEST_MAP_BUDGET=N sets the threshold to N mappings (the test
of this plugin sets a small one).
"""

import gc
import os
import sys

import pytest

_ENV = "DYADIC_JAX_TEST_MAP_BUDGET"
_SELF = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"

# What tests/qualify_report.py reports: the times this process dropped its
# caches, and its most mappings seen (at the end of a test, before a drop).
drops = 0
peak = 0
_after = 0     # its mappings just after the last drop


def mapping_count():
  """This process's memory mappings, or None where /proc has none."""
  try:
    with open(_SELF, "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def mapping_limit():
  """The kernel's cap on a process's mappings, or None where unknown."""
  try:
    with open(_LIMIT, encoding="ascii") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def budget():
  """Mappings past which caches are dropped: DYADIC_JAX_TEST_MAP_BUDGET,
  else half the kernel's limit; None (never drop) where neither is known.
  Half leaves room for the largest single test (a few thousand mappings)."""
  if os.environ.get(_ENV):
    return int(os.environ[_ENV])
  limit = mapping_limit()
  return None if limit is None else limit // 2


def drop_if_over_budget() -> bool:
  """Drops JAX's in-memory caches when this process is past `budget()`.

  Returns whether it did. Acts only where JAX is already imported (a
  process that never compiled has nothing to drop). Where a drop leaves
  the process past the budget (mappings held outside JAX's caches), the
  next waits for an eighth of the budget more, rather than recompiling
  after every test.
  """
  global drops, peak, _after
  jax = sys.modules.get("jax")
  cap, count = budget(), mapping_count()
  peak = max(peak, count or 0)
  if (jax is None or cap is None or count is None
      or count < max(cap, _after + cap // 8)):
    return False
  jax.clear_caches()
  gc.collect()
  drops += 1
  _after = mapping_count() or 0
  return True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  # trylast: after the test's fixtures are finalized, so what they held is
  # freed with the caches.
  del item, nextitem
  drop_if_over_budget()
