"""Atheris fuzz target for the wire v2 decoder (dyadic_jax.wire.codec).

Each input is decoded as received and, when it holds the header's CRC
field, once more repaired (length field and CRC set to match the bytes,
else most mutations would only ever reach those checks), each time under a
sampled (v2) and a greedy (v1) session's `Bounds`. The only allowed
outcomes are a decoded frame or `ProtocolError`. A crash is any other
exception, a code that `decode` must never raise (a session-level code),
or a broken invariant:

  - where the full decode accepts a q row, or refuses it with a code of
    the row check, the framing-only decode (`validate_rows=False`, the
    bridge's batch path) refuses with the same code or accepts the same
    row, unvalidated;
  - an accepted frame is exactly `length` bytes, of a known kind and a
    negotiated version, and a fixed-size kind has exactly its body;
  - an accepted REPLY with q: declared mass 2^24, position below the
    depth, count within the bound (== vocab for a dense row), ids int32,
    strictly ascending in [0, vocab); counts int32 of the row's length,
    nonnegative, equal to q * 2^24, summing to 2^24, nonzero at the token;
  - an accepted v1 REPLY (token only): no payload, token in [0, vocab).

Fuzz (libFuzzer flags; new inputs go to the first directory; see
docs/fuzzing.md):

    python tests/fuzz_wire.py /tmp/corpus tests/fuzz_corpus/wire -max_len=368

`run_fuzz` runs a fixed-seed, fixed-count campaign in a subprocess
(tests/test_wire_fuzz.py runs it in CI).
"""

import contextlib
import pathlib
import resource
import shlex
import subprocess
import sys
import types

_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script: `tests` is not importable
  sys.path.insert(0, str(_ROOT))

import numpy as np  # pylint: disable=g-import-not-at-top

# Coverage only for the wire modules: atheris instruments every module of a
# top-level package first imported inside `instrument_imports`, so the rest
# of the package (jax and all) is imported before it.
import dyadic_jax  # pylint: disable=g-import-not-at-top,unused-import
import dyadic_jax.constants  # pylint: disable=g-import-not-at-top,unused-import

_VALIDATE = "dyadic_jax.wire.validate"
if __name__ == "__main__":
  import atheris  # pylint: disable=g-import-not-at-top
  from atheris import instrument_bytecode  # pylint: disable=g-import-not-at-top
  # Imported already, the wire would run uninstrumented: no coverage.
  assert "dyadic_jax.wire" not in sys.modules
  # validate.py gets edge coverage only (below): atheris 3.0's comparison
  # tracing leaks every traced comparison result that is not a bool, and
  # validate compares whole numpy rows: ~36 bytes a run, ~2 GB an hour.
  _instrumented = atheris.instrument_imports(include=["dyadic_jax"],
                                             exclude=[_VALIDATE])
else:  # imported (tests, tools): TestOneInput without atheris
  _instrumented = contextlib.nullcontext()

with _instrumented:
  # pylint: disable=g-import-not-at-top
  from dyadic_jax.wire import codec, layouts, validate
  from dyadic_jax.wire.errors import Code, ProtocolError
  from dyadic_jax.wire.layouts import Kind, Representation
  from tests.fuzz_corpus.make_wire_corpus import (BOUNDS, GREEDY_BOUNDS,
                                                  NEVER_FROM_DECODE)

if __name__ == "__main__":
  for _fn in vars(validate).values():
    if isinstance(_fn, types.FunctionType) and _fn.__module__ == _VALIDATE:
      _fn.__code__ = instrument_bytecode.patch_code(_fn.__code__,
                                                    trace_dataflow=False)

M = 1 << 24
# What validate_q_row may raise (its docstring), i.e. refusals where a
# framing-only decode may accept the frame.
_ROW_CODES = frozenset(Code[name] for name in (
    "TOKEN_OUT_OF_RANGE", "MISSING_Q", "WRONG_DTYPE", "LENGTH_MISMATCH",
    "ABSURD_LENGTH", "ID_OUT_OF_RANGE", "DUPLICATE_ID", "UNSORTED_IDS",
    "NON_FINITE", "NEGATIVE", "WRONG_MASS", "NON_DYADIC",
    "ZERO_Q_AT_TOKEN"))
_LENGTH = layouts.HEADER.fields["length"][1]  # offset 8
CORPUS = _ROOT / "tests" / "fuzz_corpus" / "wire"
# Longer than any frame the bounds admit, so oversized inputs get tried.
MAX_LEN = BOUNDS.max_frame + 64


def _repair(buf):
  """`buf` with its length field set to its size and its CRC recomputed.

  Mutations that insert or erase bytes, or touch anything the CRC covers,
  would otherwise stop at the length or checksum check; repaired, they
  reach the body and row checks. (The raw input still exercises those
  framing checks, which come before the CRC.)
  """
  buf = bytearray(buf)
  buf[_LENGTH:_LENGTH + 4] = len(buf).to_bytes(4, "little")
  crc = codec.checksum(memoryview(buf)[layouts.CRC_COVERS_FROM:])
  buf[layouts.CRC_OFFSET:layouts.CRC_OFFSET + 4] = crc.to_bytes(4, "little")
  return bytes(buf)


