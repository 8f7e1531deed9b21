"""The docs work as pasted: README.md and every docs/*.md.

* Every ```python block runs on its own in a fresh interpreter, the way a
  reader pastes it: not inside this already-configured pytest process (no
  emulated devices from conftest.py, no imports done for it; only the
  default tier's compile flags, which change no result).
* ```sh blocks are not run (their commands take minutes to hours); they
  are checked: every `python -m experiments.X --flag ...` names only flags
  that module defines (against its --helpfull, which exits before JAX
  starts), every `python -m pytest` names only options pytest's --help
  lists (conftest.py's included) and paths that exist, and every other
  program of the project's own (`python -m tests.X`, `python
  tests/fuzz_wire.py`) exists.
* The table of docs/guide.md's "The flags that matter" names only flags of
  the program its row names.
* Every relative link ([text](path#anchor), images too) resolves: the file
  exists and the anchor is one of its headings' GitHub anchors. A
  reference in words to a section of a moved-apart file (`README, "Row
  modes"`, `docs/guide.md, "Layout"`), in the docs or in the code, names a
  heading that file has.
* A fence is ```python, ```sh or a bare ``` (output, layouts): a block in
  any other language would be checked by nothing.
* docs/architecture.md names every module file of dyadic_jax/, sharding/
  and experiments/ in its package's section, and the verification
  function the bridge is given is the one its classes default to;
  docs/benchmarks.md gives bench_core's and bench_sharding's runtime.

A block that is deliberately not run (a GPU-only example, a transcript)
says so on the line before its fence, with the reason:

    <!-- docs-test: not run: REASON -->

It is reported as skipped with that reason; nothing is skipped silently.
The main job's runtime and sample output are the recorded ones:
tests/test_figures.py.
"""

import dataclasses
import glob
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import paths

_ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, _ROOT) for p in glob.glob(str(_ROOT / "docs" / "*.md")))
_MARKER = re.compile(r"<!-- docs-test: not run: (.+?) -->")
_FENCE = re.compile(r"^```(\S*)\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
  path: str          # relative to the repository
  line: int          # of the opening fence, 1-based
  language: str      # "python", "sh" or "" (a bare fence)
  body: str
  not_run: str | None   # the marker's reason

  @property
  def where(self) -> str:
    return f"{self.path}:{self.line}"


def blocks(text: str, path: str = "<text>") -> list[Block]:
  """The fenced blocks of a markdown text, each with its marker."""
  out = []
  for m in _FENCE.finditer(text):
    before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
    marker = _MARKER.fullmatch(before)
    out.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(1),
                     m.group(2), marker.group(1) if marker else None))
  return out


def _read(path: str) -> str:
  return (_ROOT / path).read_text(encoding="utf-8")


_BLOCKS = [b for path in DOCS for b in blocks(_read(path), path)]
_PYTHON = [b for b in _BLOCKS if b.language == "python"]


def _fresh_env():
  return paths.subprocess_env()   # conftest.py's 8 devices are not the reader's


def test_the_docs_have_the_examples():
  assert {"README.md", "docs/guide.md", "docs/benchmarks.md"} <= set(DOCS)
  assert len(_PYTHON) >= 5
  bodies = [b.body for b in _PYTHON]
  assert any("vocab_mesh" in b for b in bodies)
  assert any("bridge.Verifier" in b for b in bodies)
  assert any("generate.generate" in b for b in bodies)


def test_every_fence_is_checked_by_something():
  for block in _BLOCKS:
    assert block.language in ("python", "sh", ""), (
        f"{block.where}: ```{block.language}: use python, sh or a bare fence")


def test_every_marker_precedes_a_block():
  for path in DOCS:
    text = _read(path)
    marked = {b.line for b in blocks(text, path) if b.not_run}
    for i, line in enumerate(text.splitlines(), 1):
      if "docs-test:" in line:
        assert _MARKER.fullmatch(line.strip()), (
            f"{path}:{i}: a marker is `<!-- docs-test: not run: REASON -->`")
        assert i + 1 in marked, f"{path}:{i}: the marker's next line is no fence"


