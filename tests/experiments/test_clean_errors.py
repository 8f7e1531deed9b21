"""Issue 51, item 8: the last tracebacks and silent acceptances of the
entry points, each now one clean line (and a non-zero exit).

Each case runs the program as a user does (`python -m ...`, a fresh
process) and asserts: the exit status, exactly one line on stderr that
names the culprit, no traceback. The ones found at parse time also start
no JAX (`-X importtime`). No test here reads a clock.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests import paths
from tests.experiments.test_cli import _split


def _run(args, cwd, **env):
  """Runs in `cwd` (a test's own folder: a program that wrongly starts
  writes nothing into the repository)."""
  return subprocess.run([sys.executable, "-X", "importtime", *args],
                        cwd=cwd, env=paths.subprocess_env(**env),
                        capture_output=True, text=True, timeout=300)


def _one_line(run, status, program, *words, jax=False):
  modules, lines = _split(run.stderr)
  assert run.returncode == status, run.stdout + run.stderr
  assert "Traceback" not in run.stderr, run.stderr
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"{program}: "), lines[0]
  for word in words:
    assert word in lines[0], (word, lines[0])
  if not jax:
    assert "jax" not in modules, f"{program} imported JAX before failing"
  return lines[0]


# (program, flags, words the line must hold): refused at parse time.
_PARSE = [
    # The main job's pair has V = 4096: --k was checked against --vocab.
    ("pp1_pipeline", ["--k=4097"], ["--k=4097", "V=4096"]),
    ("bridge_worker", ["--model=stdlib", "--k=4097", "--insecure"],
     ["--k=4097", "V=4096"]),
    ("bridge_worker", ["--address=ipc:///nonexistent/dyadic/sock",
                       "--insecure"], ["--address", "/nonexistent/dyadic"]),
    # At most --tokens rounds: the drill would never fire.
    ("pp1_pipeline", ["--model=toy", "--kill_worker_at=48"],
     ["--kill_worker_at", "--tokens"]),
    ("pp1_pipeline", ["--model=toy", "--tokens=4", "--kill_worker_at=9"],
     ["--kill_worker_at", "--tokens"]),
    ("train_pair", ["--output_dir="], ["--output_dir", "empty"]),
    ("train_pair", ["--output_dir=stdlib"], ["--output_dir=stdlib",
                                             "shipped"]),
]


@pytest.mark.parametrize("program,args,words", _PARSE,
                         ids=[f"{p}:{' '.join(a)}" for p, a, _ in _PARSE])
def test_refused_at_parse_time_in_one_line(tmp_path, program, args, words):
  _one_line(_run(["-m", f"experiments.{program}", *args], tmp_path), 2,
            program, *words)


@pytest.mark.parametrize("program", ["pp1_pipeline", "bridge_worker",
                                     "round_demo"])
def test_a_bad_row_mode_in_the_environment_is_one_line(tmp_path, program):
  run = _run(["-m", f"experiments.{program}"], tmp_path,
             DYADIC_JAX_ROWS="bogus")
  _one_line(run, 2, program, "DYADIC_JAX_ROWS", "'bogus'")


def _absent_platform():
  """A JAX platform this machine cannot start: cuda, unless a CUDA
  plugin is installed (then rocm)."""
  cuda = any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}")
             for v in (12, 13)) if importlib.util.find_spec(
                 "jax_plugins") else False
  return "rocm" if cuda else "cuda"


def test_an_absent_jax_platform_is_one_line(tmp_path):
  """JAX_PLATFORMS=cuda on a CPU machine was a bare AssertionError."""
  platform = _absent_platform()
  run = _run(["-m", "experiments.round_demo", "--vocab=64"], tmp_path,
             JAX_PLATFORMS=platform)
  _one_line(run, 1, "round_demo", f"JAX_PLATFORMS={platform}", jax=True)


def test_an_unwritable_export_folder_is_one_line(tmp_path):
  """A folder no user can write (root passes os.access): was a
  FileNotFoundError traceback."""
  run = _run(["-m", "experiments.export_hf", "--output_dir=/proc/dyadic"],
             tmp_path)
  _one_line(run, 1, "export_hf", "--output_dir=/proc/dyadic", jax=True)
  assert not run.stdout


def test_keys_refuses_an_empty_folder_name(tmp_path):
  """`keys ""` wrote the secret into the current folder."""
  run = _run(["-m", "dyadic_jax.bridge.keys", ""], tmp_path)
  assert run.returncode == 2, run.stdout + run.stderr
  assert "usage:" in run.stderr and "Traceback" not in run.stderr
  assert not list(tmp_path.iterdir())


def test_a_folder_named_like_a_shipped_pair_is_not_shadowed(tmp_path):
  """--model=stdlib in a folder that holds ./stdlib (a checkpoint): the
  shipped pair was loaded without a word."""
  (tmp_path / "stdlib").mkdir()
  (tmp_path / "stdlib" / "config.json").write_text("{}")
  run = _run(["-m", "experiments.bridge_worker", "--model=stdlib",
              "--insecure"], tmp_path)
  _one_line(run, 2, "bridge_worker", "--model=./stdlib")
  assert os.listdir(tmp_path) == ["stdlib"]


# Every optional dependency absent: the lean install (pip install dyadic-jax).
_LEAN = ("tokenizers", "safetensors", "scipy", "matplotlib", "optax")


@pytest.mark.parametrize("args,line", [
    ([], "pp1_pipeline: --model=stdlib: needs the [models] extra "
     "(tokenizers, safetensors are not installed): pip install "
     "'dyadic-jax[models]' (--helpfull lists every flag)"),
    (["--model=toy"], "pp1_pipeline: needs the [experiments] extra "
     "(tokenizers, safetensors, scipy, matplotlib are not installed): pip "
     "install 'dyadic-jax[experiments]'"),
])
def test_the_main_job_on_the_lean_install_is_one_line(tmp_path, args, line):
  """Issue 51.5: the main job's own default (--model=stdlib) ran the flag's
  validator at import: a 10-line absl traceback, --model=toy or not."""
  code = ("import runpy, sys\n"
          f"for _m in {list(_LEAN)!r}:\n"
          "  sys.modules[_m] = None\n"
          f"sys.argv = ['pp1_pipeline', *{args!r}]\n"
          "runpy.run_module('experiments.pp1_pipeline', run_name='__main__',"
          " alter_sys=True)\n")
  run = _run(["-c", code], tmp_path)
  assert run.returncode == 2, run.stdout + run.stderr
  assert _split(run.stderr)[1] == [line]
  assert "jax" not in _split(run.stderr)[0]


def test_the_main_jobs_default_model_is_not_shadowed(tmp_path):
  """--model's default (stdlib) in a folder that holds ./stdlib: one line
  (it was the set_default traceback, then the shipped pair)."""
  (tmp_path / "stdlib").mkdir()
  (tmp_path / "stdlib" / "config.json").write_text("{}")
  run = _run(["-m", "experiments.pp1_pipeline"], tmp_path)
  _one_line(run, 2, "pp1_pipeline", "--model=./stdlib")


def test_a_drill_the_run_never_reached_says_so(tmp_path):
  """--kill_worker_at below --tokens that the run still never reaches
  (its rounds commit several tokens each): it used to end without a
  word that no worker was killed."""
  run = _run(["-m", "experiments.pp1_pipeline", "--model=toy", "--vocab=64",
              "--tokens=8", "--kill_worker_at=7", "--json_out=r.json",
              "--plot_out="], tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  rounds = json.loads((tmp_path / "r.json").read_text())["rounds"]
  assert rounds <= 7, rounds          # this seed's run: 5 rounds
  assert (f"pp1_pipeline: --kill_worker_at=7: the run ended after {rounds} "
          "rounds, before the drill: no worker was killed") in run.stderr
