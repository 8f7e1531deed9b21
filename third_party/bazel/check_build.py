#!/usr/bin/env python3
"""Checks (or rewrites) the top-level Bazel BUILD file against the sources.

    python3 third_party/bazel/check_build.py          # check, exit 1 on drift
    python3 third_party/bazel/check_build.py --write  # regenerate BUILD
    python3 third_party/bazel/check_build.py --print  # print expected BUILD

Plain Python 3 (stdlib only); it never imports the project's code, it reads
the imports with `ast`.

What it checks (BUILD is evaluated as Python with stand-in rule functions;
its `load` runs pytest_test.bzl the same way, so what is checked of a test is
the py_test the macro really expands to):
  * every *.py under dyadic_jax/, sharding/, experiments/ is the src of a
    py_library, every tests/**/test_*.py the src of a pytest_test (the macro
    of pytest_test.bzl; a bare py_test is an error) whose arguments are right
    (name, src, deps, data, tags, shard_count) and whose expansion is right
    (srcs = [src, PYTEST_MAIN], main = PYTEST_MAIN, args = ["$(rootpath
    src)"], legacy_create_init = False, the pytest config files in data,
    timeout "long" when tagged slow); every other tests/**/*.py (conftest.py,
    helpers) is the src of a py_library;
  * no BUILD file exists below the root (a sub-package would break the
    "dyadic_jax/foo.py" labels of the single top-level BUILD);
  * every target's deps are exactly the first-party modules its file imports,
    plus the package umbrella target (see the rule below), plus, for tests,
    the libraries holding tests/conftest.py and tests/__init__.py;
  * tests carry exactly the tags that the table/markers below call for, and
    the extra deps/data of EXTRA_DEPS/EXTRA_DATA (things no import shows);
  * every src named in BUILD exists;
  * third-party imports are stdlib or in KNOWN_THIRD_PARTY (from the venv);
    anything else is reported as a warning.

"Imports" are every import statement of a file, those under
`if typing.TYPE_CHECKING:` and inside functions included, plus, for a
package __init__.py, the modules its lazy-name table `_WHERE` names (PEP 562
`__getattr__`, as dyadic_jax/__init__.py and dyadic_jax/bridge/__init__.py
have): a name's first use imports its module, which must then be in the
runfiles.

Dependency rule for packages: importing `pkg.mod` runs pkg/__init__.py first.
  * Code outside `pkg` that imports pkg.mod depends on //:pkg_mod AND //:pkg
    (the umbrella holding pkg/__init__.py and the modules it imports or
    loads lazily).
  * Code inside `pkg` that imports a sibling depends on the sibling only:
    whoever imported it has already run pkg/__init__.py. Depending on the
    umbrella from inside would be a cycle, which Bazel rejects. A module inside
    a package that imports from the package's own __init__ is reported as an
    error (it is a circular import in Python as well).
"""

import argparse
import ast
import os
import pprint
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LIB_DIRS = ("dyadic_jax", "sharding", "experiments")
TEST_DIR = "tests"
# The macro every test is written with. PYTEST_MAIN and the pytest config
# files are defined there only; the checks read them from the file.
MACRO_FILE = "pytest_test.bzl"
MACRO_LABEL = "//:" + MACRO_FILE
MACRO = "pytest_test"

# Top-level modules that come from the virtualenv interpreter, not Bazel.
KNOWN_THIRD_PARTY = {
    "absl", "chex", "crc32c", "hypothesis", "jax", "jaxlib", "matplotlib",
    "mpl_toolkits", "ml_dtypes", "numpy", "pytest", "_pytest", "scipy",
    "zmq", "atheris", "blake3", "numba", "cryptography",
    # The shipped draft/target pair (dyadic_jax/models, experiments/train_pair).
    "tokenizers", "optax", "safetensors",
    # experiments/hf_peer.py runs under a peer's own interpreter (bench_core's
    # --hf_python), never under the project's venv or Bazel.
    "torch", "transformers",
}

