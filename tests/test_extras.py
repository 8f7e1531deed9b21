"""The core install and its extras (dyadic_jax/extras.py, pyproject.toml).

* pyproject.toml's extras are `extras.EXTRAS` and `extras.INCLUDES`, and
  the core dependencies are the library's (nothing an extra brings).
* Without any extra installed, `import dyadic_jax; dyadic_jax.verify_batch`
  and the guide's bridge example (docs/guide.md: a worker and a verifier
  over loopback with toy models) run: a fresh interpreter in which every
  extra's module is absent (`sys.modules[name] = None`, which `import` and
  `importlib.util.find_spec` both read as not installed).
* Each entry point that needs an extra, started without it, exits 2 with
  one line naming the extra; the library's loaders raise `MissingExtra`.
"""

import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from dyadic_jax import extras
from tests import paths

_ROOT = pathlib.Path(paths.ROOT)
_PYPROJECT = tomllib.loads((_ROOT / "pyproject.toml").read_text())
_ALL_OPTIONAL = sorted({m for ms in extras.EXTRAS.values() for m in ms})
# The distribution that installs each module, where the names differ.
_DISTRIBUTION = {"zmq": "pyzmq", "absl": "absl-py"}


def _requirement_name(requirement: str) -> str:
  return re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0].lower()


def test_pyproject_extras_are_the_table():
  optional = _PYPROJECT["project"]["optional-dependencies"]
  for extra, modules in extras.EXTRAS.items():
    names = [_requirement_name(r) for r in optional[extra]]
    includes = [re.search(r"\[(.*)\]", r).group(1).split(",")
                for r in optional[extra] if r.startswith("dyadic-jax[")]
    assert sorted(n for n in names if n != "dyadic-jax") == sorted(
        _DISTRIBUTION.get(m, m) for m in modules), extra
    assert sorted(e for i in includes for e in i) == sorted(
        extras.INCLUDES[extra]), extra
  # The test extra brings every other one: the suite covers them all.
  assert "dyadic-jax[experiments,train]" in optional["test"]


def test_core_holds_no_extra():
  core = {_requirement_name(r) for r in _PYPROJECT["project"]["dependencies"]}
  assert core == {"jax", "jaxlib", "numpy", "chex", "absl-py", "crc32c",
                  "pyzmq", "blake3", "cryptography", "numba"}
  assert not core & set(_ALL_OPTIONAL)


def test_modules_of_includes():
  assert extras.modules_of("train") == ("tokenizers", "safetensors", "gguf",
                                        "optax")
  with pytest.raises(ValueError, match="unknown extra 'nope'"):
    extras.modules_of("nope")


def _without(modules, code, *args, cwd=None):
  """Runs `code` in a fresh interpreter in which `modules` are absent."""
  prelude = ("import sys\n"
             f"for _m in {list(modules)!r}:\n"
             "  sys.modules[_m] = None\n")
  return subprocess.run(
      [sys.executable, "-c", prelude + code, *args], cwd=cwd or paths.ROOT,
      env=paths.subprocess_env(), capture_output=True, text=True,
      timeout=600)


def test_core_verifies_without_extras():
  run = _without(_ALL_OPTIONAL, (
      "import numpy as np, dyadic_jax\n"
      "from dyadic_jax import extras\n"
      "assert extras.missing('experiments') == "
      "['tokenizers', 'safetensors', 'gguf', 'scipy', 'matplotlib']\n"
      "p = np.full((1, 2, 8), -2.0, np.float32)\n"
      "q = dyadic_jax.DenseQ(np.full((1, 1, 8), 1 << 21, np.int32))\n"
      "import jax\n"
      "keys = dyadic_jax.round_key(1, 0, 0)[None]\n"
      "out = dyadic_jax.verify_batch(p, q, np.array([[3]], np.int32), keys)\n"
      "print('verified', out)\n"))
  assert run.returncode == 0, run.stderr
  assert "verified" in run.stdout


def test_guide_bridge_example_without_extras(tmp_path):
  guide = (_ROOT / "docs" / "guide.md").read_text()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", guide, re.S)
            if "worker.serve" in b]
  assert len(blocks) == 1
  run = _without(_ALL_OPTIONAL, blocks[0], cwd=tmp_path)
  assert run.returncode == 0, run.stderr
  assert "Traceback" not in run.stderr


# Entry point -> its extra (the ones not listed need the core only).
_ENTRY_EXTRAS = {
    "pp1_pipeline": "experiments", "round_demo": "experiments",
    "selection_bias": "experiments", "acceptance": "experiments",
    "bench_pair": "experiments", "record_figures": "experiments",
    "bench_rank_links": "experiments", "train_pair": "train",
}


def _run_module(module, *argv):
  return ("import runpy\n"
          f"sys.argv = [{module!r}, *{list(argv)!r}]\n"
          f"runpy.run_module({module!r}, run_name='__main__', "
          "alter_sys=True)\n")


@pytest.mark.parametrize("program,extra", sorted(_ENTRY_EXTRAS.items()))
def test_entry_point_names_its_missing_extra(program, extra):
  missing = extras.modules_of(extra)[-1]   # the extra's own, not an include
  run = _without([missing], _run_module(f"experiments.{program}"))
  assert run.returncode == 2, run.stderr
  assert run.stderr.splitlines() == [
      f"{program}: needs the [{extra}] extra ({missing} is not installed): "
      f"pip install 'dyadic-jax[{extra}]'"]


def test_a_trained_model_flag_names_the_models_extra():
  run = _without(["safetensors"], _run_module(
      "experiments.bridge_worker", "--model=stdlib"))
  assert run.returncode == 2, run.stderr
  assert run.stderr.splitlines() == [
      "bridge_worker: --model=stdlib: needs the [models] extra (safetensors "
      "is not installed): pip install 'dyadic-jax[models]' (--helpfull "
      "lists every flag)"]


def test_library_loaders_raise_missing_extra():
  run = _without(["safetensors", "tokenizers"], (
      "from dyadic_jax import extras\n"
      "from dyadic_jax.models import checkpoint, tokenizer\n"
      "for call in (lambda: checkpoint.load_params('x', None),\n"
      "             lambda: tokenizer.from_json('{}')):\n"
      "  try:\n"
      "    call()\n"
      "  except extras.MissingExtra as e:\n"
      "    print(e)\n"))
  assert run.returncode == 0, run.stderr
  assert run.stdout.splitlines() == [
      "dyadic_jax.models.checkpoint: needs the [models] extra (safetensors "
      "is not installed): pip install 'dyadic-jax[models]'",
      "dyadic_jax.models.tokenizer: needs the [models] extra (tokenizers is "
      "not installed): pip install 'dyadic-jax[models]'"]