def _check_reply(frame, length, bounds):
  body = frame.body
  representation = Representation(int(body["representation"]))
  count, token = int(body["count"]), int(body["token"])
  assert int(body["position"]) < bounds.max_depth
  assert 0 <= token < bounds.vocab
  assert length == layouts.frame_bytes(Kind.REPLY, count, representation)
  if representation == Representation.TOKEN:
    assert bounds.greedy and count == 0
    assert frame.values is None and frame.counts is None
    return
  assert not bounds.greedy
  assert int(body["mass"]) == M
  counts, values, ids = frame.counts, frame.values, frame.ids
  assert counts.dtype == np.int32 and counts.shape == (count,)
  assert values.dtype == np.float32 and values.shape == (count,)
  if representation == Representation.DENSE:
    assert ids is None and count == bounds.vocab
    at_token = counts[token]
  else:
    assert 0 < count <= bounds.max_support
    assert ids.dtype == np.int32 and ids.shape == (count,)
    assert ids[0] >= 0 and ids[-1] < bounds.vocab
    assert np.all(np.diff(ids) > 0)
    hits = np.flatnonzero(ids == token)
    assert len(hits) == 1, f"token {token} not in the support"
    at_token = counts[hits[0]]
  assert np.all(counts >= 0)
  assert np.array_equal(counts, values.astype(np.float64) * M)
  assert int(counts.sum(dtype=np.uint64)) == M
  assert at_token > 0


def _decode(buf, bounds, **kw):
  """The decoded frame, or the ProtocolError; anything else propagates."""
  try:
    return codec.decode(buf, bounds, **kw)
  except ProtocolError as e:
    assert e.code not in NEVER_FROM_DECODE, f"decode raised {e.code!r}"
    return e


def _check(buf, bounds):
  """Decodes `buf`; raises AssertionError (a crash) on a forbidden outcome."""
  frame = _decode(buf, bounds)
  if isinstance(frame, ProtocolError):
    if frame.code in _ROW_CODES:
      _check_framing_only(buf, bounds, frame)
    return
  header = frame.header
  length = int(header["length"])
  assert len(buf) == length
  assert header["magic"] == layouts.MAGIC
  assert int(header["version"]) in bounds.versions
  kind = Kind(int(header["kind"]))
  if kind == Kind.REPLY:
    _check_reply(frame, length, bounds)
    if frame.values is not None:
      _check_framing_only(buf, bounds, frame)
  else:
    assert length == layouts.frame_bytes(kind)
    assert frame.values is None and frame.counts is None


def _check_framing_only(buf, bounds, full):
  """The bridge's batch path (`validate_rows=False`) against `full`.

  Called where the two can differ: the full decode accepted a q row, or
  refused with a code the row check can raise. Framing only must refuse
  with the same code, or accept the same row, unvalidated.
  """
  got = _decode(buf, bounds, validate_rows=False)
  if isinstance(got, ProtocolError):
    assert isinstance(full, ProtocolError) and got.code == full.code, (
        f"framing-only decode: {got!r}, full decode: {full!r}")
    return
  assert got.counts is None
  if not isinstance(full, ProtocolError):
    assert np.array_equal(got.values, full.values)
    assert (got.ids is None) == (full.ids is None)
    assert got.ids is None or np.array_equal(got.ids, full.ids)


def TestOneInput(data):  # pylint: disable=invalid-name
  """One fuzz input: see the module docstring."""
  frames = [data]
  if len(data) >= layouts.CRC_COVERS_FROM:
    frames.append(_repair(data))
  for buf in frames:
    for bounds in (BOUNDS, GREEDY_BOUNDS):
      _check(buf, bounds)


def run_fuzz(corpus_dirs=(), *, runs=200_000, seed=1, artifact_dir=None,
             extra_args=(), timeout=None):
  """Runs a fixed-seed, fixed-count fuzz campaign in a subprocess.

  Args:
    corpus_dirs: corpus directories; libFuzzer writes new inputs into the
      first one, so pass a copy of the checked-in corpus.
    runs: executions in all (the corpus's included).
    seed: libFuzzer's -seed. A run still does not repeat bit for bit (the
      coverage atheris reports varies with memory layout), so a failure is
      reproduced from its crash file, not by running again.
    artifact_dir: where a crashing input is written (-artifact_prefix);
      the current directory when None.
    extra_args: further libFuzzer flags.
    timeout: seconds before subprocess.TimeoutExpired.

  Returns:
    The subprocess.CompletedProcess, stdout and stderr merged in `.stdout`.
  """
  # libFuzzer's memory check reads the peak RSS, which Linux carries over
  # from this (parent) process through fork and exec: a pytest worker that
  # already peaked at 2.5 GB would trip the default 2 GB limit at once. The
  # limit is 2 GB above what this process has already used.
  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
         f"-runs={runs}", f"-seed={seed}", f"-max_len={MAX_LEN}",
         f"-rss_limit_mb={peak_mb + 2048}", "-print_final_stats=1"]
  if artifact_dir is not None:
    cmd.append(f"-artifact_prefix={pathlib.Path(artifact_dir).resolve()}/")
  cmd += [*extra_args, *map(str, corpus_dirs)]
  return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=timeout, check=False)


if __name__ == "__main__":
  # libFuzzer starts -jobs / -fork children with a shell command line that
  # begins with argv[0]: make that run this interpreter on this file.
  _argv0 = " ".join(shlex.quote(a) for a in (sys.executable, __file__))
  atheris.Setup([_argv0, *sys.argv[1:]], TestOneInput)
  atheris.Fuzz()
