"""experiments/bench_core.py: bad flags are one-line usage errors at parse time.

The benchmark itself is not a test (no test asserts on time); its flags are
checked here: each bad value exits nonzero with the flag's message and no
traceback, before any benchmark work starts.
"""

import re
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


# Issue 40: both printed a header, then nothing for minutes at the
# defaults. Tiny sizes here (about 40 s each on 2 cores): --runslow.
_TINY = ["--vocab=64", "--requests=1", "--depth=2", "--repeats=1", "--ks=4",
         "--verify_k=4"]


@pytest.mark.slow
@pytest.mark.parametrize("module,args,stages", [
    ("bench_core", ["--nohf"], ["the round's inputs", "dense proposal rows",
                                "sparse k=4 proposal rows", "verify dense",
                                "verify sparse k=4", "the HLO"]),
    ("bench_sharding", ["--shards=2"], [
        "the round's inputs", "the unsharded ops", "2 shards: every op",
        "2 shards: the one-row programs' collectives"]),
])
def test_progress_goes_to_stderr_as_it_runs(module, args, stages):
  run = subprocess.run(
      [sys.executable, "-m", f"experiments.{module}", *_TINY, *args],
      capture_output=True, text=True, cwd=_ROOT,
      env=paths.subprocess_env(JAX_PLATFORMS="cpu"), timeout=600,
      check=False)
  assert run.returncode == 0, run.stderr[-2000:]
  lines = [line for line in run.stderr.splitlines()
           if line.startswith(f"{module}: ")]
  assert [any(line.startswith(f"{module}: {s}") for line in lines)
          for s in stages] == [True] * len(stages), lines
  assert all(re.search(r"\(\d+ s so far\)$", line) for line in lines), lines
  seconds = [int(re.search(r"(\d+) s so far", line).group(1))
             for line in lines]
  assert seconds == sorted(seconds) and len(lines) == len(stages), lines
  assert "total wall time" in run.stdout