def test_a_marker_names_its_reason():
  text = ("x\n\n<!-- docs-test: not run: needs a GPU -->\n```python\n"
          "import jax\n```\n\n```python\nprint(1)\n```\n")
  first, second = blocks(text)
  assert (first.language, first.not_run, first.line) == ("python",
                                                         "needs a GPU", 4)
  assert (second.not_run, second.body) == (None, "print(1)\n")


@pytest.mark.parametrize("block", _PYTHON, ids=[b.where for b in _PYTHON])
def test_python_block_runs_as_pasted(block, tmp_path):
  if block.not_run:
    pytest.skip(f"{block.where}: not run: {block.not_run}")
  if "import bridge" in block.body and importlib.util.find_spec("zmq") is None:
    pytest.skip("the bridge example needs pyzmq (a dependency of the "
                "package; absent from this environment)")
  run = subprocess.run([sys.executable, "-c", block.body], cwd=tmp_path,
                       env=_fresh_env(), capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, (
      f"{block.where}: python block failed:\n{block.body}\n{run.stderr}")
  assert "Traceback" not in run.stderr


def _sh_lines():
  """(block, line) of every command line of the ```sh blocks, continuation
  lines joined, comments dropped."""
  for block in _BLOCKS:
    if block.language == "sh":
      for line in block.body.replace("\\\n", " ").splitlines():
        line = line.split("#")[0].strip()
        if line:
          yield block, line


def _experiments_commands():
  """(where, module, [flag names]) of every experiments command."""
  out = []
  for block, line in _sh_lines():
    for m in re.finditer(r"python -m experiments\.(\w+)(.*)", line):
      args = re.split(r"&&|;|\|", m.group(2))[0]   # the next command's are its own
      out.append((block.where, m.group(1), re.findall(r"--(\w+)", args)))
  return out


_HELPS = {}


def _helpfull(module):
  if module not in _HELPS:
    run = subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", "--helpfull"],
        cwd=_ROOT, env=_fresh_env(), capture_output=True, text=True,
        timeout=300)
    assert run.returncode == 0, f"experiments.{module} --helpfull:\n{run.stderr}"
    _HELPS[module] = run.stdout
  return _HELPS[module]


def _has_flag(module, name):
  text = _helpfull(module)
  return (re.search(rf"--(\[no\])?{name}\b", text) or
          name.startswith("no") and f"--[no]{name[2:]}:" in text)


def test_docs_commands_use_real_flags():
  commands = _experiments_commands()
  assert any(m == "pp1_pipeline" and w.startswith("README.md")
             for w, m, _ in commands)
  assert any(m == "bench_bridge" for _, m, _ in commands)
  for where, module, names in commands:
    for name in names:
      assert _has_flag(module, name), (
          f"{where}: python -m experiments.{module} --{name}: no such flag")


def test_docs_programs_exist():
  """`python -m PKG.X` and `python path/X.py` of the project's own."""
  for block, line in _sh_lines():
    for module in re.findall(
        r"python3? -m ((?:experiments|tests|dyadic_jax|sharding)[\w.]*)", line):
      base = _ROOT / module.replace(".", "/")
      assert (base.with_suffix(".py").is_file()
              or (base / "__main__.py").is_file()), (
                  f"{block.where}: python -m {module}: no such module")
    for script in re.findall(r"python3? ((?:\.\./)*[\w/]+\.py)\b", line):
      assert (_ROOT / re.sub(r"^(\.\./)+", "", script)).is_file(), (
          f"{block.where}: python {script}: no such file")


def test_docs_pytest_commands_use_real_options():
  """`python -m pytest ...`: its long options and the paths it names."""
  commands = [(b, line.split("python -m pytest", 1)[1])
              for b, line in _sh_lines() if "python -m pytest" in line]
  assert len(commands) >= 2            # the test command, GPU qualification
  run = subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=_ROOT,
                       env=_fresh_env(), capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0, run.stderr
  for block, args in commands:
    for name in re.findall(r"(?:^|\s)--([\w-]+)", args):
      assert re.search(rf"^\s+--{name}\b", run.stdout, re.M), (
          f"{block.where}: python -m pytest --{name}: no such option")
    for path in re.findall(r"(?:^|\s)(tests/\S*)", args):
      assert (_ROOT / path).exists(), f"{block.where}: {path}: no such path"