# Extra tags for tests whose markers do not say it, by target name; e.g.
# {"test_round_demo": ["slow"]}. Tags found from the sources:
#   "slow":        a module-level `pytestmark` that includes pytest.mark.slow
#                  (a per-test @pytest.mark.slow is not enough: the file would
#                  leave //:fast; split such a file, or list it here).
#   "multidevice": pytest.mark.multidevice anywhere in the file, or a file
#                  that imports the `sharding` package or jax.sharding, or
#                  calls jax.device_count()/jax.devices()/Mesh(...).
# The subprocess-driven end-to-end tests (the pipeline, the soak, the fuzz
# run, the experiments' smoke runs) are in the README's pytest command; in
# Bazel they run under //:slow only, so that CI's //:fast pass does not run
# the heaviest minutes twice.
EXTRA_TAGS = {name: ["slow"] for name in (
    "experiments_test_pp1_pipeline", "system_test_soak", "system_test_fuzz_wire", "experiments_test_acceptance_fleet",
    "experiments_test_bench_bridge", "system_test_fuzz_sessions", "system_test_audit_drill",
    "bridge_test_hardening", "system_test_qualify",
    # mypy reads the whole source tree, which a Bazel sandbox holding only
    # the target's runfiles does not have; the README's pytest command runs it.
    "test_typecheck")}

# The smoke set CI runs under Bazel after building every target (the README's
# pytest command runs every test; Bazel's own value is that each target
# builds and its declared deps suffice): one quick file per layer.
SMOKE = ("core_test_qcodec", "core_test_rng", "wire_test_validate",
         "bridge_test_keys", "sharding_test_mesh")

# Bazel shards of the heaviest files (third_party/bazel/pytest_main.py deals
# their tests out round-robin): one process per file would otherwise run
# tens of compiles in a row and pass the "moderate" timeout on 2 loaded cores.
SHARD_COUNTS = {"sharding_test_ops": 4, "core_test_allocation": 2, "core_test_row_modes": 2}

# Deps and data that a file's import statements do not show, by target name:
# test_docs execs the code blocks of README.md and docs/*.md (dyadic_jax,
# sharding, the bridge, the toy and trained models) and runs the experiments
# its commands name with --helpfull;
# test_multiprocess starts tests/multiprocess_worker.py as a subprocess;
# test_cli runs every experiment as a subprocess.
EXTRA_DEPS = {"test_docs": ["dyadic_jax", "sharding", "dyadic_jax_bridge",
                            "dyadic_jax_models_toy_pair",
                            "dyadic_jax_models_pair"] + [
                                f"experiments_{m}" for m in (
                                    "pp1_pipeline", "bridge_worker",
                                    "acceptance", "selection_bias",
                                    "bench_core", "bench_sharding",
                                    "bench_rank_links", "bench_bridge",
                                    "bench_host", "bench_pair", "train_pair",
                                    "wire_sizes")],
              "system_test_multiprocess": ["tests_multiprocess_worker"],
              "experiments_test_wire_sizes": ["experiments_wire_sizes"],
              "experiments_test_pp1_pipeline": ["experiments_pp1_pipeline",
                                "experiments_bridge_worker"],
              "system_test_worker_process": ["experiments_bridge_worker"],
              "system_test_audit_drill": ["experiments_pp1_pipeline",
                                    "experiments_bridge_worker"],
              "experiments_test_acceptance_fleet": ["experiments_acceptance",
                                   "experiments_selection_bias",
                                   "experiments_wire_sizes"],
              "experiments_test_bench_bridge": ["experiments_bench_bridge"],
              "experiments_test_bench_host": ["experiments_bench_host"],
              "experiments_test_cli": ["experiments_pp1_pipeline",
                           "experiments_bridge_worker",
                           "experiments_round_demo", "experiments_acceptance",
                           "experiments_selection_bias",
                           "experiments_wire_sizes",
                           "experiments_bench_sharding",
                           "experiments_pipeline_config",
                           "experiments_record_figures",
                           "experiments_train_pair"],
              # test_figures reads the docstrings the figures are quoted in.
              "test_figures": ["experiments_pp1_pipeline",
                               "experiments_acceptance",
                               "experiments_bench_core"],
              # The benchmark runs bench_core as a subprocess.
              "system_test_qualify": ["experiments_bench_core"],
              # conftest.py loads its plugins through pytest_plugins.
              "tests_conftest": ["tests_no_leftovers",
                                 "tests_qualify_report"],
              "system_test_fuzz_wire": ["tests_fuzz_wire"]}
_CORPUS = "tests/fuzz_corpus/wire"
_CHECKPOINT = "dyadic_jax/models/checkpoints/stdlib"
_DOCS = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(
    os.path.join(ROOT, "docs")) if f.endswith(".md"))
