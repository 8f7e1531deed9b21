"""The dense verdict's CPU path is the kernel it replaced, bit for bit.

`kernels._host_dense` (one XLA pass that also reads each row's token and
the token's segment, then numpy's segment sums and running sums) must give
exactly what the previous host path gave (frozen below as `_previous`:
one XLA pass, numpy segment sums, the audit's gathers in numpy), what the
accelerator's jitted verdict gives, and what the numpy kernel
(`qrows.dense` + `base.audit`) and the oracle (`reference.q_to_counts`,
the audit in Python integers) say: the same valid rows with the same
counts (zeros on refused rows), the same audit on valid rows, and through
`DenseFormat.validate` the same code on every row. Random and adversarial
slots: every refusal class (NaN payloads, INF, negatives, subnormals of
both signs, normals below 2^-24, off-grid values, entries above 1, mass
one off either way or 2^32 off, zero q at the token, tokens out of range),
-0.0 (valid), tokens on and beside segment boundaries, and draws at the
audit's edges (cumulative mass == draw, draw + 1).
"""

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import qrows, wire
from dyadic_jax import reference as ref
from dyadic_jax.wire import qformats, status
from dyadic_jax.wire.layouts import Representation
from dyadic_jax.wire.qformats import base, kernels
from dyadic_jax.wire.refusals import Code, ProtocolError

M = dj.M
T = 2.0 ** -24
DENSE = qformats.get(Representation.DENSE)
_SEGMENT = 255


@jax.jit
def _previous_entries(values):
  return qrows.fine_counts(lax.bitcast_convert_type(values, jnp.uint32),
                           M + 1, jnp)


