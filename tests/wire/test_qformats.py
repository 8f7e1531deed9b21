"""The q formats agree with the one kernel (qrows) and with validate_q_row.

The dense batch path (one jitted pass on the staging slot) must accept
exactly the rows `qrows.dense` accepts, with the same counts, and report
the kernel's code for the others; the sparse path is the kernel itself,
and the verifier's sparse host verdict (one compiled loop; in full:
test_sparse_verdict.py) is the jitted kernel and the oracle bit for bit.
The sampling audit must accept exactly the token `dyadic_jax.sample_counts`
draws. Every rejection class is exercised, subnormals included (XLA CPU
flushes them to zero in float compares).
"""

import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import qrows, wire
from dyadic_jax import reference as ref
from dyadic_jax.bridge import audit
from dyadic_jax.wire import qformats, status
from dyadic_jax.wire.qformats import kernels, sparse
from dyadic_jax.wire.layouts import Representation
from dyadic_jax.wire.refusals import Code, ProtocolError

M = dj.M
T = np.float32(2.0 ** -24)
DENSE = qformats.get(Representation.DENSE)
SPARSE = qformats.get(Representation.SPARSE)


def _put_bits(q, i, bits):
  q.view(np.uint32)[i] = bits
  return q


def _dense_rows(v, rng):
  base = np.zeros(v, np.float32)
  base[[1, 4, 9]] = [0.5, 0.25, 0.25]
  edits = [
      lambda q: q,
      lambda q: _put(q, 0, np.nan), lambda q: _put(q, 2, np.inf),
      lambda q: _put(q, 2, -np.inf),
      lambda q: _put(_put(q, 1, 1.0), 4, -0.5),
      lambda q: _put(q, 0, T / 2), lambda q: _put(q, 0, T),
      lambda q: _put(q, 1, -0.0),
      lambda q: _put(_put(q, 1, 0.0), 0, 0.5), lambda q: _put(q, 1, 2.0),
      lambda q: _put_bits(q, 0, 0x00000001),     # smallest subnormal
      lambda q: _put_bits(q, 0, 0x007FFFFF),     # largest subnormal
      lambda q: _put_bits(q, 0, 0x80000001),     # negative subnormal
      lambda q: _put_bits(q, 0, 0x80000000),     # -0.0: zero, valid
      lambda q: _put(_put(q, 1, 0.5 - T), 0, T),  # mass moved: valid
      lambda q: _put(q, 0, 3 * T / 2),           # not on the grid
  ]
  rows, tokens = [], []
  for edit in edits:
    for token in (1, 0, 4, -1, v):
      rows.append(edit(base.copy()))
      tokens.append(token)
  for _ in range(30):   # random valid rows
    c = rng.multinomial(M, rng.dirichlet(np.ones(v)))
    rows.append((c * 2.0 ** -24).astype(np.float32))
    tokens.append(int(np.argmax(c)))
  return np.stack(rows), np.array(tokens, np.int32)


def _put(q, i, x):
  q[i] = x
  return q


def _row_code(values, ids, token, vocab):
  try:
    wire.validate_q_row(values, ids, vocab_size=vocab, token=int(token))
    return 0
  except ProtocolError as e:
    return int(e.code)


def test_dense_batch_path_agrees_with_the_kernel_and_validate_q_row():
  v = 16
  rows, tokens = _dense_rows(v, np.random.default_rng(0))
  r = len(rows)
  staged = qformats.aligned_empty((r, 1, v), np.float32)
  staged[:, 0] = rows
  batch = qformats.Rows(tokens[:, None], np.full((r, 1), v, np.int32), None,
                        staged)
  device = DENSE.validate(batch, vocab=v, device=True)
  host = DENSE.validate(batch, vocab=v)
  counts, kernel = qrows.dense(rows.view(np.uint32), tokens, vocab=v, xp=np)
  want = status.codes(kernel)
  assert np.array_equal(device.codes[:, 0], want)
  assert np.array_equal(host.codes[:, 0], want)
  assert np.array_equal(want, [_row_code(rows[i], None, tokens[i], v)
                               for i in range(r)])
  ok = want == 0
  assert 30 < ok.sum() < r - 30     # both outcomes, many classes
  assert np.array_equal(np.asarray(device.counts)[ok, 0], counts[ok])
  assert np.array_equal(host.counts[ok, 0], counts[ok])
  # Every class the edits make is one the kernel reports.
  assert {int(c) for c in want} >= {
      0, Code.NON_FINITE, Code.NEGATIVE, Code.NON_DYADIC, Code.WRONG_MASS,
      Code.TOKEN_OUT_OF_RANGE, Code.ZERO_Q_AT_TOKEN}