EXTRA_DATA = {"test_docs": _DOCS + ["docs/bench_pair.png",
                                    "docs/pp1_pipeline.png"],
              # They read the guide's bridge example and GPU command.
              "test_extras": ["docs/guide.md"],
              "system_test_qualify": ["docs/guide.md"],
              "test_figures": ["README.md", "docs/figures.json"],
              "system_test_fuzz_wire": sorted(
                  f"{_CORPUS}/{f}" for f in os.listdir(os.path.join(
                      ROOT, _CORPUS)) if f.endswith(".bin")),
              "wire_test_codec": ["docs/wire.md"],
              "bridge_test_pinned_tokens": [
                  "tests/bridge/pinned_tokens.json"],
              # The shipped pair's checkpoint (weights, tokenizer, config).
              "models_test_checkpoint": sorted(
                  f"{_CHECKPOINT}/{f}" for f in (os.listdir(os.path.join(
                      ROOT, _CHECKPOINT)) if os.path.isdir(os.path.join(
                          ROOT, _CHECKPOINT)) else ()))}

# Test files that must NOT be tagged "multidevice" despite the heuristics.
NOT_MULTIDEVICE = set()

MULTIDEVICE_HINTS = (
    "mark.multidevice", "jax.sharding", "device_count(", "jax.devices(",
    "Mesh(", "shard_map", "NamedSharding", "PositionalSharding",
)


class Error(Exception):
  pass


def rel(path):
  return os.path.relpath(path, ROOT).replace(os.sep, "/")


def walk_py(top):
  out = []
  base = os.path.join(ROOT, top)
  for dirpath, dirnames, filenames in os.walk(base):
    dirnames[:] = sorted(d for d in dirnames
                         if d != "__pycache__" and not d.startswith("."))
    for f in sorted(filenames):
      if f.endswith(".py"):
        out.append(rel(os.path.join(dirpath, f)))
  return out


def module_of(path):
  """Dotted module name of a repo-relative .py path."""
  mod = path[:-3].replace("/", ".")
  if mod.endswith(".__init__"):
    mod = mod[: -len(".__init__")]
  return mod


def target_of(path):
  """Bazel target name of a repo-relative .py path."""
  if path.startswith(TEST_DIR + "/"):
    stem = path[len(TEST_DIR) + 1:-3]
    base = os.path.basename(stem)
    if base.startswith("test_"):
      return stem.replace("/", "_")
    if base == "__init__":
      return (TEST_DIR + "/" + stem)[: -len("/__init__")].replace("/", "_")
    return TEST_DIR + "_" + stem.replace("/", "_")
  return module_of(path).replace(".", "_")


