"""The bridge's fast paths agree exactly with the slow definitions.

frame_crc / crc_combine with crc32c over the bytes; staging.sparse_rows and
staging.dense_rows with wire.validate_q_row, on every rejection class and on
sums that only an exact reduction tells apart from 2^24.
"""

import crc32c
import numpy as np

import dyadic_jax as dj
from dyadic_jax import wire
from dyadic_jax.bridge import staging
from dyadic_jax.wire import codec
from dyadic_jax.wire.errors import ProtocolError
from dyadic_jax.wire.layouts import Kind


def test_crc_combine_matches_crc32c():
  rng = np.random.default_rng(0)
  for la, lb in [(0, 0), (0, 5), (1, 1), (7, 0), (16, 1 << 16), (100, 3),
                 (1000, 517152)]:
    a, b = rng.bytes(la), rng.bytes(lb)
    assert codec.crc_combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == (
        crc32c.crc32c(a + b))


def test_frame_crc_matches_crc32c_small_and_large():
  rng = np.random.default_rng(1)
  for vocab in (16, 1 << 15):   # below and above the combine threshold
    q = np.zeros(vocab, np.float32)
    q[3] = 1.0
    frame = codec.encode(Kind.REPLY, session=5, generation=1, round_id=2,
                         body={"position": 0, "token": 3, "mass": dj.M},
                         values=q)
    seed = int(rng.integers(0, 2 ** 32))
    assert codec.frame_crc(frame, seed) == crc32c.crc32c(frame, seed)
    assert codec.frame_crc(frame) == crc32c.crc32c(frame)


def _sparse_cases(rng, vocab, k, count):
  ids = np.sort(np.stack([rng.choice(vocab, k, replace=False)
                          for _ in range(count)]), -1).astype(np.int32)
  counts = rng.multinomial(dj.M - k, np.ones(k) / k, size=count) + 1
  values = (counts * 2.0 ** -24).astype(np.float32)
  tokens = ids[np.arange(count), rng.integers(0, k, count)].copy()
  n = np.full(count, k, np.int32)
  t = np.float32(2.0 ** -24)
  for b in range(count):
    j = int(rng.integers(k))
    case = b % 16
    if case == 1:
      values[b, j] = np.nan
    elif case == 2:
      values[b, j] = -values[b, j]
    elif case == 3:
      values[b, j] += t / 2                     # not dyadic
    elif case == 4:
      values[b, j] += t                         # mass 2^24 + 1
    elif case == 5:
      ids[b, j] = vocab
    elif case == 6:
      ids[b, j] = -1
    elif case == 7 and j:
      ids[b, j] = ids[b, j - 1]                 # duplicate
    elif case == 8 and j:
      ids[b, [j - 1, j]] = ids[b, [j, j - 1]]   # unsorted
    elif case == 9:
      tokens[b] = vocab
    elif case == 10:
      n[b] = rng.integers(0, k)                 # padding, mass short
    elif case == 11:
      values[b, j] = np.inf
    elif case == 12:
      values[b, np.searchsorted(ids[b], tokens[b])] = 0   # q = 0 at token
    elif case == 13:
      values[b] = 0
      values[b, :2] = [1.0, t]                  # rounds to 2^24 in float32
    elif case == 14:
      tokens[b] = -1
  return values, ids, n, tokens


def test_sparse_rows_agree_with_validate_q_row():
  rng = np.random.default_rng(2)
  vocab, k = 1000, 8
  values, ids, n, tokens = _sparse_cases(rng, vocab, k, 320)
  counts, ok = staging.sparse_rows(values, ids, n, tokens, vocab)
  refused = 0
  for b in range(len(values)):
    try:
      want = wire.validate_q_row(values[b, :n[b]], ids[b, :n[b]],
                                 vocab_size=vocab, token=int(tokens[b]))
    except ProtocolError:
      want = None
    assert bool(ok[b]) == (want is not None), b
    if want is None:
      refused += 1
    else:
      assert np.array_equal(counts[b, :n[b]], want)
  assert 0 < refused < len(values)


def test_dense_rows_exact_sums():
  # Sums that a float32 or wrapping int32 reduction confuses with 2^24.
  v = 512
  t = 2.0 ** -24
  rows = []
  for fill in ([1.0, t], [0.5, 0.5, t], [1.0] * 256, [t] * v):
    q = np.zeros(v, np.float32)
    q[:len(fill)] = fill
    rows.append(q)
  exact = np.zeros(v, np.float32)
  exact[:2] = 0.5
  rows.append(exact)
  values = staging.aligned_empty((len(rows), v), np.float32)
  values[:] = np.stack(rows)
  _, ok = staging.dense_rows(values, np.zeros(len(rows), np.int32))
  assert np.asarray(ok).tolist() == [False, False, False, False, True]
