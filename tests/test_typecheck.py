"""The type checker passes over the package ([tool.mypy] in pyproject.toml).

mypy runs in a subprocess from the repository root, with the project's own
configuration (the files it checks and how strictly are set there), so the
README's one test command covers the types too. Any error fails the test
and prints mypy's report.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="mypy comes with the test extra: "
                    "pip install -e '.[test]'")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mypy(*args):
  # The cache makes a second run take seconds; a read-only tree (a Bazel
  # sandbox) runs without one.
  cache = (os.path.join(_ROOT, ".mypy_cache") if os.access(_ROOT, os.W_OK)
           else os.devnull)
  return subprocess.run(
      [sys.executable, "-m", "mypy", "--no-error-summary",
       "--cache-dir", cache, *args], cwd=_ROOT,
      capture_output=True, text=True, timeout=900)


def test_mypy_passes_and_sees_an_error(tmp_path):
  run = _mypy()
  assert run.returncode == 0, run.stdout + run.stderr
  # The checker is not vacuous: a wrong use of the package's annotated API
  # is reported. Same options and cache as the run above (so this one
  # reuses its analysis of the package and its dependencies), the probe
  # file checked instead of the configured files.
  probe = tmp_path / "probe.py"
  probe.write_text("from dyadic_jax.testing import stats\n"
                   "n: int = stats.format_p(0.5)\n")
  run = _mypy(str(probe))
  assert run.returncode == 1 and "Incompatible types" in run.stdout, (
      run.stdout + run.stderr)
