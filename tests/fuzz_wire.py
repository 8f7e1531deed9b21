"""Atheris fuzz target for the wire v3 decoder (dyadic_jax.wire.codec).

Each input is decoded as received and, when it holds a whole header, once
more repaired (length field set to its size and the tag resealed with the
corpus key, else most mutations would only ever reach those checks),
under a sampled sparse, a sampled dense and a greedy session's `Bounds`
the sparse and dense ones of a session with PACKED replies, the
sparse one of a session with CONTEXT frames and the sparse one of a
session with PACKED_STEP frames,
with rows validated (`validate_rows=True`, the q formats on qrows). It is
also split as a message. The only allowed outcomes are a decoded frame or
`ProtocolError`. A crash is any other exception, a code that `decode` must
never raise (a session-level code), or a broken invariant:

  - an accepted frame is exactly `length` bytes, of a known kind, version
    3, its tag verifies, and a fixed-size kind has exactly its body;
  - an accepted REPLY: representation, depth and width those of the
    session, the declared mass 2^24 (0 greedy), size exactly the layout's;
    with q: counts int32 of the rows' shape, nonnegative, equal to q 2^24
    on live entries, each row summing to 2^24 and nonzero at its token;
    sparse ids strictly ascending in [0, vocab) on live entries; greedy:
    tokens in [0, vocab), no q;
  - an accepted PACKED frame: the session's form, 1..max_requests
    records, depth <= the bound, width, mass and size the layout's, the
    rows [R, D, ...]; the first min(depth, D) rows of records whose
    status is 0 (a record's depth: fewer on an ADAPTIVE_DEPTH session)
    hold what an accepted REPLY's do (their counts checked as above);
  - an accepted CONTEXT frame: a session that agreed on it, 1..max_context
    tokens, each in [0, vocab), size exactly the layout's;
  - an accepted PACKED_STEP frame: a session that agreed on it,
    1..max_requests records, size exactly the layout's, one STEP body per
    record with the frame's depth and policy and the record's fields,
    the header tagged as its first record.

Fuzz (libFuzzer flags; new inputs go to the first directory; see
docs/fuzzing.md):

    python tests/fuzz_wire.py /tmp/corpus tests/fuzz_corpus/wire -max_len=1776

`run_fuzz` runs a fixed-seed, fixed-count campaign in a subprocess
(tests/system/test_fuzz_wire.py runs it in CI).
"""

import contextlib
import pathlib
import shlex
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script: `tests` is not importable
  sys.path.insert(0, str(_ROOT))

import numpy as np  # pylint: disable=g-import-not-at-top

from tests import fuzz_run  # pylint: disable=g-import-not-at-top

# Coverage only for the wire modules: atheris instruments every module of a
# top-level package first imported inside `instrument_imports`, so the rest
# of the package (jax and all) is imported before it.
import dyadic_jax  # pylint: disable=g-import-not-at-top,unused-import
import dyadic_jax.constants  # pylint: disable=g-import-not-at-top,unused-import

_NO_TRACE = ["dyadic_jax.wire.validate", "dyadic_jax.wire.qformats"]
if __name__ == "__main__":
  import atheris  # pylint: disable=g-import-not-at-top
  # Imported already, the wire would run uninstrumented: no coverage.
  assert "dyadic_jax.wire" not in sys.modules
  # The row validators get no comparison tracing: atheris 3.0 leaks every
  # traced comparison result that is not a bool, and they compare numpy
  # rows (about 2 GB an hour).
  _instrumented = atheris.instrument_imports(include=["dyadic_jax.wire"],
                                             exclude=_NO_TRACE)
else:  # imported (tests, tools): TestOneInput without atheris
  _instrumented = contextlib.nullcontext()

