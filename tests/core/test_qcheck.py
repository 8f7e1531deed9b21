"""`dyadic_jax.qcheck.check_dense`: qrows' dense verdict and the sampling
audit, the same bits on one device and over 1, 2, 4 and 8 vocabulary shards.

A batch of rows holds one defect per class (each row refused by exactly the
class it was built to fail, as the exact oracle `reference.q_to_counts`
and `qrows.dense` judge it) plus valid rows whose
token is or is not the one its draw selects; V = 37 is uneven on every
mesh, so the padding ids are exercised too.
"""

import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import qcheck, qrows
from dyadic_jax import reference as ref
import sharding
from tests import meshes

M = dj.M
S = dj.Status
V = 37


def _cases():
  rng = np.random.default_rng(7)
  rows, tokens = [], []

  def valid():
    counts = np.zeros(V, np.int64)
    live = rng.choice(V, 5, replace=False)
    counts[live] = rng.multinomial(M - 5, np.ones(5) / 5) + 1
    return counts

  for _ in range(6):                       # valid rows, live tokens
    c = valid()
    rows.append(c / M)
    tokens.append(int(rng.choice(np.flatnonzero(c))))
  base = valid()
  live = int(np.flatnonzero(base)[0])
  for edit, token in [
      (lambda q: q, V),                                   # token out of range
      (lambda q: np.where(np.arange(V) == live, np.nan, q), live),
      (lambda q: np.where(np.arange(V) == live, np.inf, q), live),
      (lambda q: np.where(np.arange(V) == 3, -2.0 ** -24, q), live),
      (lambda q: np.where(np.arange(V) == 3, 1.5, q), live),
      (lambda q: np.where(np.arange(V) == 3, 2.0 ** -26, q), live),  # subnormal grid
      (lambda q: q * 0.5, live),                          # mass 2^23
      (lambda q: q, int(np.flatnonzero(base == 0)[0])),   # zero q at token
  ]:
    rows.append(edit(base / M))
    tokens.append(token)
  values = np.asarray(rows, np.float32)
  tokens = np.asarray(tokens, np.int32)
  draws = rng.integers(0, M, len(tokens)).astype(np.uint32)
  return values, tokens, draws


def _want(values, tokens, draws):
  """The exact oracle's verdict and draw, row by row (Python fractions)."""
  counts, status, drawn = [], [], []
  for row, token, draw in zip(values, tokens, draws):
    c, st = ref.q_to_counts(row, V, int(token))
    counts.append(c)
    status.append(int(st))
    drawn.append(ref.sample_counts(c, int(draw)) == token)
  return np.asarray(counts), np.asarray(status), np.asarray(drawn)


def test_local_equals_the_oracle_and_qrows_dense():
  values, tokens, draws = _cases()
  counts, status, drawn = (np.asarray(x) for x in qcheck.check_dense(
      values, tokens, draws, vocab=V))
  want_counts, want_status, want_drawn = _want(values, tokens, draws)
  np.testing.assert_array_equal(counts, want_counts)
  np.testing.assert_array_equal(status, want_status)
  np.testing.assert_array_equal(drawn, want_drawn)
  kernel = qrows.dense(values.view(np.uint32), tokens, vocab=V)
  np.testing.assert_array_equal(counts, kernel[0])
  np.testing.assert_array_equal(status, kernel[1])
  # Every class was hit, and the audit saw both verdicts on valid rows.
  assert set(status.tolist()) == {
      0, S.TOKEN_OUT_OF_RANGE, S.NAN, S.INF, S.NEGATIVE, S.WRONG_MASS,
      S.NON_DYADIC, S.ZERO_Q_AT_TOKEN}


def test_audit_picks_the_drawn_token():
  values, tokens, draws = _cases()
  counts, _ = qrows.dense(values[:6].view(np.uint32), tokens[:6], vocab=V)
  # The token each draw selects: the audit accepts exactly it.
  drawn_tokens = np.asarray(dj.sample_counts(counts, draws[:6]))
  _, status, drawn = qcheck.check_dense(values[:6], drawn_tokens, draws[:6],
                                        vocab=V)
  assert not np.asarray(status).any() and np.asarray(drawn).all()
  _, _, drawn = qcheck.check_dense(values[:6], (drawn_tokens + 1) % V,
                                   draws[:6], vocab=V)
  assert not np.asarray(drawn).any()


def test_padding_ids_must_be_zero():
  values, tokens, draws = _cases()
  padded = np.zeros((len(tokens), 40), np.float32)
  padded[:, :V] = values
  padded[0, 39] = 2.0 ** -24
  _, status, _ = qcheck.check_dense(padded, tokens, draws, vocab=V)
  assert int(status[0]) == S.PADDING_NONZERO


@pytest.mark.multidevice
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sharded_equals_local(n):
  mesh = meshes.vocab_mesh(n)
  values, tokens, draws = _cases()
  want = [np.asarray(x) for x in qcheck.check_dense(values, tokens, draws,
                                                    vocab=V)]
  got = qcheck.check_dense(values, tokens, draws, vocab=V,
                           executor=sharding.executor(mesh))
  np.testing.assert_array_equal(
      np.asarray(sharding.unpad(got[0], V)), want[0])
  for g, w in zip(got[1:], want[1:]):
    np.testing.assert_array_equal(np.asarray(g), w)


def test_bad_input_is_refused():
  values, tokens, draws = _cases()
  with pytest.raises(TypeError):
    qcheck.check_dense(values.astype(np.float64), tokens, draws, vocab=V)
  with pytest.raises(ValueError):
    qcheck.check_dense(values, tokens[:3], draws, vocab=V)
  with pytest.raises(ValueError):
    qcheck.check_dense(values, tokens, draws, vocab=V + 1)
