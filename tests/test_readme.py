"""The README's Python examples run as written (all blocks, in order)."""

import pathlib
import re

_README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_api_tour_runs():
  text = _README.read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert blocks, "README has no python block"
  namespace = {}
  for block in blocks:  # tests/conftest.py provides the 8 emulated devices
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert 0 <= int(namespace["accepted"]) <= 3
  assert 0 <= int(namespace["next_token"]) < 1000
  assert len(blocks) >= 3 and "mesh" in namespace  # the sharded example ran
  results = namespace["results"]                   # and the bridge example
  assert [r.rid for r in results] == [0, 1]
  assert not any(r.fallback for r in results)