with _instrumented:
  # pylint: disable=g-import-not-at-top
  from dyadic_jax.wire import auth, codec, layouts, qformats
  from dyadic_jax.wire.refusals import ProtocolError
  from dyadic_jax.wire.layouts import FIXED_BYTES, Kind
  from tests.fuzz_corpus.make_wire_corpus import (BOUNDS, CONTEXT_BOUNDS,
                                                  DENSE_BOUNDS,
                                                  GREEDY_BOUNDS, KEY,
                                                  NEVER_FROM_DECODE,
                                                  PACKED_BOUNDS,
                                                  PACKED_DENSE_BOUNDS,
                                                  PACKED_STEP_BOUNDS)

M = 1 << 24
ALL_BOUNDS = (BOUNDS, DENSE_BOUNDS, GREEDY_BOUNDS, PACKED_BOUNDS,
              PACKED_DENSE_BOUNDS, CONTEXT_BOUNDS, PACKED_STEP_BOUNDS)
CORPUS = _ROOT / "tests" / "fuzz_corpus" / "wire"
# Longer than any frame the bounds admit, so oversized inputs get tried.
MAX_LEN = max(b.max_frame for b in ALL_BOUNDS) + 64


def _repair(buf):
  """`buf` with its length field set to its size and its tag resealed."""
  buf = bytearray(buf)
  buf[8:12] = len(buf).to_bytes(4, "little")
  auth.seal(buf, KEY)
  return bytes(buf)


def _check_packed(frame, bounds):
  body, rows, records = frame.body, frame.rows, frame.records
  assert bounds.packed and body.representation == bounds.representation
  r, d = body.requests, body.depth
  assert 1 <= r <= bounds.max_requests and 0 <= d <= bounds.depth
  assert body.width == bounds.width and body.mass == bounds.format.mass
  assert len(frame.raw) == bounds.packed_bytes(r, d)
  assert records.shape == (r,) and rows.tokens.shape == (r, d)
  ok = np.flatnonzero(records["status"] == 0)
  counts = None if frame.counts is None else np.asarray(frame.counts)
  for i, j in enumerate(ok):
    # A record's rows: its first `depth` (a short answer's are fewer).
    n = min(int(records["depth"][j]), d)
    _check_rows(qformats.Rows(*(None if a is None else a[j, :n]
                                for a in rows)),
                None if counts is None else np.asarray(counts[i])[:n], n,
                bounds)


def _check_context(frame, bounds):
  n, tokens = frame.body.count, frame.tokens
  assert bounds.max_context and 1 <= n <= bounds.max_context
  assert len(frame.raw) == bounds.context_bytes(n)
  assert tokens.shape == (n,) and tokens.dtype == np.dtype("<i4")
  assert np.all((tokens >= 0) & (tokens < bounds.vocab))
  assert frame.rows is None and frame.counts is None


def _check_packed_step(frame, bounds):
  body, steps = frame.body, frame.steps
  r = body.requests
  assert bounds.packed_step and 1 <= r <= bounds.max_requests
  assert len(frame.raw) == bounds.packed_step_bytes(r) and len(steps) == r
  records = np.frombuffer(frame.raw, layouts.STEP_RECORD, r,
                          FIXED_BYTES[Kind.PACKED_STEP])
  for step, rec in zip(steps, records):
    assert (step.body.depth, step.body.policy) == (body.depth, body.policy)
    assert step.tag == (int(rec["generation"]), int(rec["round"]))
    assert (step.body.request, step.body.last_token, step.body.seed,
            step.body.anchor, step.body.context_version,
            step.body.prefix_digest) == (
                int(rec["request"]), int(rec["last_token"]),
                int(rec["seed"]), int(rec["anchor"]),
                int(rec["context_version"]),
                # numpy's S32 drops trailing zero bytes; the wire keeps 32
                bytes(rec["prefix_digest"]).ljust(32, b"\0"))
  assert frame.rows is None and frame.counts is None