class Project:

  def __init__(self):
    self.lib_files = []
    for d in LIB_DIRS:
      self.lib_files += walk_py(d)
    tests = walk_py(TEST_DIR)
    self.test_files = [f for f in tests
                       if os.path.basename(f).startswith("test_")]
    self.support_files = [f for f in tests if f not in self.test_files]
    if os.path.exists(os.path.join(ROOT, "conftest.py")):
      self.support_files.insert(0, "conftest.py")
    self.all_files = self.lib_files + self.support_files + self.test_files

    # module name -> file. tests/ files are also importable by their bare
    # name (pytest's default "prepend" import mode puts the test's
    # directory on sys.path when tests/ is not a package).
    self.modules = {}
    for f in self.all_files:
      self.modules[module_of(f)] = f
      if f.startswith(TEST_DIR + "/") and not os.path.exists(
          os.path.join(ROOT, os.path.dirname(f), "__init__.py")):
        self.modules.setdefault(os.path.basename(f)[:-3], f)
    self.first_party_tops = ({m.split(".")[0] for m in self.modules} |
                             set(LIB_DIRS) | {TEST_DIR})
    self.packages = {module_of(f) for f in self.all_files
                     if f.endswith("/__init__.py")}
    self.errors = []
    self.warnings = []

  def package_of(self, path):
    mod = module_of(path)
    if path.endswith("__init__.py"):
      return mod
    return mod.rpartition(".")[0]

  def imports(self, path):
    """Returns (first-party module names, third-party top-level names)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
      source = fh.read()
    try:
      tree = ast.parse(source, filename=path)
    except SyntaxError as e:
      raise Error(f"{path}: cannot parse: {e}") from e
    pkg = self.package_of(path)
    names = []
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names += [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          parts = pkg.split(".") if pkg else []
          if node.level - 1 > len(parts):
            self.errors.append(f"{path}: relative import beyond top level")
            continue
          parts = parts[: len(parts) - (node.level - 1)]
          base = ".".join(parts + ([node.module] if node.module else []))
        else:
          base = node.module
        for a in node.names:
          cand = f"{base}.{a.name}" if base else a.name
          names.append(cand if cand in self.modules else base)
    if path.endswith("/__init__.py"):
      names += [f"{pkg}.{m}" for m in self._lazy_modules(path, tree)]
    first, third = set(), set()
    for name in names:
      if not name:
        continue
      top = name.split(".")[0]
      if name in self.modules or top in self.first_party_tops:
        # Longest known module prefix.
        parts = name.split(".")
        while parts and ".".join(parts) not in self.modules:
          parts.pop()
        if not parts:
          self.errors.append(f"{path}: imports {name}, which has no file")
          continue
        first.add(".".join(parts))
      else:
        third.add(top)
    return first, third, source

  def _lazy_modules(self, path, tree):
    """Submodules a package __init__.py's lazy-name table `_WHERE` can load.

    `_WHERE` maps a public name to the submodule that defines it ("": the
    name is a submodule itself); __getattr__ imports that module on the
    name's first use. Entries are `"name": "module"` or
    `**dict.fromkeys(("name", ...), "module")`.
    """
    out = []
    for node in tree.body:
      if not (isinstance(node, ast.Assign) and
              any(isinstance(t, ast.Name) and t.id == "_WHERE"
                  for t in node.targets)):
        continue
      if not isinstance(node.value, ast.Dict):
        self.errors.append(f"{path}:{node.lineno}: _WHERE is not a dict "
                           "display; check_build.py cannot read it")
        continue
      for key, value in zip(node.value.keys, node.value.values):
        if key is None:  # **dict.fromkeys(("a", "b"), "module")
          ok = (isinstance(value, ast.Call) and
                ast.unparse(value.func) == "dict.fromkeys" and
                len(value.args) == 2 and
                isinstance(value.args[0], (ast.Tuple, ast.List)))
          if ok:
            keys, where = value.args[0].elts, value.args[1]
        else:
          ok, keys, where = True, [key], value
        if not ok or not all(_is_str(k) for k in keys + [where]):
          self.errors.append(f"{path}:{value.lineno}: _WHERE entry "
                             f"{ast.unparse(value)!r}: check_build.py reads "
                             '"name": "module" and **dict.fromkeys((names), '
                             '"module") only')
          continue
        out += [where.value or k.value for k in keys]
    return out

  def expected(self):
    """Expected targets: name -> dict(kind, srcs, deps, tags)."""
    # Every test depends on the conftest.py and __init__.py files of its
    # directory and those above it (pytest loads them without an import
    # statement); other helper modules only where imported.
    support_files = [f for f in self.support_files
                     if os.path.basename(f) in ("conftest.py", "__init__.py")]
    stdlib = set(getattr(sys, "stdlib_module_names", ()))
    targets = {}
    for path in self.all_files:
      first, third, source = self.imports(path)
      own = module_of(path)
      deps = set()
      for mod in first:
        if mod == own:
          continue
        dep_file = self.modules[mod]
        dep_mod = module_of(dep_file)
        if dep_mod in self.packages and (own + ".").startswith(dep_mod + "."):
          self.errors.append(
              f"{path}: imports its own package's __init__ ({dep_mod}); "
              "import the defining module instead (cycle)")
          continue
        deps.add(target_of(dep_file))
        parts = dep_mod.split(".")
        for i in range(1, len(parts)):
          anc = ".".join(parts[:i])
          if anc in self.packages and not (own + ".").startswith(anc + "."):
            deps.add(target_of(self.modules[anc]))
      for top in sorted(third):
        if top not in stdlib and top not in KNOWN_THIRD_PARTY:
          self.warnings.append(
              f"{path}: imports {top!r}: not stdlib nor a known venv package")
      name = target_of(path)
      deps |= set(EXTRA_DEPS.get(name, ()))
      entry = {"srcs": [path], "deps": deps, "tags": set(),
               "data": list(EXTRA_DATA.get(name, ()))}
      if path in self.test_files:
        entry["kind"] = "py_test"
        # Only the conftest/__init__ files of the test's own directory and
        # those above it: pytest loads no others for it.
        here = os.path.dirname(path) + "/"
        entry["deps"] |= {target_of(f) for f in support_files
                          if here.startswith(os.path.dirname(f) + "/")}
        tags = set(EXTRA_TAGS.get(name, ()))
        if name in SMOKE:
          tags.add("smoke")
        if _module_level_slow(source):
          tags.add("slow")
        if name not in NOT_MULTIDEVICE and (
            any(h in source for h in MULTIDEVICE_HINTS) or
            any(m == "sharding" or m.startswith("sharding.") for m in first)):
          tags.add("multidevice")
        entry["tags"] = tags
      else:
        entry["kind"] = "py_library"
      if name in targets:
        self.errors.append(f"two files map to target {name}: "
                           f"{targets[name]['srcs'][0]} and {path}")
      targets[name] = entry
    return targets


def _is_str(node):
  return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _module_level_slow(source):
  tree = ast.parse(source)
  for node in tree.body:
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
      tgts = node.targets if isinstance(node, ast.Assign) else [node.target]
      if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in tgts):
        if "mark.slow" in ast.unparse(node.value):
          return True
  return False


# --------------------------------------------------------------------------
# BUILD rendering.

HEADER = '''\
# Bazel build of dyadic-jax (Bazel 4.2.x, e.g. Debian's bazel-bootstrap).
#
# Run:    bash .ci/bazel_test.sh /path/to/venv/bin/python [//:smoke | //:fast]
# Check:  python3 third_party/bazel/check_build.py   (--write regenerates this
#         file from the sources' imports; tags: see EXTRA_TAGS there)
#
# Third-party packages (jax, jaxlib, numpy, scipy, chex, absl-py, hypothesis,
# pytest, matplotlib) are NOT Bazel targets and there are no pip rules: they
# come from the Python interpreter that runs the tests, a virtualenv chosen
# with --python_path (.bazelrc turns off Python toolchains so that flag is
# honoured). Only first-party code is modelled here.
#
# One BUILD file for the whole repo: dyadic_jax/, sharding/, experiments/ and
# tests/ are plain directories without BUILD files, so their files are
# labelled "dyadic_jax/foo.py" from here.
#
# Targets: one py_library per module, named after its dotted module path
# (dyadic_jax/qcodec.py -> //:dyadic_jax_qcodec); the library for a package's
# __init__.py is named after the package (//:dyadic_jax).
#
# Package __init__.py files. dyadic_jax/__init__.py and
# dyadic_jax/bridge/__init__.py load their public names lazily (PEP 562): a
# module-level __getattr__ imports the module that their _WHERE table names
# for a name on its first use (dyadic_jax.verify_chain imports
# dyadic_jax.verification then). They import those modules under
# typing.TYPE_CHECKING only; at run time dyadic_jax/__init__.py imports
# dyadic_jax.rowsetting alone. Importing any dyadic_jax.X still runs
# dyadic_jax/__init__.py first, and a name's module must be in the runfiles
# by its first use, so check_build.py counts the TYPE_CHECKING imports and
# the modules _WHERE names as imports of __init__.py.
# A module target cannot carry __init__.py (or depend on a target that does):
# __init__ -> X -> __init__ is a dependency cycle, which Bazel rejects; an
# __init__-only target without the module deps would put an __init__.py in
# the runfiles whose names fail on first use. So:
#   * //:dyadic_jax_X has srcs = [dyadic_jax/X.py] and deps = the sibling
#     modules X imports. Imports inside the package need no __init__ target:
#     whoever imported X has already run dyadic_jax/__init__.py.
#   * //:dyadic_jax (the umbrella) has srcs = [dyadic_jax/__init__.py] and
#     deps = the modules __init__.py imports or loads lazily (every module of
#     _WHERE); //:dyadic_jax_bridge likewise.
#   * Code outside the package (tests, sharding, experiments) depends on the
#     //:dyadic_jax_X modules it imports AND on //:dyadic_jax, so the real
#     __init__.py and every module its names load is in its runfiles.
# The same rule applies to sharding/ (whose __init__.py imports its modules)
# and experiments/.
#
# Tests: one pytest_test per tests/**/test_*.py. The macro (pytest_test.bzl,
# loaded below; at the root so that it needs no package of its own) expands
# to a py_test with srcs = [src, PYTEST_MAIN], main = PYTEST_MAIN
# (third_party/bazel/pytest_main.py, which runs the file through pytest; it
# gets the file via args = ["$(rootpath src)"]), data = the pytest config
# files + data, timeout "long" when tagged slow, and legacy_create_init =
# False, which stops Bazel from adding empty __init__.py files to the
# runfiles (one would turn tests/ into a package, or could stand in for a
# missing dyadic_jax/__init__.py). The runfiles root is on sys.path (Bazel's
# Python stub does that), so "import dyadic_jax" works; the workspace must
# not be named "dyadic_jax" (see WORKSPACE). Non-test files in tests/ are
# libraries too: every test depends on tests/conftest.py and the __init__.py
# files of its directory and those above it, helpers only where imported.
# Tags: "slow" (module-level pytestmark = pytest.mark.slow, or EXTRA_TAGS in
# check_build.py), "multidevice" (uses several devices) and "smoke" (SMOKE in
# check_build.py: one quick file per layer).
# //:fast = every test not tagged slow; //:slow; //:multidevice; //:smoke.
# CI builds //... (every target analyzes and builds) and runs //:smoke; the
# README's pytest command is what runs every test.
'''

PRELUDE = f'load("{MACRO_LABEL}", "{MACRO}")\n'

SUITES = '''\
test_suite(
    name = "fast",
    tags = ["-slow"],
)

test_suite(
    name = "slow",
    tags = ["slow"],
)

test_suite(
    name = "multidevice",
    tags = ["multidevice"],
)

test_suite(
    name = "smoke",
    tags = ["smoke"],
)
'''


def _list(items, indent="    "):
  items = list(items)
  if not items:
    return "[]"
  if len(items) == 1:
    return "[" + items[0] + "]"
  inner = "".join(f"{indent}    {i},\n" for i in items)
  return "[\n" + inner + indent + "]"


def _q(s):
  return '"' + s + '"'


def _deps(deps):
  return _list([_q(":" + d) for d in sorted(deps)])


def render(targets):
  out = [HEADER, PRELUDE]
  groups = [
      ("Library: " + d + "/", lambda p, d=d: p.startswith(d + "/"))
      for d in LIB_DIRS
  ] + [
      ("Test support (conftest.py and helpers)",
       lambda p: not os.path.basename(p).startswith("test_")),
      ("Tests", lambda p: True),
  ]
  done = set()
  for title, pred in groups:
    names = [n for n, t in targets.items()
             if n not in done and pred(t["srcs"][0])]
    if not names:
      continue
    out.append("# " + "-" * 74 + "\n# " + title + "\n")
    for n in sorted(names, key=lambda n: targets[n]["srcs"][0]):
      done.add(n)
      t = targets[n]
      src = t["srcs"][0]
      if t["kind"] == "py_library":
        out.append(
            "py_library(\n"
            f"    name = {_q(n)},\n"
            f"    srcs = [{_q(src)}],\n"
            f"    deps = {_deps(t['deps'])},\n"
            ")\n")
      else:
        tags = sorted(t["tags"])
        extra = ""
        if t["data"]:
          extra += f"    data = {_list([_q(d) for d in t['data']])},\n"
        if n in SHARD_COUNTS:
          extra += f"    shard_count = {SHARD_COUNTS[n]},\n"
        if tags:
          extra += f"    tags = {_list([_q(x) for x in tags])},\n"
        out.append(
            f"{MACRO}(\n"
            f"    name = {_q(n)},\n"
            f"    src = {_q(src)},\n"
            + extra +
            f"    deps = {_deps(t['deps'])},\n"
            ")\n")
  out.append("# " + "-" * 74 + "\n# Test suites\n")
  out.append(SUITES)
  return "\n".join(out)


# --------------------------------------------------------------------------
# BUILD parsing (the BUILD file is evaluated with stand-in rule functions;
# its load() evaluates the .bzl file the same way).

def glob(include, exclude=(), allow_empty=True, **_):
  """Stand-in for Bazel's glob() in the root package."""
  import glob as globmod  # pylint: disable=g-import-not-at-top
  out = []
  for pat in include:
    for f in sorted(globmod.glob(os.path.join(ROOT, pat), recursive=True)):
      r = rel(f)
      if r not in exclude and os.path.isfile(f):
        out.append(r)
  if not out and not allow_empty:
    raise Error(f"glob({include}) matches nothing")
  return out