def test_the_flags_table_names_real_flags():
  text = _read("docs/guide.md")
  section = text.split("## The flags that matter", 1)[1].split("\n## ", 1)[0]
  rows = [line.split("|")[1:-1] for line in section.splitlines()
          if line.startswith("| `--")]
  assert len(rows) >= 10
  programs = {"both": ("pp1_pipeline", "bridge_worker"),
              "pp1_pipeline": ("pp1_pipeline",),
              "bridge_worker": ("bridge_worker",)}
  for flag, _, program, what in rows:
    for module in programs[program.strip()]:     # the row's own flags
      for name in re.findall(r"--(\w+)", flag):
        assert _has_flag(module, name), (
            f"docs/guide.md, flags table: {module} has no --{name}")
    for name in re.findall(r"--(\w+)", what):   # the flags it mentions
      assert any(_has_flag(m, name) for m in programs["both"]), (
          f"docs/guide.md, flags table: no program has --{name}")


# ------------------------------------------------------------------ links

def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _outside_code(text: str) -> str:
  text = _FENCE.sub("", text)
  return re.sub(r"`[^`\n]*`", "", text)


def anchors(text: str) -> set[str]:
  """Every heading's anchor, repeats numbered as GitHub numbers them."""
  seen: dict[str, int] = {}
  out = set()
  for m in re.finditer(r"^#{1,6} (.+)$", _FENCE.sub("", text), re.M):
    slug = _slug(m.group(1))
    out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
    seen[slug] = seen.get(slug, 0) + 1
  return out


def test_slugs_are_githubs():
  assert _slug("Real text: a trained draft/target pair") == (
      "real-text-a-trained-drafttarget-pair")
  assert _slug("The bridge (`dyadic_jax.bridge`): sessions, keys, ZeroMQ") == (
      "the-bridge-dyadic_jaxbridge-sessions-keys-zeromq")
  assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", DOCS)
def test_relative_links_resolve(path):
  folder = (_ROOT / path).parent
  for target in _LINK.findall(_outside_code(_read(path))):
    if re.match(r"[a-z]+:", target):
      continue                                      # https:, mailto:
    file, _, anchor = target.partition("#")
    resolved = (folder / file) if file else (_ROOT / path)
    assert resolved.exists(), f"{path}: ({target}): no such file"
    if anchor:
      assert anchor in anchors(resolved.read_text(encoding="utf-8")), (
          f"{path}: ({target}): {file or path} has no such heading")


# Files whose sections moved apart (README -> docs/guide.md and
# docs/benchmarks.md); a reference to one of their sections in words.
_MOVED = ("README", "README.md", "docs/guide.md", "docs/benchmarks.md")
_REFERENCE = re.compile(
    r"\b(README(?:\.md)?|docs/guide\.md|docs/benchmarks\.md),\s+\"([^\"]+)\"")


def _sources():
  for folder in ("dyadic_jax", "sharding", "experiments", "tests", "docs"):
    for directory, _, files in os.walk(_ROOT / folder):
      for name in files:
        if name.endswith((".py", ".md")):
          yield pathlib.Path(directory) / name
  yield _ROOT / "README.md"


def test_section_references_name_real_headings():
  titles = {}
  for name in _MOVED:
    file = "README.md" if name.startswith("README") else name
    titles[name] = [re.sub(r"[`*]", "", m).lower() for m in re.findall(
        r"^#{1,6} (.+)$", _FENCE.sub("", _read(file)), re.M)]
  found = 0
  for source in _sources():
    if source == pathlib.Path(__file__).resolve():
      continue                                 # the docstring's examples
    text = source.read_text(encoding="utf-8")
    flat = re.sub(r"\s*\n\s*(#\s*)?", " ", text)   # wrapped lines, comments
    for name, section in _REFERENCE.findall(flat):
      found += 1
      assert any(t.startswith(section.lower()) for t in titles[name]), (
          f"{source.relative_to(_ROOT)}: {name}, \"{section}\": no such "
          "heading there")
  assert found >= 2


_PACKAGES = ("dyadic_jax", "sharding", "experiments")


