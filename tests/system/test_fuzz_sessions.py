"""A fixed-seed fuzz campaign over the two protocol sessions, in CI.

tests/fuzz_sessions.py feeds arbitrary frame sequences (forged, mutated,
resealed, replayed, duplicated, late) into a WorkerSession and a
VerifierSession; any exception out of a session, or a broken invariant, is
a crash. This runs 200,000 executions with -seed=1; it skips only where
atheris is not installed. A failure prints the crashing input (hex):
reproduce it with `python tests/fuzz_sessions.py FILE` (docs/fuzzing.md).
"""

import pytest

from tests import fuzz_run
from tests import fuzz_sessions

RUNS = 200_000


def test_empty_and_tiny_inputs_run():
  # The harness itself (no atheris instrumentation needed to import it).
  pytest.importorskip("atheris", reason="atheris is not installed")
  for data in (b"", b"\0", b"\xff" * 7, bytes(range(64)), b"\x01" * 300):
    fuzz_sessions.TestOneInput(data)


@pytest.mark.long(minutes=8)
def test_fuzz_run_fixed_seed(tmp_path):
  pytest.importorskip("atheris", reason="atheris is not installed")
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  artifacts = tmp_path / "artifacts"
  artifacts.mkdir()
  result = fuzz_sessions.run_fuzz([corpus], runs=RUNS, seed=1,
                                  artifact_dir=artifacts, timeout=1800)
  fuzz_run.check(result, artifacts, RUNS, "tests/fuzz_sessions.py")
