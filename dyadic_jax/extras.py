"""The optional dependencies: which extra brings each, and one line when
one is missing.

    require(extra, user)   -> None, or MissingExtra naming the extra
    load(module, user)     -> the module, or MissingExtra naming its extra

The core install (`pip install dyadic-jax`) holds what verification and
the bridge need: jax, jaxlib, numpy, chex, absl-py and the wire's own
libraries (crc32c, pyzmq, blake3, cryptography, numba). Everything else is
an extra of pyproject.toml, kept equal to `EXTRAS` by
tests/test_extras.py:

    models        the shipped pair's files (tokenizer.json, safetensors)
                  and GGUF files (SmolLM2)
    train         training a pair (optax), plus models
    experiments   the statistics and plots of the experiments (scipy,
                  matplotlib), plus models
    test          the test suite's tools, plus every extra above

A missing extra is a `MissingExtra` (an ImportError) whose message is one
line: who needs it, the missing module and the install command. Imports
nothing but the standard library, so any entry point may check before it
starts JAX.
"""

import importlib
import importlib.util
import types

# Extra -> the top-level modules it installs (not its packages' names:
# what `import` sees), and the extras it includes.
EXTRAS: dict[str, tuple[str, ...]] = {
    "models": ("tokenizers", "safetensors", "gguf"),
    "train": ("optax",),
    "experiments": ("scipy", "matplotlib"),
}
INCLUDES: dict[str, tuple[str, ...]] = {
    "models": (),
    "train": ("models",),
    "experiments": ("models",),
}
# Module -> the extra that brings it.
_EXTRA_OF = {module: extra for extra, modules in EXTRAS.items()
             for module in modules}


class MissingExtra(ImportError):
  """An optional dependency is not installed; the message says which extra
  to install, in one line."""


def _message(user: str, extra: str, missing: list[str]) -> str:
  return (f"{user}: needs the [{extra}] extra ({', '.join(missing)} "
          f"{'is' if len(missing) == 1 else 'are'} not installed): "
          f"pip install 'dyadic-jax[{extra}]'")


def modules_of(extra: str) -> tuple[str, ...]:
  """Every top-level module `extra` installs, its included extras' too."""
  if extra not in EXTRAS:
    raise ValueError(f"extras: unknown extra {extra!r}, expected one of "
                     f"{sorted(EXTRAS)}")
  included = [m for e in INCLUDES[extra] for m in modules_of(e)]
  return tuple(dict.fromkeys([*included, *EXTRAS[extra]]))


def missing(extra: str) -> list[str]:
  """The modules of `extra` that are not installed (found without
  importing them)."""
  return [m for m in modules_of(extra) if importlib.util.find_spec(m) is None]


def require(extra: str, user: str) -> None:
  """Raises MissingExtra, naming `user`, unless all of `extra` is here."""
  absent = missing(extra)
  if absent:
    raise MissingExtra(_message(user, extra, absent))


def load(module: str, user: str) -> types.ModuleType:
  """Imports `module` (dotted names too); MissingExtra, naming `user` and
  the module's extra, when its top-level package is not installed."""
  top = module.split(".", 1)[0]
  if top not in _EXTRA_OF:
    raise ValueError(f"extras.load: {top!r} belongs to no extra")
  if importlib.util.find_spec(top) is None:
    raise MissingExtra(_message(user, _EXTRA_OF[top], [top]))
  return importlib.import_module(module)
