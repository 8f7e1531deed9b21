"""Test set-up shared by every test file.

Requests 8 emulated CPU devices before JAX starts (multi-device tests skip
when fewer are present, e.g. on a 1-GPU machine), registers the
hypothesis profiles: "ci" (derandomized, the default under CI=true) and
"dev", gives the run one XLA compilation cache (`pytest_configure`),
registers the plugins that keep a long process under the kernel's cap on
memory mappings (tests/memory_maps.py), write the qualification report
(tests/qualify_report.py) and kill whatever process a test left behind
(tests/no_leftovers.py), and provides the `row_mode` fixture.

Row modes (dyadic_jax/rowwise.py): a test that takes the `row_mode`
fixture runs once per mode, "loop" (CPU's default: one vocabulary row at a
time) and "batched" (the accelerators' default: the whole batch at once),
with the op traced in that mode for the test's duration. That is how CI
on CPU runs the accelerators' batched programs. A test that parametrizes
`row_mode` itself (indirect=True) chooses its own modes. Calls with at
most one row run the same program in both modes, so tests made only of
such calls do not take the fixture.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG
                             ).strip()

import hypothesis  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

ROW_MODES = ("loop", "batched")
# The default tier's compiler flags (`_fast_compile`).
FAST_COMPILE = ("--xla_llvm_disable_expensive_passes=true "
                "--xla_backend_optimization_level=0")
# Added to FAST_COMPILE where the installed jaxlib defines it (XLA aborts
# the process on a flag it does not know).
_ELEMENTAL_EMITTERS = "xla_cpu_use_fusion_emitters"

pytest_plugins = [
    "tests.memory_maps",     # a long run stays under the kernel's mappings cap
    "tests.qualify_report",  # -m qualify: --qualify-report (imports the above)
    "tests.no_leftovers",    # no test leaves a process behind
]

hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=60,
    print_blob=True)
hypothesis.settings.register_profile("dev", deadline=None, max_examples=200)
hypothesis.settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE",
                   "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run tests marked slow (long statistical runs)")


def pytest_generate_tests(metafunc):
  if "row_mode" not in metafunc.fixturenames:
    return
  if any("row_mode" in str(m.args[0]) for m in
         metafunc.definition.iter_markers("parametrize")):
    return  # the test chose its modes
  default = _default_mode(metafunc)
  metafunc.parametrize(
      "row_mode",
      [pytest.param(mode, marks=[] if mode == default else [pytest.mark.slow])
       for mode in ROW_MODES],
      indirect=True)


def _default_mode(metafunc):
  """The row mode a `row_mode` test runs in by default; --runslow: both.

  tests/core/test_row_modes.py holds the two modes to the same bits, op by
  op, on shapes where XLA CPU picks different kernels; every other test
  then runs one mode by default, alternating between the test functions of
  its file (in their order of definition) so that each file runs both.
  """
  names = [name for name in vars(metafunc.module) if name.startswith("test")]
  name = metafunc.definition.originalname
  index = names.index(name) if name in names else 0
  return ROW_MODES[index % 2]


@pytest.fixture
def row_mode(request):
  """The row mode of this test run ("loop" or "batched"), entered."""
  from dyadic_jax import rowwise  # pylint: disable=g-import-not-at-top
  with rowwise.scope(request.param) as mode:
    yield mode


def _long_tests_first(items):
  """Puts the tests marked `long` at the head of each half of the run.

  Started last, a minutes-long test leaves the other xdist worker idle for
  its whole run. xdist's worksteal scheduler (pyproject.toml) gives each of
  the README's two workers one half of the collection and lets an idle one
  steal from the back of the other's queue, so the long tests go to the two
  halves' fronts, longest first, each to the half with fewer minutes so far
  (`pytest.mark.long(minutes=m)`, 1 when not given); the rest keep their
  order.
  """
  minutes = lambda item: item.get_closest_marker("long").kwargs.get(
      "minutes", 1)
  long = sorted((item for item in items if "long" in item.keywords),
                key=minutes, reverse=True)
  rest = [item for item in items if "long" not in item.keywords]
  heads, total = ([], []), [0, 0]
  for item in long:
    lighter = int(total[1] < total[0])
    heads[lighter].append(item)
    total[lighter] += minutes(item)
  half = len(items) // 2 - len(heads[1])
  items[:] = heads[0] + rest[:half] + heads[1] + rest[half:]


_OWNED_CACHE = []   # cache directories this process made (and removes)


def pytest_configure(config):
  """One persistent XLA compilation cache for the whole run.

  The suite compiles the same programs in both xdist workers and in every
  subprocess it starts (each pipeline run, the GPU qualification, the
  multi-process tests): about half of a pipeline run is compiling. A
  cache directory made here, before any worker or subprocess starts,
  reaches them all through the environment, so each program is compiled
  once per run. It is a cache (keyed by program, backend and flags), so
  every result is the same bits; it starts empty and is removed at the
  end, so nothing carries over between runs. A JAX_COMPILATION_CACHE_DIR
  already set (.ci/run sets one for pytest and Bazel) is used as it is.
  """
  _fast_compile(config)
  # Programs that compile faster than this are not worth a disk entry.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(
      "JAX_COMPILATION_CACHE_DIR"):
    return
  import tempfile  # pylint: disable=g-import-not-at-top
  path = tempfile.mkdtemp(prefix="dyadic-jax-xla-cache-")
  _OWNED_CACHE.append(path)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path


def _fast_compile(config):
  """The default tier compiles for speed of compiling, not of running.

  The suite is compile-bound (most of its time is XLA compiling programs of
  new shapes). XLA's HLO passes (fusion, layout, simplification) all still
  run; what changes is how the fused computations become machine code:
  LLVM at its lowest optimization level (about 40% of each compile:
  tests/core/test_proposal.py took 62 s as users compile, 47 s this way),
  and XLA CPU's elemental emitters instead of its MLIR fusion emitters
  (half of what was left: the proposal and sharded-proposal tests 45 s ->
  20 s of CPU). Neither changes semantics: no fast-math flag is set, so
  nothing is reassociated, and the pipeline commits the same tokens either
  way (measured at V = 129280, dense q, 64 tokens). --runslow (and so the
  GPU qualification) compiles as users do, so the release check covers the
  users' code generation. Set before any worker or subprocess starts;
  `tests.paths.subprocess_env` passes it on.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if not config.getoption("--runslow") and "optimization_level" not in flags:
    fast = FAST_COMPILE
    if _jaxlib_defines(_ELEMENTAL_EMITTERS):
      fast += f" --{_ELEMENTAL_EMITTERS}=false"
    os.environ["XLA_FLAGS"] = f"{flags} {fast}".strip()


def _jaxlib_defines(flag):
  """Whether the installed jaxlib's libraries name the XLA flag `flag`
  (read without starting XLA: tens of milliseconds)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import mmap  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or spec.origin is None:
    return False
  for library in pathlib.Path(spec.origin).parent.rglob("*.so"):
    with open(library, "rb") as f:
      if os.fstat(f.fileno()).st_size == 0:
        continue
      with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data.find(flag.encode()) >= 0:
          return True
  return False


def pytest_unconfigure(config):
  del config
  import shutil  # pylint: disable=g-import-not-at-top
  for path in _OWNED_CACHE:
    shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  _long_tests_first(items)
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow: run with --runslow (see README)")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)
