"""The wire decoder's fuzz seed corpus, and a fixed-seed fuzz run in CI.

The corpus (tests/fuzz_corpus/wire/) holds one frame per rejection class
`decode` can produce, named by that class, plus valid frames; it must be
exactly what tests/fuzz_corpus/make_wire_corpus.py writes. The fuzz runs
(tests/fuzz_wire.py under atheris, a fixed seed, from a copy of that
corpus) replay the corpus and make 20,000 executions in all by default;
the 200,000-execution campaign is in the --runslow tier (a fixed-seed
campaign finds the same inputs on every run: the corpus is where its
regression value lives). Both skip only where atheris is not installed.
"""

import shutil

import pytest

from dyadic_jax.wire import Code
from tests import fuzz_run
from tests import fuzz_wire
from tests.fuzz_corpus import make_wire_corpus

CORPUS = make_wire_corpus.DIRECTORY
RUNS = 20_000            # the default tier: the corpus and new inputs
CAMPAIGN_RUNS = 200_000  # --runslow


def _corpus_files():
  return sorted(p.name for p in CORPUS.glob("*.bin"))


@pytest.mark.parametrize("name", _corpus_files())
def test_corpus_frame_decodes_as_named(name):
  frame = (CORPUS / name).read_bytes()
  assert make_wire_corpus.decode_outcome(name, frame) == (
      make_wire_corpus.outcome(name)[1])
  fuzz_wire.TestOneInput(frame)  # the harness's invariants hold on seeds


def test_corpus_is_what_the_generator_writes(tmp_path):
  make_wire_corpus.write(tmp_path)
  fresh = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  checked_in = {p.name: p.read_bytes() for p in CORPUS.iterdir()}
  assert sorted(checked_in) == sorted(fresh), (
      "stale corpus: run python -m tests.fuzz_corpus.make_wire_corpus")
  stale = [name for name in fresh if fresh[name] != checked_in[name]]
  assert not stale, f"stale corpus files {stale}: regenerate (docs/fuzzing.md)"


def test_corpus_covers_every_code_decode_can_raise():
  named = {make_wire_corpus.outcome(name)[1] for name in _corpus_files()}
  never = set(make_wire_corpus.NEVER_FROM_DECODE)
  assert named - {None} == set(Code) - never
  for code in never:  # each exclusion is explained in the docstring
    assert code.name in make_wire_corpus.__doc__, code


def _campaign(tmp_path, runs):
  pytest.importorskip("atheris", reason="atheris is not installed")
  corpus = tmp_path / "corpus"  # libFuzzer adds new inputs to this copy
  shutil.copytree(CORPUS, corpus)
  artifacts = tmp_path / "artifacts"
  artifacts.mkdir()
  result = fuzz_wire.run_fuzz([corpus], runs=runs, seed=1,
                              artifact_dir=artifacts, timeout=1800)
  fuzz_run.check(result, artifacts, runs, "tests/fuzz_wire.py",
                 corpus_files=len(_corpus_files()))


def test_fuzz_corpus_replay_and_bounded_run(tmp_path):
  _campaign(tmp_path, RUNS)


@pytest.mark.slow
def test_fuzz_campaign_fixed_seed(tmp_path):
  _campaign(tmp_path, CAMPAIGN_RUNS)