def test_dense_sums_that_only_an_exact_reduction_tells_apart():
  v = 600
  nan = np.float32(np.nan)
  fills = ([1.0, T], [0.5, 0.5, T], [1.0] * 256,
           [1.0] * 257,                 # 257 M: M modulo 2^32
           [T] * v,
           [nan] * 128 + [1.0],         # 128 (M + 1) + M: M modulo 2^32
           [nan] * 255 + [1.0],         # one whole segment of non-fine
           [0.0] * 254 + [0.5] * 2)     # across a segment boundary: valid
  rows = []
  for fill in fills:
    q = np.zeros(v, np.float32)
    q[:len(fill)] = fill
    rows.append(q)
  exact = np.zeros(v, np.float32)
  exact[:2] = 0.5
  rows.append(exact)
  staged = qformats.aligned_empty((len(rows), 1, v), np.float32)
  staged[:, 0] = np.stack(rows)
  tokens = np.array([0] * 7 + [254, 0], np.int32)[:, None]
  batch = qformats.Rows(tokens, np.full((len(rows), 1), v, np.int32), None,
                        staged)
  want = [False] * 7 + [True, True]
  got = DENSE.validate(batch, vocab=v, device=True).codes[:, 0]
  assert (got == 0).tolist() == want
  for host in (True, False):
    _, valid, _ = kernels.dense_verdict(staged, tokens, None, host=host)
    assert np.asarray(valid)[:, 0].tolist() == want, host


def _audit_oracle(counts, token, u):
  """The sampling audit in Python integers: sum(c[:x]) <= u < sum(c[:x+1])."""
  before = sum(int(c) for c in counts[:token])
  return before <= int(u) < before + int(counts[token])


@pytest.mark.parametrize("v", [16, 600])
def test_dense_host_path_is_the_device_kernel_and_the_oracle(v):
  """The CPU path (XLA entries, exact numpy segment sums) and the jitted
  verdict agree with each other and with `reference` on every class, the
  audit included, with tokens on and around segment boundaries."""
  rng = np.random.default_rng(5)
  rows, tokens = _dense_rows(v, rng)
  # Valid rows with their mass across segments, tokens where the draws
  # land (at boundaries 254/255/256, 509/510 when v = 600) and beside.
  places = [p for p in (0, 1, 254, 255, 256, 509, 510, v - 1) if p < v]
  draws = list(rng.integers(0, M, len(rows)))
  for p in places:
    c = rng.multinomial(M - v, rng.dirichlet(np.ones(v))) + 1
    cum = np.cumsum(c)
    for token, u in ((p, cum[p] - 1), (p, cum[p] - c[p]),
                     (p, cum[p] % M), (max(p - 1, 0), cum[p] - 1)):
      rows = np.concatenate([rows, (c * 2.0 ** -24).astype(np.float32)[None]])
      tokens = np.append(tokens, np.int32(token))
      draws.append(u)
  r = len(rows)
  staged = qformats.aligned_empty((r, 1, v), np.float32)
  staged[:, 0] = rows
  draws = np.asarray(draws, np.uint32)[:, None]
  host = kernels.dense_verdict(staged, tokens[:, None], draws, host=True)
  dev = kernels.dense_verdict(staged, tokens[:, None], draws, host=False)
  valid = np.asarray(host[1])[:, 0]
  assert np.array_equal(valid, np.asarray(dev[1])[:, 0])
  counts = np.asarray(host[0])[:, 0]
  assert np.array_equal(counts[valid], np.asarray(dev[0])[valid, 0])
  assert not counts[~valid].any()        # refused rows: zeros
  drawn = np.asarray(host[2])[:, 0]
  assert np.array_equal(drawn[valid], np.asarray(dev[2])[valid, 0])
  for i in range(r):
    want, code = ref.q_to_counts(rows[i], token=int(tokens[i]))
    assert valid[i] == (code == dj.Status.OK), i
    if valid[i]:
      assert counts[i].tolist() == want, i
      assert drawn[i] == _audit_oracle(want, tokens[i], draws[i, 0]), i
  assert 0 < valid.sum() < r and 0 < drawn[valid].sum() < valid.sum()


