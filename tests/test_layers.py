"""Imports point one way (docs/architecture.md, "Layers").

Reads every first-party module's imports with `ast` (function-level imports
included, so a lazy import cannot hide an edge) and checks each against the
layer table: the core imports only the core; the models (`dyadic_jax.models`:
the protocols, the toy and trained pairs) only themselves and the core; the
wire only itself and the core; the bridge never `sharding`; `sharding` only itself and the core; no
library layer imports `dyadic_jax.testing` or `experiments`; and
`dyadic_jax.testing/__init__.py` imports nothing (a tool with an optional
dependency, such as zmq, costs nothing to the others). Two more
boundaries: no module reads an underscore name of a first-party module of
another package (`from m import _x`, `m._x`: make it public or move it;
tests may), the protocol sessions import without JAX or ZeroMQ (the
round engine and `generate` without ZeroMQ), and the model protocols
without JAX.
"""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# Layer -> the layers it may import (itself included).
_ALLOWED = {
    "core": {"core"},
    "models": {"models", "core"},
    "wire": {"wire", "core"},
    "bridge": {"bridge", "wire", "models", "core"},
    "sharding": {"sharding", "core"},
    "testing": {"testing", "bridge", "wire", "models", "sharding", "core"},
    "experiments": {"experiments", "testing", "bridge", "wire", "models",
                    "sharding", "core"},
}


def _layer(module):
  """The layer of a dotted first-party module name, or None (third party)."""
  parts = module.split(".")
  if parts[0] == "dyadic_jax":
    sub = parts[1] if len(parts) > 1 else ""
    return sub if sub in ("wire", "bridge", "testing", "models") else "core"
  if parts[0] in ("sharding", "experiments"):
    return parts[0]
  return None


def _module_name(path):
  rel = path.relative_to(_ROOT).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _from_module(node, package):
  """The dotted module of an `ast.ImportFrom` (a relative one resolved
  against `package`, the importing module's package)."""
  base = node.module or ""
  if node.level:
    anchor = package.split(".")
    anchor = anchor[:len(anchor) - node.level + 1]
    base = ".".join(anchor + ([base] if base else []))
  return base


def _imports(source, module, is_package=False):
  """Every module `source` imports, as dotted names (relative ones resolved).

  module: the dotted name of the module the source is.
  """
  tree = ast.parse(source)
  package = module if is_package else module.rpartition(".")[0]
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = _from_module(node, package)
      found.append(base)
      # `from pkg import mod` imports pkg.mod when mod is a module.
      found += [f"{base}.{a.name}" for a in node.names
                if (_ROOT / base.replace(".", "/") / f"{a.name}.py").exists()]
  return found


def _sources():
  for top in ("dyadic_jax", "sharding", "experiments"):
    yield from sorted((_ROOT / top).rglob("*.py"))


# namedtuple's API: public, underscored so as not to clash with fields.
_NAMEDTUPLE = frozenset(("_make", "_replace", "_fields", "_asdict",
                         "_field_defaults"))


def _package_of(name):
  """The package of the first-party module a dotted name lives in (the
  longest prefix that is a module file or a package: a package's own)."""
  parts = name.split(".")
  for n in range(len(parts), 0, -1):
    path = _ROOT.joinpath(*parts[:n])
    if path.is_dir():
      return ".".join(parts[:n])
    if path.with_suffix(".py").exists():
      return ".".join(parts[:n - 1])
  return None


def _private_uses(source, module, is_package=False):
  """Underscore names of other packages' modules that `source` reads:
  `from m import _x` and `m._x` (m bound by an import), as "m._x"."""
  tree = ast.parse(source)
  package = module if is_package else module.rpartition(".")[0]
  bound, found = {}, []

  def private(name):
    return (name.startswith("_") and not name.startswith("__")
            and name not in _NAMEDTUPLE)

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        bound[a.asname or a.name.split(".")[0]] = (
            a.name if a.asname else a.name.split(".")[0])
    elif isinstance(node, ast.ImportFrom):
      base = _from_module(node, package)
      for a in node.names:
        if private(a.name):
          found.append(f"{base}.{a.name}")
        bound[a.asname or a.name] = f"{base}.{a.name}"
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and private(node.attr):
      parts, value = [], node.value
      while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
      if isinstance(value, ast.Name) and value.id in bound:
        found.append(".".join([bound[value.id], *parts[::-1], node.attr]))
  return [name for name in found if _layer(name) is not None
          and _package_of(name) != package]


@pytest.mark.parametrize("path", list(_sources()),
                         ids=lambda p: str(p.relative_to(_ROOT)))
def test_no_private_names_across_packages(path):
  bad = _private_uses(path.read_text(), _module_name(path),
                      path.name == "__init__.py")
  assert not bad, f"{_module_name(path)} reads private names {bad}"


