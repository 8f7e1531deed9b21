"""Fuzz runs over the two protocol sessions, in CI.

tests/fuzz_sessions.py feeds arbitrary frame sequences (forged, mutated,
resealed, replayed, duplicated, late) into a WorkerSession and a
VerifierSession; any exception out of a session, or a broken invariant, is
a crash. The default tier replays the saved corpus
(tests/fuzz_corpus/sessions/, the minimized inputs of a 200,000-execution
campaign: a fixed-seed campaign finds the same inputs on every run, so
they are its regression value) and makes 5,000 new executions; the full
200,000-execution campaign from an empty corpus is in the --runslow tier.
Both skip only where atheris is not installed. A failure prints the
crashing input (hex): reproduce it with `python tests/fuzz_sessions.py
FILE` (docs/fuzzing.md).
"""

import pathlib
import shutil

import pytest

from tests import fuzz_run
from tests import fuzz_sessions

CORPUS = pathlib.Path(fuzz_sessions.__file__).parent / "fuzz_corpus" / (
    "sessions")
NEW_RUNS = 5_000          # the default tier, beyond the corpus
CAMPAIGN_RUNS = 200_000   # --runslow


def _corpus_files():
  return sorted(p.name for p in CORPUS.iterdir() if p.is_file())


def test_empty_and_tiny_inputs_run():
  # The harness itself (no atheris instrumentation needed to import it).
  pytest.importorskip("atheris", reason="atheris is not installed")
  for data in (b"", b"\0", b"\xff" * 7, bytes(range(64)), b"\x01" * 300):
    fuzz_sessions.TestOneInput(data)


def test_corpus_is_saved():
  # A campaign's yield, minimized (docs/fuzzing.md says how it is made).
  assert len(_corpus_files()) >= 100


def _campaign(tmp_path, runs, seeds):
  pytest.importorskip("atheris", reason="atheris is not installed")
  corpus = tmp_path / "corpus"   # libFuzzer adds new inputs to this copy
  if seeds:
    shutil.copytree(CORPUS, corpus)
  else:
    corpus.mkdir()
  artifacts = tmp_path / "artifacts"
  artifacts.mkdir()
  result = fuzz_sessions.run_fuzz([corpus], runs=runs, seed=1,
                                  artifact_dir=artifacts, timeout=3600)
  fuzz_run.check(result, artifacts, runs, "tests/fuzz_sessions.py",
                 corpus_files=len(_corpus_files()) if seeds else None)


def test_fuzz_corpus_replay_and_bounded_run(tmp_path):
  _campaign(tmp_path, len(_corpus_files()) + NEW_RUNS, seeds=True)


@pytest.mark.slow
def test_fuzz_campaign_fixed_seed(tmp_path):
  _campaign(tmp_path, CAMPAIGN_RUNS, seeds=False)