def _sparse_cases(rng, vocab, k, count):
  ids = np.sort(np.stack([rng.choice(vocab, k, replace=False)
                          for _ in range(count)]), -1).astype(np.int32)
  counts = rng.multinomial(M - k, np.ones(k) / k, size=count) + 1
  values = (counts * 2.0 ** -24).astype(np.float32)
  tokens = ids[np.arange(count), rng.integers(0, k, count)].copy()
  n = np.full(count, k, np.int32)
  for b in range(count):
    j = int(rng.integers(k))
    case = b % 17
    if case == 1:
      values[b, j] = np.nan
    elif case == 2:
      values[b, j] = -values[b, j]
    elif case == 3:
      values[b, j] += T / 2                     # not dyadic
    elif case == 4:
      values[b, j] += T                         # mass 2^24 + 1
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
      values[b, :2] = [1.0, T]                  # rounds to 2^24 in float32
    elif case == 14:
      tokens[b] = -1
    elif case == 15:
      values[b].view(np.uint32)[j] = 0x00000003   # a subnormal
  return values, ids, n, tokens


def test_sparse_format_is_the_kernel_and_validate_q_row():
  rng = np.random.default_rng(2)
  vocab, k = 1000, 8
  values, ids, n, tokens = _sparse_cases(rng, vocab, k, 340)
  rows = qformats.Rows(tokens, n, ids, values)
  got = SPARSE.validate(rows, vocab=vocab)
  for b in range(len(values)):
    want = _row_code(values[b, :n[b]], ids[b, :n[b]], tokens[b], vocab)
    assert got.codes[b] == want, b
    if want == 0:
      assert np.array_equal(got.counts[b, :n[b]], wire.validate_q_row(
          values[b, :n[b]], ids[b, :n[b]], vocab_size=vocab,
          token=int(tokens[b])))
  assert 0 < (got.codes == 0).sum() < len(values)


def _sparse_padding_cases(rng, vocab, k):
  """Rows whose verdict hangs on n and on the entries past it (never read
  on the wire): garbage padding, n at 0, 1, k and k + 1, -1 ids."""
  values, ids, n, tokens = _sparse_cases(rng, vocab, k, 17)
  values, ids, n = values[:1].repeat(8, 0), ids[:1].repeat(8, 0), n[:1]
  tokens = np.full(8, ids[0, 0], np.int32)
  n = np.array([1, k, 0, k + 1, -1, 2, 1, 3], np.int32)
  values[0] = 0
  values[0, 0] = 1.0
  values[0, 1:] = np.nan                # past n = 1: never read
  ids[0, 1:] = -7
  values[5, :2] = [1.0, 0.0]            # a live q of 0: allowed, but
  values[5, 2:] = np.inf                # not at the token
  tokens[5] = ids[5, 1]
  tokens[1] = np.setdiff1d(np.arange(vocab), ids[1])[0]   # not held
  values[6, 0] = 1.0                    # n = 1 but mass past it
  ids[7, :3] = [ids[7, 0], vocab - 1, vocab - 1]   # duplicate at the top
  return values, ids, n, tokens