def load_build(path):
  """Evaluates BUILD; returns (rules, the globals of the macro's .bzl file).

  rules: name -> the rule's attributes plus "kind"; a rule a macro created
  also has "macro": (macro name, the macro's keyword arguments).
  """
  rules = {}
  loaded = {}

  def rule(kind):
    def fn(**kw):
      name = kw["name"]
      if name in rules:
        raise Error(f"BUILD: duplicate target {name}")
      kw["kind"] = kind
      rules[name] = kw
    return fn

  def fail(msg, *_, **__):
    raise Error(f"fail(): {msg}")

  rule_fns = {
      "py_library": rule("py_library"),
      "py_test": rule("py_test"),
      "py_binary": rule("py_binary"),
      "test_suite": rule("test_suite"),
      "filegroup": rule("filegroup"),
      "exports_files": lambda *a, **k: None,
      "package": lambda **k: None,
      "licenses": lambda *a, **k: None,
      "glob": glob,
      "select": lambda d: d.get("//conditions:default", []),
  }

  def traced(macro, fn):
    """`fn`, recording on each rule it creates that `macro` made it."""
    def call(*args, **kw):
      if args:
        raise Error(f"BUILD: call {macro} with keyword arguments only")
      before = set(rules)
      fn(**kw)
      for name in set(rules) - before:
        rules[name]["macro"] = (macro, kw)
    return call

  def load(label, *symbols, **aliases):
    if not (label.startswith("//:") and label.endswith(".bzl")):
      raise Error(f"BUILD: load({label!r}): only .bzl files of the root "
                  "package (//:name.bzl) are understood here")
    if label not in loaded:
      loaded[label] = load_bzl(os.path.join(ROOT, label[3:]), rule_fns, fail)
    bzl = loaded[label]
    for local, symbol in [(s, s) for s in symbols] + list(aliases.items()):
      if symbol.startswith("_") or symbol not in bzl:
        raise Error(f"BUILD: load({label!r}): no public symbol {symbol!r}")
      value = bzl[symbol]
      env[local] = traced(symbol, value) if callable(value) else value

  env = dict(rule_fns, load=load, fail=fail)
  with open(path, encoding="utf-8") as fh:
    code = fh.read()
  exec(compile(code, path, "exec"), env)  # pylint: disable=exec-used
  return rules, loaded.get(MACRO_LABEL)