def _check_reply(frame, bounds):
  body, rows = frame.body, frame.rows
  assert body.representation == bounds.representation
  assert 1 <= body.depth <= bounds.depth and body.width == bounds.width
  assert len(frame.raw) == bounds.reply_bytes(body.depth)
  assert body.mass == bounds.format.mass
  _check_rows(rows, frame.counts, body.depth, bounds)


def _check_rows(rows, counts, d, bounds):
  assert rows.tokens.shape == (d,) and rows.n.shape == (d,)
  fmt = bounds.format
  if not fmt.sampled:
    assert rows.values is None and counts is None
    assert np.all((rows.tokens >= 0) & (rows.tokens < bounds.vocab))
    return
  counts = np.asarray(counts)
  assert counts.dtype == np.int32 and counts.shape == (d, bounds.width)
  assert np.all(counts >= 0)
  values = rows.values.astype(np.float64)
  for i in range(d):
    n = int(rows.n[i])
    assert 1 <= n <= bounds.width
    assert np.array_equal(counts[i, :n], values[i, :n] * M)
    assert int(counts[i].sum(dtype=np.uint64)) == M
    if not fmt.has_ids:     # a vocabulary-long row
      assert n == bounds.vocab
      at = counts[i, rows.tokens[i]]
    else:
      ids = rows.ids[i, :n]
      assert ids[0] >= 0 and ids[-1] < bounds.vocab
      assert np.all(np.diff(ids) > 0)
      hits = np.flatnonzero(ids == rows.tokens[i])
      assert len(hits) == 1, f"token {rows.tokens[i]} not in the support"
      at = counts[i, hits[0]]
    assert at > 0


def _check(buf, bounds):
  """Decodes `buf`; raises AssertionError (a crash) on a forbidden outcome."""
  try:
    frame = codec.decode(buf, bounds, KEY, validate_rows=True)
  except ProtocolError as e:
    assert e.code not in NEVER_FROM_DECODE, f"decode raised {e.code!r}"
    return
  header = frame.header
  assert len(buf) == header.length and header.magic == layouts.MAGIC
  assert header.version == layouts.WIRE_VERSION
  assert auth.check(buf, KEY)
  kind = Kind(header.kind)
  if kind == Kind.REPLY:
    _check_reply(frame, bounds)
  elif kind == Kind.PACKED:
    _check_packed(frame, bounds)
  elif kind == Kind.CONTEXT:
    _check_context(frame, bounds)
  elif kind == Kind.PACKED_STEP:
    _check_packed_step(frame, bounds)
  else:
    assert header.length == FIXED_BYTES[kind]
    assert frame.rows is None and frame.counts is None


def TestOneInput(data):  # pylint: disable=invalid-name
  """One fuzz input: see the module docstring."""
  frames = [data]
  if len(data) >= layouts.HEADER_BYTES:
    frames.append(_repair(data))
  for buf in frames:
    for bounds in ALL_BOUNDS:
      _check(buf, bounds)
    try:
      for part in codec.split(buf, max_frames=4, max_bytes=MAX_LEN):
        assert len(part) >= layouts.HEADER_BYTES
    except ProtocolError as e:
      assert e.code not in NEVER_FROM_DECODE


def run_fuzz(corpus_dirs=(), *, runs=200_000, seed=1, artifact_dir=None,
             extra_args=(), timeout=None):
  """A fixed-seed, fixed-count campaign of this target (tests/fuzz_run.py)."""
  return fuzz_run.run(__file__, corpus_dirs, runs=runs, seed=seed,
                      max_len=MAX_LEN, artifact_dir=artifact_dir,
                      extra_args=extra_args, timeout=timeout)


if __name__ == "__main__":
  # libFuzzer starts -jobs / -fork children with a shell command line that
  # begins with argv[0]: make that run this interpreter on this file.
  _argv0 = " ".join(shlex.quote(a) for a in (sys.executable, __file__))
  atheris.Setup([_argv0, *sys.argv[1:]], TestOneInput)
  atheris.Fuzz()
