"""The worker as a separate process: rounds, a kill, and recovery.

Starts `python -m experiments.bridge_worker` on a free loopback port, runs
verified rounds against it, kills it mid-run (the verifier falls back to
target-only and counts TIMEOUTs), starts a new worker process on the same
address, and checks that the verifier negotiates again and verifies.
"""

import subprocess
import sys

import pytest

from dyadic_jax import bridge
from dyadic_jax.bridge import keys
from dyadic_jax.wire.layouts import Representation
from dyadic_jax.wire.refusals import Code
from tests import bridge_harness as h
from tests import no_leftovers

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


@pytest.fixture
def keys_dir(tmp_path):
  return keys.make(tmp_path / "keys")


def _start(address, caps, keys_dir):
  env = paths.subprocess_env(JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.bridge_worker",
       f"--address={address}", f"--vocab={caps.vocab}",
       f"--depth={caps.max_depth}", f"--requests={caps.max_requests}",
       "--q=sparse", f"--k={caps.max_support}", "--closeness=0.9",
       f"--keys_dir={keys_dir}"],
      cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
      text=True)
  try:
    # As long as it starts (prints or computes), whatever the load.
    line = no_leftovers.wait_for_line(proc, proc.stdout, "READY ")
  except BaseException:
    proc.kill()        # never left behind (and tests/no_leftovers.py)
    proc.wait()
    raise
  return proc, line.split()[1]


def test_worker_process_kill_and_restart(keys_dir):
  caps = bridge.Capabilities(vocab=h.V, max_depth=h.DEPTH, max_requests=2,
                             representation=Representation.SPARSE,
                             max_support=4)
  proc, address = _start("tcp://127.0.0.1:0", caps, keys_dir)
  toy = h.toy_pair.make_toy(h.toy_pair.ToyConfig(vocab=h.V,
                                                     closeness=0.9))
  verifier = bridge.Verifier(caps, address, target_fn=h.target_fn_for(toy),
                             secret=keys.load_secret(keys_dir),
                             curve=keys.load(keys_dir, "verifier").curve,
                             timeout_s=h.GENEROUS_S)
  try:
    verifier.open()
    for rid in range(2):
      verifier.add_request(rid, [rid], seed=rid)
    history = []
    for _ in range(5):
      history += verifier.round([0, 1])
    assert not any(r.fallback for r in history)
    proc.kill()
    proc.wait()
    # Nobody can answer now: a short real deadline times out, whatever
    # the machine's load; then the generous one again.
    verifier.session.timeout_s = 0.5
    dead = verifier.round([0, 1])
    verifier.session.timeout_s = h.GENEROUS_S
    history += dead
    assert all(r.fallback and r.code == Code.TIMEOUT for r in dead)
    proc, _ = _start(address, caps, keys_dir)   # same port: DEALER reconnects
    results = []
    for _ in range(8):
      results += verifier.round([0, 1])
    history += results
    verified = [r for r in results if not r.fallback]
    assert verified, "no verified round after the restart"
    snapshot = verifier.counters.snapshot()
    assert snapshot["errors"].get("TIMEOUT", 0) >= 2
    assert snapshot["events"]["hellos"] >= 2
    # Nothing lost or repeated: prompt + every round's tokens, in order.
    for rid, req in verifier.requests.items():
      mine = [t for r in history if r.rid == rid for t in r.committed]
      assert req.tokens == [rid] + mine
    tags = [(r.rid, r.generation, r.round) for r in history]
    assert len(set(tags)) == len(tags)
  finally:
    proc.kill()
    proc.wait()
    verifier.close()
