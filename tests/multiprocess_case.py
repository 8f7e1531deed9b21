"""The round both the single-process and the 2-process runs compute."""

import jax
import jax.numpy as jnp
import numpy as np

import dyadic_jax as dj

V, DEPTH, K = 1001, 3, 16


def build():
  rng = np.random.default_rng(1234)
  target = (rng.normal(size=(DEPTH + 1, V)) * 2).astype(np.float32)
  draft = target[:DEPTH] + rng.normal(size=(DEPTH, V)).astype(np.float32)
  w, _ = dj.draft_weights(draft)
  return {"target": target, "draft": draft, "weights": np.asarray(w)}


def run(case, *, mesh=None):
  """Replicated results of the round; sharded ops when mesh is given."""
  import sharding  # pylint: disable=g-import-not-at-top
  ops = dj if mesh is None else sharding
  kw = {} if mesh is None else {"mesh": mesh}
  key = dj.round_key(7, 0, 0)
  ids, counts, n, status = ops.allocate_sparse(case["weights"], K, **kw)
  u = dj.draw24(jax.vmap(lambda i: dj.draw_key(key, i, dj.Domain.PROPOSAL))(
      jnp.arange(DEPTH)))
  dense, _ = dj.allocate_dense(case["weights"])
  tokens = ops.sample_counts(dense, u, **kw)
  q = dj.SparseQ(ids, counts, n)
  accepted, next_token, verify_status = ops.verify_chain(
      case["target"], q, tokens, key, **kw)
  fallback, _ = ops.sample_target(
      case["target"][0], dj.draw_key(key, 0, dj.Domain.TARGET_ONLY), **kw)
  as_list = lambda x: np.asarray(x).tolist()
  return {"ids": as_list(ids), "counts": as_list(counts), "n": as_list(n),
          "status": as_list(status), "tokens": as_list(tokens),
          "accepted": int(accepted), "next_token": int(next_token),
          "verify_status": int(verify_status),
          "fallback": int(fallback)}