def test_the_private_check_sees_violations():
  assert _private_uses("from dyadic_jax.allocation import _x\n",
                       "experiments.cli") == ["dyadic_jax.allocation._x"]
  assert _private_uses("from dyadic_jax.bridge import verifier\n"
                       "verifier._run(1)\n", "experiments.pp1.main") == [
                           "dyadic_jax.bridge.verifier._run"]
  assert _private_uses("import dyadic_jax.qrows\ndyadic_jax.qrows._f\n",
                       "sharding.ops") == ["dyadic_jax.qrows._f"]
  # Its own package's privates, other objects' and dunders are fine.
  assert not _private_uses("from dyadic_jax import qrows\nqrows._FINE\n"
                           "x._y\nfrom dyadic_jax import __version__\n",
                           "dyadic_jax.qcheck")


def _violations(source, module, is_package=False):
  mine = _layer(module)
  return [m for m in _imports(source, module, is_package)
          if _layer(m) is not None and _layer(m) not in _ALLOWED[mine]]


@pytest.mark.parametrize("path", list(_sources()),
                         ids=lambda p: str(p.relative_to(_ROOT)))
def test_imports_point_one_way(path):
  module = _module_name(path)
  bad = _violations(path.read_text(), module, path.name == "__init__.py")
  assert not bad, f"{module} ({_layer(module)} layer) imports {bad}"


def test_testing_package_imports_nothing_eagerly():
  tree = ast.parse((_ROOT / "dyadic_jax" / "testing" / "__init__.py")
                   .read_text())
  assert not [n for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom))]


# The protocol state machines: pure Python and numpy, no JAX, no ZeroMQ.
_SESSIONS = ("dyadic_jax.bridge.verifier_session",
             "dyadic_jax.bridge.worker_session",
             "dyadic_jax.bridge.shard_link")


def _loaded(modules, watched):
  """Which of `watched` a fresh interpreter holds after importing
  `modules` (sorted)."""
  code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
          + f"print(sorted(m for m in {tuple(watched)!r} "
          "if m in sys.modules))\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=_ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(_ROOT), "PATH": ""})
  assert run.returncode == 0, run.stderr
  return run.stdout.strip()


def test_sessions_import_without_jax_or_zmq():
  """A fresh interpreter imports the sessions (the wire with them) and has
  loaded neither JAX nor ZeroMQ: the drivers and the q formats' kernels
  bring those in on first use."""
  assert _loaded(_SESSIONS, ("jax", "jaxlib", "zmq")) == "[]"


def test_round_engine_and_generate_import_without_zmq():
  """The round's numeric half (`bridge.engine`) and the generation a user
  calls (`bridge.generate`, its `Local` link) load no ZeroMQ: the driver
  comes in with a `Bridged` link's `Verifier`, never with them."""
  assert _loaded(("dyadic_jax.bridge.engine", "dyadic_jax.bridge.generate"),
                 ("zmq",)) == "[]"


def test_model_protocols_import_without_jax():
  """The models layer's protocols (`dyadic_jax.models`: TargetModel,
  DraftModel, their handles and adapters) load no JAX: a model can be
  read and implemented before anything starts."""
  assert _loaded(("dyadic_jax.models",), ("jax", "jaxlib")) == "[]"


def test_the_checker_sees_violations():
  """The harness is not vacuous: lazy and relative imports count too."""
  assert _violations("from dyadic_jax.models import pair\n",
                     "dyadic_jax.weights") == [
                         "dyadic_jax.models", "dyadic_jax.models.pair"]
  assert _violations("from dyadic_jax.bridge import hello\n",
                     "dyadic_jax.models.toy_pair") == [
                         "dyadic_jax.bridge", "dyadic_jax.bridge.hello"]
  lazy = "def f():\n  from dyadic_jax.bridge import worker\n"
  assert _violations(lazy, "dyadic_jax.weights") == [
      "dyadic_jax.bridge", "dyadic_jax.bridge.worker"]
  assert _violations("from .testing import hlo\n", "dyadic_jax.qcodec") == [
      "dyadic_jax.testing", "dyadic_jax.testing.hlo"]
  assert _violations("import sharding\n", "dyadic_jax.bridge.verifier") == [
      "sharding"]
  assert _violations("from experiments import cli\n", "sharding.ops") == [
      "experiments", "experiments.cli"]
  assert not _violations("import numpy\nfrom dyadic_jax import rng\n",
                         "dyadic_jax.bridge.worker")


@pytest.mark.parametrize("package", ["dyadic_jax", "dyadic_jax.bridge"])
def test_lazy_names_are_exactly_the_public_ones(package):
  """The packages load their public names on first use: the name table
  holds exactly `__all__`, and each name resolves to its module's object
  (a name added to one list and not the other fails here, not on use)."""
  module = importlib.import_module(package)
  assert set(module._WHERE) == set(module.__all__)  # pylint: disable=protected-access
  for name in module.__all__:
    assert getattr(module, name) is not None, name