def edge_draws(rng, values, ids, n, tokens):
  """Draws of the rows: uniform, and on every other row one at an end of
  the token's interval (prefix - 1, prefix, prefix + c - 1, prefix + c)
  or above 2^31 (negative as int32)."""
  r, k = values.shape
  draws = rng.integers(0, M, r).astype(np.uint32)
  for b in range(0, r, 2):
    live = min(max(int(n[b]), 0), k)
    c = np.round(values[b, :live].astype(np.float64) * M)
    at = np.flatnonzero(ids[b, :live] == tokens[b])
    if at.size and np.isfinite(c).all():
      lo = int(np.nansum(c[:at[0]]))
      draws[b] = [lo, lo + int(c[at[0]]) - 1, max(lo - 1, 0),
                  lo + int(c[at[0]]), 2 ** 31 + lo,
                  2 ** 32 - 1][(b // 2) % 6] % 2 ** 32
  return draws


@pytest.mark.parametrize("vocab,k", [(1000, 8), (40, 32)])
def test_sparse_host_verdict_is_the_jitted_kernel_and_the_oracle(vocab, k):
  """The verifier's host verdict (`sparse.host_verdict`, one compiled
  loop), the jitted kernel and `reference.sparse_q_counts` give the same code, counts
  and audit on every class, padding, and draws on both sides of the
  drawn token's interval."""
  rng = np.random.default_rng(7)
  values, ids, n, tokens = _sparse_cases(rng, vocab, k, 340)
  extra = _sparse_padding_cases(rng, vocab, k)
  values, ids, n, tokens = (np.concatenate([a, b]) for a, b in zip(
      (values, ids, n, tokens), extra))
  r = len(values)
  draws = edge_draws(rng, values, ids, n, tokens)
  rows = qformats.Rows(tokens[:, None], n[:, None], ids[:, None],
                       np.ascontiguousarray(values[:, None]))
  host = sparse.host_verdict(rows, draws[:, None], vocab)
  jit = kernels.sparse_verdict(rows, draws[:, None], vocab)
  jit_codes = qformats.base.with_audit(status.codes(np.asarray(jit[1])),
                                       np.asarray(jit[2]))
  assert np.array_equal(host.codes, jit_codes)
  assert np.array_equal(host.counts, np.asarray(jit[0]))
  assert host.counts.dtype == np.int32
  assert np.array_equal(SPARSE.validate(rows, vocab=vocab, draws=draws[:, None],
                                        device=True).codes, host.codes)
  seen = set()
  for b in range(r):
    want, st = ref.sparse_q_counts(values[b], ids[b], int(n[b]), vocab,
                                   token=int(tokens[b]))
    code = int(status.codes([int(st)])[0])
    if code == 0:
      assert host.counts[b, 0].tolist() == want, b
      at = int(np.flatnonzero(ids[b, :n[b]] == tokens[b])[0])
      if not _audit_oracle(want, at, draws[b].astype(np.int32)):
        code = int(Code.SAMPLING_MISMATCH)
    else:
      assert not host.counts[b].any(), b
    assert host.codes[b, 0] == code, (b, host.codes[b, 0], code)
    seen.add(code)
  # Every class the cases make is there, the audit's refusal included.
  assert {0, Code.SAMPLING_MISMATCH, Code.NON_FINITE, Code.NEGATIVE,
          Code.NON_DYADIC, Code.WRONG_MASS, Code.ID_OUT_OF_RANGE,
          Code.DUPLICATE_ID, Code.UNSORTED_IDS, Code.TOKEN_OUT_OF_RANGE,
          Code.MISSING_Q, Code.ZERO_Q_AT_TOKEN} <= seen, seen


def test_the_staged_sparse_batch_takes_the_host_path_when_small():
  """A small staged batch never reaches JAX (its counts are numpy); both
  sides of the threshold give the same verdict."""
  k = 32
  batch = SPARSE.staging(4, 5, k)
  SPARSE.put(batch, np.broadcast_to(np.arange(k, dtype=np.int32), (4, 5, k)),
             np.full((4, 5, k), M // k))
  batch.tokens[:] = 3
  got = SPARSE.validate(batch, vocab=64, device=True)
  assert isinstance(got.counts, np.ndarray) and not got.codes.any()
  assert batch.values.size <= sparse.HOST_ENTRIES
  jit = kernels.sparse_verdict(batch, None, 64)
  assert np.array_equal(got.counts, np.asarray(jit[0]))


@pytest.mark.parametrize("fmt", ["dense", "sparse"])
def test_the_audit_accepts_exactly_the_drawn_token(fmt):
  """For every row and draw u, the audit accepts token t iff
  sample_counts(counts, u) picks t (both formats, all tokens)."""
  rng = np.random.default_rng(3)
  v, k, rows = 24, 6, 6
  if fmt == "dense":
    counts = rng.multinomial(M, rng.dirichlet(np.ones(v) * 0.3), size=rows)
    width, n = v, np.full(rows, v, np.int32)
    ids = None
  else:
    ids = np.sort(np.stack([rng.choice(v, k, replace=False)
                            for _ in range(rows)]), -1).astype(np.int32)
    counts = rng.multinomial(M - k, np.ones(k) / k, size=rows) + 1
    width, n = k, np.full(rows, k, np.int32)
  values = (counts * 2.0 ** -24).astype(np.float32)
  draws = np.concatenate([rng.integers(0, M, 20), np.cumsum(counts, -1)
                          .reshape(-1) % M, [0, M - 1]]).astype(np.uint32)
  for u in draws:
    u_rows = np.full(rows, u, np.uint32)
    index = np.asarray(dj.sample_counts(counts.astype(np.int32), u_rows))
    drawn = index if ids is None else ids[np.arange(rows), index]
    for tokens, want in ((drawn, 0), ((drawn + 1) % v, None)):
      batch = qformats.Rows(tokens.astype(np.int32)[:, None], n[:, None],
                            None if ids is None else ids[:, None],
                            np.ascontiguousarray(values[:, None]))
      fmt_obj = DENSE if ids is None else SPARSE
      got = fmt_obj.validate(batch, vocab=v, draws=u_rows[:, None])
      if want == 0:
        assert (got.codes == 0).all(), (u, got.codes)
      else:   # another token: refused (SAMPLING_MISMATCH or no mass there)
        assert (got.codes != 0).all(), (u, got.codes)
      if ids is None:
        staged = qformats.aligned_empty((rows, 1, width), np.float32)
        staged[:] = batch.values
        dev = DENSE.validate(batch._replace(values=staged), vocab=v,
                             draws=u_rows[:, None], device=True)
        assert np.array_equal(dev.codes, got.codes)


def test_audit_draws_are_the_proposers():
  # The verifier's draws equal the proposer's own, key for key.
  seeds = np.array([0, 2 ** 64 - 1, 12345], np.uint64)
  gens = np.array([0, 7, 2 ** 32 - 1])
  rounds = np.array([1, 2 ** 31, 5])
  anchors = np.array([0, 2 ** 40, 99], np.int64)
  got = audit.proposal_draws(seeds, gens, rounds, anchors, 3, pad_to=4)
  assert got.shape == (3, 3) and got.dtype == np.uint32
  import jax  # pylint: disable=g-import-not-at-top
  with jax.enable_x64(True):
    for r in range(3):
      # The proposer's traced int64 view of the seed (an array: a host
      # integer must be a nonnegative uint64 value).
      key = dj.rng.round_key(np.asarray(seeds[r:r + 1].view(np.int64)[0]),
                             np.uint32(gens[r]), np.uint32(rounds[r]))
      for i in range(3):
        want = dj.rng.proposal_draw(key, np.int64(anchors[r] + i))
        assert int(want) == int(got[r, i])
        assert int(got[r, i]) < M


# ---------------------------------------------------------------------------
# What each format owns beyond its layout: the rest of the library asks
# these instead of branching on the format.


@pytest.mark.parametrize("fmt", list(qformats.FORMATS.values()),
                         ids=lambda f: f.name)
def test_a_format_is_found_by_its_name_and_its_session(fmt):
  assert qformats.BY_NAME[fmt.name] is fmt
  assert qformats.negotiated(fmt.mode, fmt.representation) is fmt
  assert fmt.mass == (M if fmt.sampled else 0)
  assert fmt.has_values == fmt.sampled


def test_a_greedy_session_has_one_format_and_a_sampled_one_needs_q():
  token = qformats.get(Representation.TOKEN)
  for rep in Representation:   # whatever a greedy session asks for
    assert qformats.negotiated(wire.layouts.Mode.GREEDY, rep) is token
  with pytest.raises(ValueError, match="on a sampled session"):
    qformats.negotiated(wire.layouts.Mode.SAMPLED, Representation.TOKEN)
  with pytest.raises(ValueError, match="on a sampled session"):
    qformats.negotiated(wire.layouts.Mode.SAMPLED, 99)


def test_widths_are_what_hello_carries():
  v = 1001
  assert DENSE.width(v, 32) == v and DENSE.width(v, 32, shards=4) == 251
  assert SPARSE.width(v, 32, shards=4) == 32
  for bad in (0, v + 1):
    with pytest.raises(ValueError, match=f"max_support {bad} not in"):
      SPARSE.width(v, bad)
  assert qformats.get(Representation.TOKEN).width(v, 32) == 0
  assert DENSE.shardable and not SPARSE.shardable
  assert SPARSE.uses_support and not DENSE.uses_support


def test_seed_bytes_reproduce_the_seed_table():
  v, d = dj.DEFAULT_VOCAB, 5
  assert DENSE.seed_bytes(d, v, 32) == 2_585_600
  assert SPARSE.seed_bytes(d, v, 32) == 1_280
  assert SPARSE.seed_bytes(d, v, 256) == 10_240
  assert qformats.get(Representation.TOKEN).seed_bytes(d, v, 32) == 0


@pytest.mark.parametrize("fmt", [DENSE, SPARSE], ids=lambda f: f.name)
def test_put_lays_out_rows_that_validate_to_their_counts(fmt):
  v, d = 64, 3
  ids = np.array([[2, 5, 9, 30], [0, 1, 2, 63], [7, 8, 40, 41]], np.int32)
  counts = np.array([[1, M // 2, M // 4, M // 4 - 1]] * d, np.int64)
  counts[1] = [M // 2, 0, M // 2, 0]           # zeros are allowed
  rows = fmt.staging(1, d, fmt.width(v, 4))
  rows = qformats.Rows(*(None if a is None else a[0] for a in rows))
  fmt.put(rows, ids, counts)
  rows.tokens[:] = ids[:, 2]
  verdict = fmt.validate(rows, vocab=v)
  assert not verdict.codes.any()
  dense = np.zeros((d, v), np.int64)
  np.put_along_axis(dense, ids, counts, -1)
  q = fmt.to_q(verdict.counts, rows)
  if isinstance(q, dj.SparseQ):
    got = np.zeros((d, v), np.int64)
    for i in range(d):
      got[i, q.ids[i, :q.n[i]]] = q.counts[i, :q.n[i]]
  else:
    got = np.asarray(q.counts)
  np.testing.assert_array_equal(got, dense)


@pytest.mark.parametrize("fmt", list(qformats.FORMATS.values()),
                         ids=lambda f: f.name)
def test_example_q_is_a_valid_q_of_the_session_shapes(fmt):
  v, d, k = 1000, 4, 7
  q = fmt.example_q(d, v, k)
  if not fmt.sampled:
    assert q is None
    return
  counts = np.asarray(q.counts)
  assert counts.shape == (d, fmt.width(v, k)) and counts.dtype == np.int32
  assert (counts.sum(-1) == M).all() and (counts > 0).all()


@pytest.mark.parametrize("fmt", [DENSE, SPARSE, qformats.BY_NAME["greedy"]],
                         ids=lambda f: f.name)
def test_propose_is_the_core_row(fmt):
  v = 50
  logits = np.random.default_rng(3).normal(size=v).astype(np.float32)
  draw = np.uint32(1234567)
  token, status, values, ids, n = fmt.propose(
      logits, draw if fmt.sampled else None, fmt.width(v, 8),
      dj.rowops.LOCAL)
  assert int(status) == 0
  if fmt is DENSE:
    counts, want, _ = dj.propose_dense(logits, draw)
    assert ids is None and int(n) == v
  elif fmt is SPARSE:
    want_ids, counts, want_n, want, _ = dj.propose_sparse(logits, draw, 8)
    np.testing.assert_array_equal(ids, want_ids)
    assert int(n) == int(want_n)
  else:
    assert values is None and ids is None and int(n) == 0
    assert int(token) == int(np.argmax(logits))
    return
  assert int(token) == int(want)
  np.testing.assert_array_equal(values, dj.counts_to_q(counts))


def _one_dense_row(width, vocab):
  """One valid dense row of `width` entries (mass on ids 1 and 2 < vocab)."""
  values = np.zeros((1, width), np.float32)
  values[0, [1, 2]] = 0.5
  return qformats.Rows(np.asarray([1], np.int32),
                       np.asarray([width], np.int32), None, values)


@pytest.mark.parametrize("device", [False, True])
def test_wider_integer_fields_are_range_checked_before_the_cast(device):
  """Issue 40: the formats' validate is public; an int64 field was cast to
  int32 and wrapped (token 2^32 + 3 became 3, sparse n and ids too) into
  a row reported OK. A wider field is range-checked first (ValueError), a
  non-integer one or non-float32 values is a TypeError; a wider field
  whose values fit is still judged as its int32 cast."""
  wrap = (1 << 32) + 2          # == 2 after an int32 cast
  row = _one_dense_row(16, 16)
  ok = DENSE.validate(row._replace(tokens=np.asarray([2], np.int64)),
                      vocab=16, device=device)
  assert ok.codes.tolist() == [0]
  for name, value in (("tokens", [wrap]), ("n", [16 + (1 << 32)])):
    bad = row._replace(**{name: np.asarray(value, np.int64)})
    with pytest.raises(ValueError, match=rf"rows\.{name} holds .*int32"):
      DENSE.validate(bad, vocab=16, device=device)
  with pytest.raises(TypeError, match=r"rows\.tokens must be int32"):
    DENSE.validate(row._replace(tokens=np.asarray([1.0])), vocab=16,
                   device=device)
  with pytest.raises(TypeError, match=r"rows\.values must be float32"):
    DENSE.validate(row._replace(values=row.values.astype(np.float64)),
                   vocab=16, device=device)
  # Sparse: n and ids that wrap to a valid row, on both paths.
  sparse_row = qformats.Rows(np.asarray([3], np.int32),
                             np.asarray([2], np.int32),
                             np.asarray([[3, 5]], np.int32),
                             np.asarray([[0.5, 0.5]], np.float32))
  assert SPARSE.validate(sparse_row, vocab=16,
                         device=device).codes.tolist() == [0]
  for name, value in (("n", [2 + (1 << 32)]),
                      ("ids", [[3, 5 + (1 << 32)]]),
                      ("tokens", [3 - (1 << 32)])):
    bad = sparse_row._replace(**{name: np.asarray(value, np.int64)})
    with pytest.raises(ValueError, match=rf"rows\.{name} holds"):
      SPARSE.validate(bad, vocab=16, device=device)
  greedy = qformats.BY_NAME["greedy"]
  with pytest.raises(ValueError, match=r"rows\.tokens holds"):
    greedy.validate(qformats.Rows(np.asarray([wrap], np.int64),
                                  np.zeros(1, np.int32)), vocab=16)


@pytest.mark.parametrize("device", [False, True])
def test_dense_mass_past_the_vocabulary_is_refused(device):
  """Issue 40: with rows wider than V (padding ids V..w-1), the device
  verdict ignored `vocab` and accepted mass at a padding id."""
  row = _one_dense_row(16, 12)
  row.values[0, [2, 13]] = [0.0, 0.5]       # half the mass on id 13 >= V
  got = DENSE.validate(row, vocab=12, device=device)
  assert got.codes.tolist() != [0]
  want = DENSE.validate(row, vocab=12, device=False)
  assert got.codes.tolist() == want.codes.tolist()
  fine = _one_dense_row(16, 12)             # zeros past V: valid
  assert DENSE.validate(fine, vocab=12, device=device).codes.tolist() == [0]
