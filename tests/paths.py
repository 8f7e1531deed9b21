"""Where the tests find the repository, and the environment of the
programs they start (they run commands from its root)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def subprocess_env(**extra):
  """os.environ for a program a test starts, as a user starts it.

  PYTHONPATH is the repository (before any already set), and XLA_FLAGS
  loses conftest.py's 8 emulated devices (a program sets its own count, or
  runs on one device) but keeps the default tier's compile flags (the same
  bits, faster compiles: conftest.py `_fast_compile`). `extra` overrides.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith(_DEVICE_COUNT))
  env.update(extra)
  return env


def pipeline_flags(*flags: str) -> list[str]:
  """The main job's flags for a test: --model=toy unless they name a
  model. The main job runs the trained pair by default; most pipeline
  tests exercise the toy (any V, the seed's transport sizes)."""
  named = any(f.startswith("--model=") for f in flags)
  return list(flags) + ([] if named else ["--model=toy"])
