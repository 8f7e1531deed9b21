"""The README works as pasted.

* Every ```python block runs on its own in a fresh interpreter, the way a
  reader pastes it: not inside this already-configured pytest process (no
  emulated devices from conftest.py, no imports done for it; only the
  default tier's compile flags, which change no result).
* Every `python -m experiments.X --flag ...` command in a ```sh block names
  only flags that module defines (checked against its --helpfull, which
  exits before JAX starts).
* The main job's runtime and sample output are the recorded ones:
  tests/test_figures.py.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from tests import paths

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_README = (_ROOT / "README.md").read_text()
_PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", _README, re.S)


def _fresh_env():
  return paths.subprocess_env()   # conftest.py's 8 devices are not the reader's


def test_readme_has_the_examples():
  assert len(_PYTHON_BLOCKS) >= 3
  assert any("vocab_mesh" in b for b in _PYTHON_BLOCKS)
  assert any("bridge.Verifier" in b for b in _PYTHON_BLOCKS)


@pytest.mark.parametrize("index", range(len(_PYTHON_BLOCKS)))
def test_python_block_runs_as_pasted(index, tmp_path):
  block = _PYTHON_BLOCKS[index]
  if "import bridge" in block and importlib.util.find_spec("zmq") is None:
    pytest.skip("the bridge example needs pyzmq (a dependency of the "
                "package; absent from this environment)")
  run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path,
                       env=_fresh_env(), capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, (
      f"README python block {index + 1} failed:\n{block}\n{run.stderr}")
  assert "Traceback" not in run.stderr


def _readme_commands():
  """(module, [flag names]) of every experiments command in ```sh blocks."""
  out = []
  for block in re.findall(r"```sh\n(.*?)```", _README, re.S):
    for line in block.replace("\\\n", " ").splitlines():
      m = re.search(r"python -m experiments\.(\w+)(.*)", line)
      if m:
        args = m.group(2).split("#")[0]
        out.append((m.group(1), re.findall(r"--(\w+)", args)))
  return out


def test_readme_commands_use_real_flags():
  commands = _readme_commands()
  assert any(m == "pp1_pipeline" for m, _ in commands)
  helps = {}
  for module, names in commands:
    if module not in helps:
      run = subprocess.run(
          [sys.executable, "-m", f"experiments.{module}", "--helpfull"],
          cwd=_ROOT, env=_fresh_env(), capture_output=True, text=True,
          timeout=300)
      helps[module] = run.stdout
    for name in names:
      assert re.search(rf"--(\[no\])?{name}\b", helps[module]), (
          f"README: python -m experiments.{module} --{name}: no such flag")

