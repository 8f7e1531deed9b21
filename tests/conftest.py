"""Test set-up shared by every test file.

Requests 8 emulated CPU devices before JAX starts (multi-device tests skip
when fewer are present, e.g. on a 1-GPU machine), and registers the
hypothesis profiles: "ci" (derandomized, the default under CI=true) and
"dev".
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG
                             ).strip()

import hypothesis  # pylint: disable=g-import-not-at-top

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


def pytest_collection_modifyitems(config, items):
  if config.getoption("--runslow"):
    return
  import pytest  # pylint: disable=g-import-not-at-top
  skip = pytest.mark.skip(reason="slow: run with --runslow (see README)")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)
