"""experiments/bench_core.py: bad flags are one-line usage errors at parse time.

The benchmark itself is not a test (no test asserts on time); its flags are
checked here: each bad value exits nonzero with the flag's message and no
traceback, before any benchmark work starts.
"""

import subprocess
import sys

import pytest

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


@pytest.mark.parametrize("flag,message", [
    ("--vocab=0", "--vocab must be in"),
    ("--vocab=300000", "--vocab must be in"),
    ("--requests=0", "--requests must be in"),
    ("--depth=-1", "--depth must be in"),
    ("--repeats=0", "--repeats must be in"),
    ("--seed=-5", "--seed must be in"),
    ("--ks=0,32", "--ks"),
    ("--ks=x", "--ks"),
    ("--verify_k=200000", "--verify_k"),
    ("--hf_threads=0", "--hf_threads must be in"),
])
def test_bad_flag_is_a_usage_error(flag, message):
  env = paths.subprocess_env(JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "experiments.bench_core", flag],
                       capture_output=True, text=True, cwd=_ROOT, env=env,
                       timeout=120, check=False)
  assert run.returncode != 0
  assert message in run.stderr
  assert "Traceback" not in run.stderr
