"""Key files (`python -m dyadic_jax.bridge.keys DIR`) and CURVE sessions."""

import os
import stat
import subprocess
import sys

import pytest

from dyadic_jax import bridge
from dyadic_jax.bridge import keys
from dyadic_jax.wire.refusals import Code, ProtocolError
from tests import bridge_harness as h

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top


def _run(*args):
  return subprocess.run([sys.executable, "-m", "dyadic_jax.bridge.keys",
                         *args], cwd=_ROOT, capture_output=True, text=True,
                        env=paths.subprocess_env(), timeout=120)


def test_one_command_makes_the_key_files(tmp_path):
  directory = tmp_path / "keys"
  run = _run(str(directory))
  assert run.returncode == 0, run.stderr
  mode = lambda name: stat.S_IMODE((directory / name).stat().st_mode)
  assert mode("secret.key") == 0o600
  assert mode("worker.curve_secret") == mode("verifier.curve_secret") == 0o600
  assert stat.S_IMODE(directory.stat().st_mode) == 0o700
  secret = keys.load_secret(directory)
  assert len(secret) == 32
  # Never overwritten by accident: a complete set is kept (the command can
  # be run again), a partial one refused; replaced on request.
  again = _run(str(directory))
  assert again.returncode == 0 and "kept it" in again.stdout, again.stderr
  assert keys.load_secret(directory) == secret
  (directory / "worker.curve").unlink()
  partial = _run(str(directory))
  assert partial.returncode == 1 and "already holds" in partial.stderr
  assert partial.stderr.startswith("keys: ") and "keys: keys:" not in (
      partial.stderr)
  assert keys.load_secret(directory) == secret
  assert _run(str(directory), "--force").returncode == 0
  assert keys.load_secret(directory) != secret
  usage = _run()
  assert usage.returncode == 2 and usage.stderr.startswith("usage:")


def test_a_secret_others_can_read_is_refused(tmp_path):
  keys.make(tmp_path)
  os.chmod(tmp_path / "secret.key", 0o644)
  with pytest.raises(PermissionError, match="chmod 600"):
    keys.load_secret(tmp_path)


def test_temporary_keys_are_removed():
  with keys.temporary() as path:
    assert len(keys.load_secret(path)) == 32
  assert not path.exists()


def _curve_pair(directory):
  return (keys.load(directory, "worker", encrypt=True),
          keys.load(directory, "verifier", encrypt=True))


def test_an_encrypted_session_and_a_refused_client(tmp_path):
  keys.make(tmp_path / "a")
  keys.make(tmp_path / "b")
  worker_keys, verifier_keys = _curve_pair(tmp_path / "a")
  c = h.caps()
  loop = h.serve(bridge.Worker(c, h.proposer_for(c),
                               secret=worker_keys.secret),
                 curve=worker_keys.curve)
  worker, endpoint = loop.worker, loop.endpoint
  target = h.target_fn_for(h.toy())
  try:
    verifier = bridge.Verifier(c, endpoint.address, target_fn=target,
                               secret=verifier_keys.secret,
                               curve=verifier_keys.curve, timeout_s=h.GENEROUS_S)
    verifier.open()
    verifier.add_request(0, [1], seed=3)
    assert not verifier.round([0])[0].fallback
    verifier.close()
    # A client with another CURVE key (right MAC secret): not admitted.
    _, stranger = _curve_pair(tmp_path / "b")
    stranger = stranger._replace(curve=bridge.Curve(
        public_key=stranger.curve.public_key,
        secret_key=stranger.curve.secret_key,
        server_public=worker_keys.curve.public_key))
    refused = bridge.Verifier(c, endpoint.address, target_fn=target,
                              secret=verifier_keys.secret,
                              curve=stranger.curve, timeout_s=0.5)
    with pytest.raises(ProtocolError) as e:
      refused.open(attempts=2)
    assert e.value.code == Code.TIMEOUT
    refused.close()
    # A client in the clear: not admitted either.
    plain = bridge.Verifier(c, endpoint.address, target_fn=target,
                            secret=verifier_keys.secret, timeout_s=0.5)
    with pytest.raises(ProtocolError):
      plain.open(attempts=2)
    plain.close()
    assert worker.counters.total_errors() == 0   # nothing reached the bridge
  finally:
    loop.close()