def _previous(values, tokens, draws):
  """The host path before the one-pass rework (commit f89fad7), verbatim
  but for names: (counts, valid, drawn)."""
  shape = values.shape
  vocab = shape[-1]
  rows = math.prod(shape[:-1])
  entries = _previous_entries(jnp.asarray(values))
  e = np.asarray(entries).reshape(rows, vocab)
  flat = e.reshape(-1).view(np.uint32)
  per_row = -(-vocab // _SEGMENT)
  starts = (np.arange(rows, dtype=np.int64)[:, None] * vocab
            + np.arange(0, vocab, _SEGMENT, dtype=np.int64)[None, :]
            ).reshape(-1)
  sums = np.add.reduceat(flat, starts, dtype=np.uint32).reshape(
      rows, per_row).astype(np.int64)
  index = np.arange(rows)
  tokens = tokens.reshape(rows).astype(np.int64)
  token = np.clip(tokens, 0, vocab - 1)
  at = e[index, token].astype(np.int64)
  valid = ((sums.sum(-1) == M) & (tokens >= 0) & (tokens < vocab)
           & (at > 0))
  segment = token // _SEGMENT
  whole = np.cumsum(sums, -1)[index, segment] - sums[index, segment]
  start = segment * _SEGMENT
  offset = np.arange(_SEGMENT)
  inside = np.minimum(start[:, None] + offset, vocab - 1)
  part = np.where(offset < (token - start)[:, None],
                  e[index[:, None], inside], 0)
  before = whole + part.sum(-1, dtype=np.int64)
  u = draws.reshape(rows).astype(np.int64)
  drawn = (before <= u) & (u < before + at)
  counts = np.where(valid[:, None], e, 0).reshape(shape)
  return counts, valid.reshape(shape[:-1]), drawn.reshape(shape[:-1])


def _valid_row(rng, v, spread):
  """A valid row: all of M on `spread` entries (at least one) chosen at
  random, multinomial over them."""
  k = max(1, min(v, spread))
  ids = rng.choice(v, k, replace=False)
  c = np.zeros(v, np.int64)
  c[ids] = rng.multinomial(M, rng.dirichlet(np.ones(k)))
  return c


def _adversarial(rng, v):
  """(float32 rows, tokens, draws): valid rows with the token and draw on
  the audit's edges, and one refusal (or a valid twist) per other row."""
  places = sorted({p for p in (0, 1, 253, 254, 255, 256, 509, 510, 511,
                               v // 2, v - 2, v - 1) if 0 <= p < v})
  rows, tokens, draws = [], [], []

  def add(bits_or_values, token, draw):
    rows.append(np.asarray(bits_or_values))
    tokens.append(token)
    draws.append(draw)

  def as_q(c):
    return (c * T).astype(np.float32)

  # Valid rows, draws on both edges of the token's interval and beyond.
  for p in places:
    c = _valid_row(rng, v, v)
    c[p] += 1                       # a nonzero count at p ...
    c[np.argmax(c)] -= 1            # ... mass still M
    if c[p] == 0:
      continue
    cum = np.cumsum(c)
    lo, hi = int(cum[p] - c[p]), int(cum[p])    # p drawn iff lo <= u < hi
    for u in (lo, hi - 1, hi, lo - 1, (lo + hi) // 2, M - 1, 0):
      if 0 <= u < 2 ** 32:
        add(as_q(c), p, u)
  # Refusals and twists, each at a random place and at a segment edge.
  edits = {
      "nan": lambda q, i: q.view(np.uint32).__setitem__(i, 0x7FC00000),
      "nan_payload": lambda q, i: q.view(np.uint32).__setitem__(
          i, 0x7F800001),
      "nan_negative": lambda q, i: q.view(np.uint32).__setitem__(
          i, 0xFFC00000),
      "inf": lambda q, i: q.__setitem__(i, np.inf),
      "-inf": lambda q, i: q.__setitem__(i, -np.inf),
      "negative": lambda q, i: q.__setitem__(i, -q[i] if q[i] else -T),
      "subnormal_min": lambda q, i: q.view(np.uint32).__setitem__(i, 1),
      "subnormal_max": lambda q, i: q.view(np.uint32).__setitem__(
          i, 0x007FFFFF),
      "subnormal_negative": lambda q, i: q.view(np.uint32).__setitem__(
          i, 0x80000001),
      "below_grid": lambda q, i: q.__setitem__(i, np.float32(T / 2)),
      "just_below_grid": lambda q, i: q.view(np.uint32).__setitem__(
          i, 0x337FFFFF),
      "off_grid": lambda q, i: q.__setitem__(i, np.float32(q[i] + T / 2)
                                             if q[i] < 0.5 else q[i]),
      "above_one": lambda q, i: q.view(np.uint32).__setitem__(
          i, 0x3F800001),
      "huge": lambda q, i: q.__setitem__(i, np.float32(3e38)),
      "one_up": lambda q, i: q.__setitem__(i, np.float32(q[i] + T)),
      "one_down": lambda q, i: q.__setitem__(
          i, np.float32(q[i] - T) if q[i] >= T else q[i]),
      "neg_zero": lambda q, i: q.view(np.uint32).__setitem__(
          i, 0x80000000 if q[i] == 0 else q.view(np.uint32)[i]),
      "zero_at_token": lambda q, i: None,     # handled below
  }
  for name, edit in edits.items():
    for i in (int(rng.integers(v)), places[-1], places[len(places) // 2]):
      c = _valid_row(rng, v, int(rng.integers(1, 8)))
      q = as_q(c)
      token = int(np.argmax(c))
      if name == "zero_at_token":
        zeros = np.flatnonzero(c == 0)
        if not len(zeros):
          continue
        token = int(zeros[0])
      else:
        if name == "neg_zero":
          q[i] = 0.0 if c[i] == 0 else q[i]
        edit(q, i)
      cum = np.cumsum(c)
      add(q, token, int(cum[token] - 1) if c[token] else 0)
  # Mass aliases: 2^32 + M (257 ones) sums to M modulo 2^32.
  if v >= 257:
    q = np.zeros(v, np.float32)
    q[:257] = 1.0
    add(q, 0, 0)
  # Tokens out of range on a valid row.
  c = _valid_row(rng, v, v)
  for token in (-1, v, v + 255, -(2 ** 31), 2 ** 31 - 1):
    add(as_q(c), token, 0)
  # Random valid rows and random draws.
  for _ in range(10):
    c = _valid_row(rng, v, int(rng.integers(1, v + 1)))
    token = int(rng.choice(np.flatnonzero(c)))
    add(as_q(c), token, int(rng.integers(0, M)))
  return (np.stack(rows).astype(np.float32), np.asarray(tokens, np.int64),
          np.asarray(draws, np.int64))


def _reference_code(row, token, draw, vocab):
  """The oracle's code: validate_q_row, then the audit in integers."""
  try:
    wire.validate_q_row(row, None, vocab_size=vocab, token=int(token))
  except ProtocolError as e:
    return int(e.code)
  counts, _ = ref.q_to_counts(row, token=int(token))
  before = sum(int(x) for x in counts[:token])
  if not before <= int(draw) < before + int(counts[token]):
    return int(Code.SAMPLING_MISMATCH)
  return 0


@pytest.mark.parametrize("v", [1, 3, 255, 256, 600])
def test_host_dense_is_the_previous_path_the_kernel_and_the_oracle(v):
  rng = np.random.default_rng(1000 + v)
  rows, tokens, draws = _adversarial(rng, v)
  r = len(rows)
  tokens32 = tokens.astype(np.int32)
  draws32 = draws.astype(np.uint32)
  staged = qformats.aligned_empty((r, 1, v), np.float32)
  staged[:, 0] = rows
  t, d = tokens32[:, None], draws32[:, None]

  host = [np.asarray(x) for x in kernels.dense_verdict(staged, t, d,
                                                       host=True)]
  old = _previous(staged, t, d)
  dev = [np.asarray(x) for x in kernels.dense_verdict(staged, t, d,
                                                      host=False)]
  valid = host[1][:, 0]
  assert np.array_equal(valid, old[1][:, 0])
  assert np.array_equal(valid, dev[1][:, 0])
  assert np.array_equal(host[0], old[0])            # zeros where refused
  assert np.array_equal(host[0][valid], dev[0][valid])
  assert np.array_equal(host[2][valid], old[2][valid])
  assert np.array_equal(host[2][valid], dev[2][valid])
  assert np.array_equal(kernels.dense_verdict(staged, t, None, host=True)[1],
                        host[1])

  # The numpy kernel and the oracle, row by row.
  counts, row_status = qrows.dense(rows.view(np.uint32), tokens32, vocab=v,
                                   xp=np)
  assert np.array_equal(valid, row_status == dj.Status.OK)
  assert np.array_equal(host[0][:, 0], counts)
  audit_np = base.audit(counts, tokens32, draws32, np)
  assert np.array_equal(host[2][valid, 0], audit_np[valid])
  for i in range(r):
    want, code = ref.q_to_counts(rows[i], token=int(tokens[i]))
    assert valid[i] == (code == dj.Status.OK), i
    if valid[i]:
      assert host[0][i, 0].tolist() == want, i

  # Every code, through the format: the staged (host) path, the numpy
  # path and the oracle.
  batch = qformats.Rows(t, np.full((r, 1), v, np.int32), None, staged)
  got = DENSE.validate(batch, vocab=v, draws=d, device=True).codes[:, 0]
  numpy_path = DENSE.validate(batch, vocab=v, draws=d).codes[:, 0]
  assert np.array_equal(got, numpy_path)
  want = [_reference_code(rows[i], tokens[i], draws[i], v)
          for i in range(r)]
  assert got.tolist() == want
  assert np.array_equal(
      got[~valid], status.codes(row_status)[~valid])
  # The slot exercises both audit outcomes and (beyond v = 1) many codes.
  assert valid.any() and (got[valid] == 0).any()
  if v > 1:
    assert (got == Code.SAMPLING_MISMATCH).any()
    assert {int(c) for c in got} >= {
        0, Code.NON_FINITE, Code.NEGATIVE, Code.NON_DYADIC,
        Code.WRONG_MASS, Code.TOKEN_OUT_OF_RANGE, Code.ZERO_Q_AT_TOKEN,
        Code.SAMPLING_MISMATCH}


@functools.lru_cache(maxsize=None)
def _empty_slot(v):
  return qformats.aligned_empty((0, 5, v), np.float32)


@pytest.mark.parametrize("host", [True, False])
def test_host_dense_of_an_empty_batch(host):
  counts, valid, drawn = kernels.dense_verdict(
      _empty_slot(7), np.zeros((0, 5), np.int32), np.zeros((0, 5),
                                                         np.uint32),
      host=host)
  assert np.shape(counts) == (0, 5, 7)
  assert np.shape(valid) == np.shape(drawn) == (0, 5)