def load_bzl(path, rule_fns, fail):
  """Evaluates a .bzl file; `native.X` are the stand-in rule functions."""
  with open(path, encoding="utf-8") as fh:
    code = fh.read()
  env = {"native": types.SimpleNamespace(**rule_fns), "fail": fail}
  exec(compile(code, path, "exec"), env)  # pylint: disable=exec-used
  return env


def _label(d):
  return d[1:] if d.startswith(":") else d.replace("//:", "")


def check(project, targets):
  errors = list(project.errors)
  build = os.path.join(ROOT, "BUILD")
  if not os.path.exists(build):
    return errors + ["no BUILD file at the repo root"]
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames
                   if not d.startswith(".") and not d.startswith("bazel-")]
    if dirpath == ROOT:
      continue
    if "WORKSPACE" in filenames or "WORKSPACE.bazel" in filenames:
      dirnames[:] = []  # a separate (stand-in) repository
      continue
    for b in ("BUILD", "BUILD.bazel"):
      if b in filenames:
        errors.append(f"{rel(os.path.join(dirpath, b))}: only the top-level "
                      "BUILD may exist (it would cut the root package)")
  try:
    rules, bzl = load_build(build)
  except Exception as e:  # pylint: disable=broad-except
    return errors + [f"BUILD: cannot evaluate: {e!r}"]
  if bzl is None or bzl.get(MACRO) is None:
    return errors + [f"BUILD: does not load({MACRO_LABEL!r}, {MACRO!r})"]
  pytest_main = bzl["PYTEST_MAIN"]
  if not os.path.isfile(os.path.join(ROOT, pytest_main)):
    errors.append(f"{MACRO_FILE}: PYTEST_MAIN {pytest_main} does not exist")
  # What the macro's native.glob of the pytest config files gives.
  pytest_config = glob(bzl["PYTEST_CONFIG_FILES"])

  owner = {}
  for name, r in rules.items():
    for s in r.get("srcs", []):
      if s == pytest_main:
        continue
      if not os.path.exists(os.path.join(ROOT, s)):
        errors.append(f"//:{name}: src {s} does not exist")
      owner.setdefault(s, []).append(name)
  for path in project.all_files:
    if path not in owner:
      errors.append(f"{path}: not in BUILD (expected //:{target_of(path)})")

  for name, exp in sorted(targets.items()):
    r = rules.get(name)
    path = exp["srcs"][0]
    if r is None:
      if path in owner:
        errors.append(f"{path}: expected target //:{name}, found "
                      f"{', '.join('//:' + o for o in owner[path])}")
      continue
    if r["kind"] != exp["kind"]:
      errors.append(f"//:{name}: is {r['kind']}, expected {exp['kind']}")
    got_srcs = [s for s in r.get("srcs", []) if s != pytest_main]
    if got_srcs != exp["srcs"]:
      errors.append(f"//:{name}: srcs {got_srcs}, expected {exp['srcs']}")
    got = {_label(d) for d in r.get("deps", [])}
    missing, extra = exp["deps"] - got, got - exp["deps"]
    if missing:
      errors.append(f"//:{name}: missing deps "
                    f"{sorted(':' + d for d in missing)} (imported by {path})")
    if extra:
      errors.append(f"//:{name}: deps not imported by {path}: "
                    f"{sorted(':' + d for d in extra)}")
    if exp["kind"] == "py_test":
      errors += _check_test(name, path, exp, r, pytest_main, pytest_config)
  suites = {n: r for n, r in rules.items() if r["kind"] == "test_suite"}
  if "fast" not in suites or "-slow" not in suites["fast"].get("tags", []):
    errors.append("//:fast test_suite (tags = [\"-slow\"]) is missing")
  for name in SMOKE:
    if name not in rules or rules[name]["kind"] != "py_test":
      errors.append(f"SMOKE names //:{name}, which is not a test target")
  return errors


