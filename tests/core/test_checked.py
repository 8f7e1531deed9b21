"""`checked` and `raise_for_status`: a refused row raises, whatever its rank.

A single-request op (`verify_chain`, `sample_target` of one row) returns a
0-d status; it must raise like a batched op's status does.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj

S = dj.Status
V, D = 64, 3


def _round():
  rng = np.random.default_rng(0)
  target = rng.normal(size=(D + 1, V)).astype(np.float32)
  w, _ = dj.draft_weights(target[:D])
  counts, _ = dj.allocate_dense(w)
  return target, np.asarray(counts), np.array([1, 2, 3], np.int32)


@pytest.mark.parametrize("status", [np.int32(9), 9, np.array(9)])
def test_a_scalar_status_raises(status):
  with pytest.raises(dj.DyadicError) as e:
    dj.raise_for_status("op", status)
  assert e.value.status == S.WRONG_MASS
  assert e.value.rows == ((),) and e.value.statuses == (S.WRONG_MASS,)
  assert str(e.value).startswith("op: 1 row(s) refused, first WRONG_MASS")


@pytest.mark.parametrize("status", [np.int32(0), 0, np.zeros(3, np.int32),
                                    np.zeros((2, 2), np.int32)])
def test_ok_statuses_pass(status):
  dj.raise_for_status("op", status)


def test_batched_statuses_name_their_rows():
  with pytest.raises(dj.DyadicError) as e:
    dj.raise_for_status("op", np.array([0, 9, 0, 1], np.int32))
  assert e.value.rows == (1, 3) and e.value.statuses == (S.WRONG_MASS, S.NAN)
  with pytest.raises(dj.DyadicError) as e:
    dj.raise_for_status("op", np.array([[0, 0], [0, 4]], np.int32))
  assert e.value.rows == ((1, 1),) and e.value.status == S.ZERO_MASS


def test_checked_single_request_op_raises_on_a_refused_q():
  target, counts, draft = _round()
  key = dj.round_key(1, 0, 0)
  # Counts that no longer sum to M: verify_chain refuses the request.
  _, token, status = dj.verify_chain(target, dj.DenseQ(counts + 1), draft,
                                     key)
  assert int(status) != S.OK and int(token) == -1
  with pytest.raises(dj.DyadicError) as e:
    dj.checked(dj.verify_chain)(target, dj.DenseQ(counts + 1), draft, key)
  assert e.value.op == "verify_chain" and e.value.rows == ((),)
  assert e.value.status == S(int(status))
  # A valid round goes through, the status dropped.
  accepted, token = dj.checked(dj.verify_chain)(target, dj.DenseQ(counts),
                                                draft, key)
  assert 0 <= int(accepted) <= D and 0 <= int(token) < V


def test_checked_batched_op_names_the_refused_request():
  target, counts, draft = _round()
  q = np.stack([counts, counts + 1])
  keys = jnp.stack([dj.round_key(1, 0, 0), dj.round_key(1, 0, 1)])
  with pytest.raises(dj.DyadicError) as e:
    dj.checked(dj.verify_batch)(np.stack([target] * 2), dj.DenseQ(q),
                                np.stack([draft] * 2), keys,
                                np.zeros(2, np.int64))
  assert e.value.op == "verify_batch" and e.value.rows == (1,)