def _architecture_sections():
  """{package: the backticked names of its section} of docs/architecture.md
  ("### `dyadic_jax.bridge`", "### Core: `dyadic_jax`"), the whole text
  under "" (a file's full path may be named anywhere)."""
  text = _read("docs/architecture.md")
  spans = lambda part: set(re.findall(r"`([^`\n]+)`", part))
  sections = {"": spans(text)}
  parts = re.split(r"^### (.+)$", text, flags=re.M)
  for heading, body in zip(parts[1::2], parts[2::2]):
    named = re.findall(r"`([\w.]+)`", heading)
    if named:
      sections[named[-1]] = spans(body)
  return sections


def test_architecture_names_every_module_file():
  """Every module under dyadic_jax/, sharding/ and experiments/ is named in
  docs/architecture.md, in its package's section (the deepest one: the
  core's for dyadic_jax/models/): as `name.py`, a path ending there
  (`qformats/dense.py`, `dyadic_jax/models/pair.py`), or a program by its
  module name (`bench_core`). A package's __init__.py is its folder's
  (`pp1/`, `qformats/`) or its section's."""
  sections = _architecture_sections()
  missing = []
  for package in _PACKAGES:
    for path in sorted((_ROOT / package).rglob("*.py")):
      rel = path.relative_to(_ROOT)
      dotted = ".".join(rel.with_suffix("").parts)
      section = max((s for s in sections if s and (
          dotted == s or dotted.startswith(s + "."))), key=len)
      names = sections[section] | {
          n for n in sections[""] if "/" in n}   # a path, anywhere
      if path.name == "__init__.py":
        folder = rel.parent
        if ".".join(folder.parts) in sections:
          continue                              # the package's own section
        wanted = {f"{'/'.join(folder.parts[i:])}/"
                  for i in range(len(folder.parts))} | {
                      ".".join(folder.parts)}
      else:
        wanted = {"/".join(rel.parts[i:]) for i in range(len(rel.parts))}
        if package == "experiments" and len(rel.parts) == 2:
          wanted.add(path.stem)                 # a program, as it is run
      if not wanted & names:
        missing.append(str(rel))
  assert not missing, (
      f"docs/architecture.md names none of {missing} (in its package's "
      "section: the file, a path ending in it, or a program's module name)")


def test_architecture_names_the_bridges_verification_function():
  """"Layers" says which function the bridge is given to verify with; it
  is the one the bridge's classes default to (it said verify_chain, one
  request, where they call verify_batch)."""
  import inspect  # pylint: disable=g-import-not-at-top
  from dyadic_jax.bridge import engine, generate, verifier  # pylint: disable=g-import-not-at-top
  defaults = {inspect.signature(c).parameters["verify_fn"].default.__name__
              for c in (engine.Engine, verifier.Verifier, generate.Local)}
  assert defaults == {"verify_batch"}, defaults
  text = _read("docs/architecture.md")
  paragraph = text.split("The bridge never imports `sharding`", 1)[1].split(
      "\n\n", 1)[0]
  named = re.findall(r"\b(?:dyadic_jax|sharding)\.(verify_\w+)", paragraph)
  assert named and set(named) == defaults, named


def test_benchmarks_md_gives_the_long_runs_runtime():
  """bench_core and bench_sharding print their tables only at the end,
  minutes in: docs/benchmarks.md says how long each takes, the figure its
  docstring gives (bench_core's is also a slot of experiments/figures.py)."""
  import ast  # pylint: disable=g-import-not-at-top
  text = _read("docs/benchmarks.md")
  for module in ("bench_core", "bench_sharding"):
    section = text.split(f"(`experiments.{module}`)", 1)[1].split(
        "\n## ", 1)[0]
    doc = ast.get_docstring(ast.parse(_read(f"experiments/{module}.py")))
    seconds = re.search(r"[Rr]untime[^.;]*?(\d+) s\b", doc or "")
    assert seconds, f"experiments/{module}.py: no runtime in its docstring"
    assert re.search(rf"[Rr]untime[^.;]*?\b{seconds.group(1)} s\b",
                     section), (
        f"docs/benchmarks.md, {module}'s section: no runtime of "
        f"{seconds.group(1)} s (its docstring's)")
