"""Entry point of every test in //:BUILD: runs one pytest file under Bazel.

Usage (set up by BUILD's `pytest_test(name = ..., src = "tests/test_x.py",
...)`, the macro of //:pytest_test.bzl, not by hand): it expands to
    py_test(
        srcs = ["tests/test_x.py", "third_party/bazel/pytest_main.py"],
        main = "third_party/bazel/pytest_main.py",
        args = ["$(rootpath tests/test_x.py)"],
        ...
    )

argv[1] is the test file relative to the runfiles workspace root (the
working directory Bazel starts tests in); any further arguments
(`bazel test --test_arg=...`) are passed on to pytest.

Nothing is written into the read-only runfiles/source tree: no
.pytest_cache (cacheprovider disabled), no __pycache__ (bytecode writing
off), and Hypothesis' example database, matplotlib's config dir and HOME go
to $TEST_TMPDIR.

Bazel test sharding (`shard_count` in BUILD): this runner touches
$TEST_SHARD_STATUS_FILE to say it shards, then keeps the collected tests whose
position i satisfies i % $TEST_TOTAL_SHARDS == $TEST_SHARD_INDEX, so a heavy
file's parametrized cases spread over the shards round-robin.
"""

import os
import sys
import tempfile


def _scrub_sys_path():
  # Python puts the *resolved* directory of this script (a symlink in the
  # runfiles tree) first on sys.path, i.e. third_party/bazel/ in the real
  # source checkout. Drop it so that imports only see the runfiles tree.
  here = os.path.dirname(os.path.realpath(__file__))
  if sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == here:
    del sys.path[0]


def main(argv):
  if len(argv) < 2:
    sys.stderr.write("usage: pytest_main.py TEST_FILE [pytest args...]\n")
    return 2
  test_file = argv[1]
  _scrub_sys_path()
  sys.dont_write_bytecode = True
  os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # for any subprocesses

  tmp = os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp(prefix="pytest_main")
  os.environ.setdefault("HOME", tmp)
  os.environ.setdefault("MPLCONFIGDIR", os.path.join(tmp, "matplotlib"))
  os.environ.setdefault("MPLBACKEND", "Agg")

  import pytest  # pylint: disable=g-import-not-at-top

  args = [
      test_file,
      "-q",
      "-p", "no:cacheprovider",
      "--rootdir", os.getcwd(),
  ]
  xml_output = os.environ.get("XML_OUTPUT_FILE")
  if xml_output:
    args += ["--junitxml", xml_output]
  test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")  # bazel --test_filter
  if test_filter:
    args += ["-k", test_filter]
  args += argv[2:]
  plugins = [_TmpdirPlugin(tmp)]
  shards = _shard_plugin()
  if shards is not None:
    plugins.append(shards)
  status = pytest.main(args, plugins=plugins)
  if status == 5 and shards is not None and shards.kept == 0:
    return 0  # more shards than tests: this shard has nothing to run
  return status


def _shard_plugin():
  total = int(os.environ.get("TEST_TOTAL_SHARDS", "1") or 1)
  if total <= 1:
    return None
  status_file = os.environ.get("TEST_SHARD_STATUS_FILE")
  if status_file:
    with open(status_file, "a"):
      pass
  return _ShardPlugin(int(os.environ.get("TEST_SHARD_INDEX", "0")), total)


class _ShardPlugin:
  """Keeps every `total`-th collected test, starting at `index`."""

  def __init__(self, index, total):
    self._index, self._total = index, total
    self.kept = 0

  def pytest_collection_modifyitems(self, config, items):
    keep = [t for i, t in enumerate(items) if i % self._total == self._index]
    drop = [t for i, t in enumerate(items) if i % self._total != self._index]
    if drop:
      config.hook.pytest_deselected(items=drop)
    items[:] = keep
    self.kept = len(keep)


class _TmpdirPlugin:
  """Points Hypothesis' example database at $TEST_TMPDIR (default: ./)."""

  def __init__(self, tmp):
    self._tmp = tmp

  def pytest_configure(self, config):  # pylint: disable=unused-argument
    # Only now: importing hypothesis before pytest has set up assertion
    # rewriting for its plugins makes pytest warn.
    try:
      from hypothesis import configuration  # pylint: disable=g-import-not-at-top
    except ImportError:
      return
    configuration.set_hypothesis_home_dir(os.path.join(self._tmp, ".hypothesis"))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
