"""Two CPU processes, one vocabulary mesh, the same bits as one process.

Starts two ranks of `tests/multiprocess_worker.py` with jax.distributed on
127.0.0.1 (gloo collectives), on free ports, and always kills them at the
end. Their sharded results must equal the single-process, single-device
results of the same round.
"""

import json
import socket
import subprocess
import sys

import pytest

from tests import multiprocess_case

pytestmark = pytest.mark.multidevice

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_reproduce_single_process(tmp_path):
  port = _free_port()
  env = paths.subprocess_env(JAX_PLATFORMS="cpu")  # one CPU device each
  outs = [tmp_path / f"rank{i}.json" for i in range(2)]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.multiprocess_worker", str(i), str(port),
       str(outs[i])], cwd=_ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=240)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  want = multiprocess_case.run(multiprocess_case.build())
  for out in outs:
    got = json.loads(out.read_text())
    assert got.pop("devices") == 2
    assert got.pop("dense_block_equal") is True
    assert got == want
