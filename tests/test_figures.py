"""The figures the docs quote are the recorded ones (docs/figures.json).

The README's main-job runtime, its sample output and the sentence after
it, the runtime paragraphs of the pp1_pipeline, acceptance and
bench_core docstrings and bench_core's in docs/benchmarks.md
(experiments/figures.py, SLOTS) must be what
`python -m experiments.record_figures --norecord --write_readme` renders
from the JSON; the fix for a failure here is that command (or recording
the figures again without it), never a hand edit. Nothing is run or
timed: the figures come from the JSON.
"""

import json
import os
import shutil

import pytest

from experiments import figures
from tests.paths import ROOT as _ROOT

_FIX = ("run `python -m experiments.record_figures --norecord "
        "--write_readme` (or record the figures again with --write_readme)")


@pytest.fixture(name="recorded", scope="module")
def _recorded():
  return figures.load(os.path.join(_ROOT, figures.FIGURES_JSON))


def test_the_docs_agree_with_the_recorded_figures(recorded):
  problems = figures.problems(recorded, _ROOT)
  assert not problems, "\n".join(problems) + "\n" + _FIX


def test_every_entry_states_its_conditions(recorded):
  assert set(recorded["commands"]) <= set(figures.COMMANDS)
  for command, entry in recorded["commands"].items():
    c = entry["conditions"]
    assert entry["command"] == f"python -m experiments.{command}"
    assert entry["wall_s"] > 0
    assert c["nproc"] >= 1 and len(c["date"]) == 10
    assert len(c["load_average_before"]) == len(c["load_average_after"]) == 3
    assert c["memcpy_10mb_ms_before"] > 0 and c["memcpy_10mb_ms_after"] > 0
    assert c["python"] and c["jax"]
  assert "suite" not in json.dumps(recorded).lower()   # CI records that


def test_the_sample_output_is_the_recorded_runs_own(recorded):
  """The summary kept verbatim and the key figures are of one run."""
  entry = recorded["commands"][figures.MAIN_JOB]
  stats = entry["figures"]
  lines = {line[:31].strip(): line[31:] for line in entry["stdout"]
           if line.startswith("  ")}
  assert lines["rounds (batches)"] == str(stats["rounds"])
  assert lines["mean accepted drafts"] == f"{stats['mean_accepted']:.3f}"
  assert lines["time split (s)"].startswith(
      f"wall {stats['time_s']['wall']:.2f} = ")
  assert stats["time_s"]["wall"] < entry["wall_s"]   # inside the process


def _slot(path, lead):
  (slot,) = [s for s in figures.SLOTS if s.path == path and s.lead == lead]
  return slot


def _readme():
  with open(os.path.join(_ROOT, "README.md")) as f:
    return f.read()


@pytest.mark.parametrize("how", ["figure", "line"])
def test_a_sample_block_edited_by_hand_fails(recorded, how):
  lines = recorded["commands"][figures.MAIN_JOB]["stdout"]
  rounds = next(line for line in lines if "rounds (batches)" in line)
  assert _readme().count(rounds) == 1
  text = _readme().replace(rounds, rounds + "0" if how == "figure" else
                           rounds + "\n  a line the run did not print")
  slot = _slot("README.md", "Sample output of the main job")
  assert figures.problem(text, slot, recorded)
  assert figures.rewrite(text, slot, recorded) == _readme()


def test_a_runtime_quote_typed_by_hand_fails(recorded):
  entry = recorded["commands"][figures.MAIN_JOB]
  wall = f"Runtime: {entry['wall_s']:.0f} s"
  text = _readme().replace(wall, "Runtime: 35 s", 1)
  assert text != _readme()
  slot = _slot("README.md", "Runtime:")
  assert "35 s" in figures.problem(text, slot, recorded)
  assert figures.rewrite(text, slot, recorded) == _readme()
  # Other conditions are another quote, even at the same runtime.
  later = json.loads(json.dumps(recorded))
  later["commands"][figures.MAIN_JOB]["conditions"]["load_average_before"][
      0] += 1
  assert figures.problem(_readme(), slot, later)


def test_a_rewrap_is_not_a_disagreement(recorded):
  slot = _slot("README.md", "In the run above,")
  text = _readme()
  assert not figures.problem(text.replace("In the run above, ",
                                          "In the run above,\n", 1),
                             slot, recorded)


def _copy_docs(folder):
  for path in {s.path for s in figures.SLOTS}:
    os.makedirs(folder / os.path.dirname(path), exist_ok=True)
    shutil.copy(os.path.join(_ROOT, path), folder / path)


def test_write_readme_renders_every_slot(recorded, tmp_path):
  """On a copy of the files: stale slots are rendered, nothing else moves."""
  _copy_docs(tmp_path)
  assert figures.rewrite_files(recorded, str(tmp_path)) == []
  readme = tmp_path / "README.md"
  readme.write_text(readme.read_text().replace("rounds (batches)", "rounds", 1))
  assert figures.problems(recorded, str(tmp_path))
  assert figures.rewrite_files(recorded, str(tmp_path)) == ["README.md"]
  assert readme.read_text() == _readme()
  assert not figures.problems(recorded, str(tmp_path))


def test_a_missing_entry_rewrites_nothing(recorded, tmp_path):
  partial = json.loads(json.dumps(recorded))
  del partial["commands"]["bench_core"]
  _copy_docs(tmp_path)
  readme = tmp_path / "README.md"
  stale = readme.read_text().replace("rounds (batches)", "rounds", 1)
  readme.write_text(stale)
  with pytest.raises(figures.SlotError, match="bench_core"):
    figures.rewrite_files(partial, str(tmp_path))
  assert readme.read_text() == stale
