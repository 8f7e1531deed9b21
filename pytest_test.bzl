"""pytest_test: one py_test that runs one test file under pytest.

Loaded by the top-level BUILD (`load("//:pytest_test.bzl", "pytest_test")`).
It lives at the repository root, in the root package, because a BUILD file
in third_party/bazel/ would make that a package of its own and cut
third_party/bazel/pytest_main.py out of the root package.

third_party/bazel/check_build.py evaluates this file with stand-in rules
(Python can run it: keep to the Starlark that is also Python) and checks the
py_test each call expands to.
"""

# The `main` of every test: runs the file given as argv[1] with pytest.
PYTEST_MAIN = "third_party/bazel/pytest_main.py"

# pytest configuration files; those the repository has go into the runfiles.
PYTEST_CONFIG_FILES = [
    "pytest.ini",
    "pyproject.toml",
    "setup.cfg",
    "tox.ini",
]

def pytest_test(
        name,
        src,
        deps = [],
        data = [],
        tags = [],
        shard_count = None,
        timeout = None):
    """A py_test that runs `src` through PYTEST_MAIN.

    Args:
      name: the target name (check_build.py: the file's path below tests/,
        e.g. tests/core/test_qcodec.py -> core_test_qcodec).
      src: the test file, a path relative to the root package.
      deps: py_library targets the file needs.
      data: extra runfiles, beside the pytest configuration files.
      tags: "slow", "multidevice", "smoke" (see BUILD's header).
      shard_count: number of Bazel shards (PYTEST_MAIN deals the file's tests
        out round-robin); None for one process.
      timeout: the Bazel timeout; None means "long" for a test tagged "slow"
        and Bazel's default ("moderate") otherwise.
    """
    if timeout == None and "slow" in tags:
        timeout = "long"
    native.py_test(
        name = name,
        srcs = [
            src,
            PYTEST_MAIN,
        ],
        args = ["$(rootpath %s)" % src],
        data = native.glob(PYTEST_CONFIG_FILES, allow_empty = True) + data,
        # No empty __init__.py files in the runfiles: one would turn tests/
        # into a package, or stand in for a missing dyadic_jax/__init__.py.
        legacy_create_init = False,
        main = PYTEST_MAIN,
        shard_count = shard_count,
        tags = tags,
        timeout = timeout,
        deps = deps,
    )