def _check_test(name, path, exp, r, pytest_main, pytest_config):
  """Errors of test target `name`: its pytest_test call, and the py_test."""
  errors = []
  macro, kw = r.get("macro", (None, {}))
  if macro != MACRO:
    return [f"//:{name}: write it as {MACRO}(name = {name!r}, src = "
            f"{path!r}, ...), the macro of {MACRO_FILE}, not a bare "
            f"{r['kind']}"]
  # The macro's arguments (deps: checked on the py_test above).
  if kw.get("src") != path:
    errors.append(f"//:{name}: src = {kw.get('src')!r}, expected {path!r}")
  if sorted(kw.get("data", [])) != sorted(exp["data"]):
    errors.append(f"//:{name}: data = {sorted(kw.get('data', []))}, "
                  f"expected {sorted(exp['data'])}")
  got_tags = set(kw.get("tags", []))
  if got_tags != exp["tags"]:
    errors.append(f"//:{name}: tags = {sorted(got_tags)}, expected "
                  f"{sorted(exp['tags'])}")
  if kw.get("shard_count") != SHARD_COUNTS.get(name):
    errors.append(f"//:{name}: shard_count = {kw.get('shard_count')}, "
                  f"expected {SHARD_COUNTS.get(name)} (SHARD_COUNTS)")
  # What the macro expanded it to.
  srcs = r.get("srcs", [])
  if r.get("main") != pytest_main or pytest_main not in srcs:
    errors.append(f"//:{name}: main must be {pytest_main} (also in srcs)")
  if r.get("args", [None])[0] not in (f"$(rootpath {path})",
                                      f"$(location {path})"):
    errors.append(f"//:{name}: args[0] must be $(rootpath {path})")
  if r.get("legacy_create_init", True):
    errors.append(f"//:{name}: needs legacy_create_init = False")
  missing_data = set(exp["data"] + pytest_config) - set(r.get("data", []))
  if missing_data:
    errors.append(f"//:{name}: missing data {sorted(missing_data)}")
  missing_tags = exp["tags"] - set(r.get("tags", []))
  if missing_tags:
    errors.append(f"//:{name}: missing tags {sorted(missing_tags)}")
  if "slow" in exp["tags"] and r.get("timeout") not in ("long", "eternal"):
    errors.append(f"//:{name}: tagged slow, needs timeout \"long\"")
  return errors


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--write", action="store_true", help="rewrite BUILD")
  ap.add_argument("--print", action="store_true", help="print expected BUILD")
  ap.add_argument("--dump", action="store_true",
                  help="print the expected targets as Python data")
  args = ap.parse_args()
  project = Project()
  try:
    targets = project.expected()
  except Error as e:
    print(f"check_build: {e}", file=sys.stderr)
    return 1
  for w in project.warnings:
    print(f"check_build: warning: {w}", file=sys.stderr)
  if args.dump:
    pprint.pprint(targets)
    return 0
  if args.print or args.write:
    if project.errors:
      for e in project.errors:
        print(f"check_build: error: {e}", file=sys.stderr)
      return 1
    text = render(targets)
    if args.print:
      sys.stdout.write(text)
    else:
      with open(os.path.join(ROOT, "BUILD"), "w", encoding="utf-8") as fh:
        fh.write(text)
      print(f"check_build: wrote BUILD ({len(targets)} targets)")
    return 0
  errors = check(project, targets)
  for e in errors:
    print(f"check_build: error: {e}", file=sys.stderr)
  if errors:
    print(f"check_build: {len(errors)} problem(s); "
          "`python3 third_party/bazel/check_build.py --write` regenerates "
          "BUILD", file=sys.stderr)
    return 1
  n_test = sum(1 for t in targets.values() if t["kind"] == "py_test")
  print(f"check_build: OK ({len(targets) - n_test} libraries, {n_test} tests, "
        f"{len(project.all_files)} files)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
