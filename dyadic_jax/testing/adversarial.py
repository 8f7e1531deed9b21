"""Adversarial inputs shared by the oracle, identity and qualification tests.

Each generator is deterministic (fixed seeds), so a failure found on one
machine reproduces on another. The rows target the contract's corners:
ties between remainders (the largest-remainder cut), ties straddling
shard boundaries, tiny and masked entries, heavy tails, one-hot rows, rows
whose mass sits on one shard, and (p, q) pairs whose supports are disjoint,
nested or nearly one-hot.

  allocation_rows()        (name, normalized float64 weights) for the
                           dense/sparse allocation oracle checks
  weight_rows(v)           [R, v] weight rows for sharded identity checks
  logit_rows(v)            [4, v] float32 logits: masked half, one live id
                           on the last shard, all equal
  verification_cases()     {name: (p, q)} unnormalized rows, V = 10
  round_requests(v, ...)   target logits, dense and sparse q, drafts and
                           keys of one verification round
  logits_for, counts_for, sparse_q: (p, q) -> library inputs
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dyadic_jax import allocation, draws, rng, verification, weights
from dyadic_jax.constants import M, Status
# Shard counts whose block edges `weight_rows` puts ties across.
SHARD_COUNTS = (1, 2, 3, 4, 8)


def normalized(x) -> np.ndarray:
  """x / its sum over the last axis, in float64."""
  x = np.asarray(x, np.float64)
  return x / x.sum(-1, keepdims=True)


def pad_rows(rows, width: int) -> np.ndarray:
  """Rows of different lengths, zero-padded to one [R, width] array."""
  return np.stack([np.pad(np.asarray(w, np.float64), (0, width - len(w)))
                   for w in rows])


def allocation_rows() -> list[tuple[str, np.ndarray]]:
  """Adversarial normalized weight rows (sorted by name), lengths <= 512."""
  gen = np.random.default_rng(20261130)
  rows = {
      "one_hot": np.eye(1, 17, 5)[0],
      "all_equal_3": np.full(3, 1 / 3),
      "all_equal_7": np.full(7, 1 / 7),
      "exact_halves": np.array([0.5, 0.5, 0.0]),
      "ties_across_remainders": normalized([1, 1, 1, 2, 2, 2, 3, 3, 3]),
      "equal_remainders_many": normalized(np.tile([1.0, 2.0, 4.0], 11)),
      "tiny_entries": normalized([1.0] + [1e-9] * 20 + [1e-300] * 3),
      "masked_zeros": normalized(np.where(np.arange(40) % 3 == 0, 0.0,
                                          gen.random(40))),
      "heavy_tail": normalized(np.exp(gen.normal(size=300) * 8)),
      "dyadic_exact": np.array([0.25, 0.25, 0.125, 0.375]),
      "random_64": normalized(gen.random(64)),
      # More tied remainders than the refined path ranks: the exact path.
      "many_ties_plus_larger": normalized([1.0] * 100 + [1.7] * 3),
  }
  # Remainders equal to the bit but with distinct weights: w*M = j + 0.5.
  half = (np.arange(10) + 0.5) / M
  rows["exact_half_remainders"] = np.concatenate([half, [1 - half.sum()]])
  return sorted(rows.items())


def weight_rows(v: int, shard_counts=SHARD_COUNTS) -> np.ndarray:
  """Weight rows [9, v] with the layouts that stress a sharded op."""
  gen = np.random.default_rng(v)
  size8 = -(-v // 8)
  rows = [
      normalized(gen.random(v)),                              # random
      normalized(np.exp(gen.normal(size=v) * 6)),             # heavy tail
      normalized(np.ones(v)),                                 # all equal
      normalized(np.where(np.arange(v) < size8, 1.0 + gen.random(v), 0)),
      normalized(np.where(np.arange(v) >= v - size8, 1.0, 0.0)),  # last
      normalized(np.tile([1.0, 2.0, 2.0, 1.0], -(-v // 4))[:v]),  # ties
      normalized(np.where(np.arange(v) % 3 == 0, 0.0, gen.random(v))),
      np.eye(1, v, v // 2)[0],                                # one-hot
  ]
  # Ties straddling every shard boundary of every mesh: equal weights on
  # both sides of each block edge, larger than the rest.
  straddle = np.ones(v)
  for n in shard_counts:
    edge = -(-v // n)
    for b in range(edge, v, edge):
      straddle[max(b - 1, 0):b + 1] = 3.0
  rows.append(normalized(straddle))
  return np.stack(rows)


def logit_rows(v: int) -> np.ndarray:
  """float32 logits [4, v]: random, half masked, one live id, all equal."""
  gen = np.random.default_rng(v + 1)
  x = (gen.normal(size=(4, v)) * 3).astype(np.float32)
  x[1, : v // 2] = -np.inf                    # masked half
  x[2, :] = -np.inf
  x[2, -1] = 0.0                              # all mass on the last shard
  x[3] = 1.5                                  # all equal
  return x


def verification_cases() -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{name: (p, q)}: unnormalized target and draft rows over V = 10."""
  v = 10
  gen = np.random.default_rng(4)
  p_rand = gen.dirichlet(np.ones(v))
  one_hot_ish = np.full(v, 1.0)
  one_hot_ish[3] = 1e7
  tiny_at_0 = np.r_[1e-12, np.full(v - 1, 1.0)]
  masked = np.where(np.arange(v) % 3 == 0, 0.0, gen.random(v))
  return {
      "q_equals_p": (p_rand, p_rand),
      "disjoint_supports": (np.r_[np.ones(5), np.zeros(5)],
                            np.r_[np.zeros(5), np.ones(5)]),
      "tiny_p_at_drafted": (tiny_at_0, np.r_[100.0, np.ones(v - 1)]),
      "grammar_mask_in_p": (masked, gen.random(v)),
      "sparse_q": (gen.random(v), np.r_[gen.random(3), np.zeros(v - 3)]),
      "q_nearly_one_hot": (gen.random(v), one_hot_ish),
      "p_one_hot": (np.eye(1, v, 7)[0], gen.random(v)),
      "random": (gen.random(v), gen.random(v)),
  }


def logits_for(p) -> np.ndarray:
  """float32 logits whose softmax is p; zeros become -inf (a grammar mask)."""
  p = np.asarray(p, np.float64)
  with np.errstate(divide="ignore"):
    return np.where(p > 0, np.log(p), -np.inf).astype(np.float32)


def counts_for(q) -> list[int]:
  """Dense dyadic counts of q (normalized first) by `allocate_dense`."""
  q = np.asarray(q, np.float64)
  counts, status = allocation.allocate_dense((q / q.sum())[None])
  if int(status[0]) != Status.OK:
    raise ValueError(f"counts_for: allocation refused q ({int(status[0])})")
  return np.asarray(counts[0]).tolist()


def sparse_q(count_rows) -> verification.SparseQ:
  """SparseQ with k = V from dense count rows (support = positive counts)."""
  rows = np.asarray(count_rows, np.int32)
  ids = np.full(rows.shape, -1, np.int32)
  counts = np.zeros(rows.shape, np.int32)
  n = (rows > 0).sum(-1).astype(np.int32)
  for i, row in enumerate(rows):
    support = np.flatnonzero(row)
    ids[i, :len(support)] = support
    counts[i, :len(support)] = row[support]
  return verification.SparseQ(ids, counts, n)


class Round(NamedTuple):
  """One verification round of `requests` chains of depth D over V ids."""
  target: np.ndarray              # float32[R, D+1, V]
  dense: verification.DenseQ      # counts int32[R, D, V]
  sparse: verification.SparseQ    # ids/counts int32[R, D, k], n int32[R, D]
  tokens: jax.Array               # int32[R, D], drawn from the dense q
  keys: jax.Array                 # typed keys [R]


def round_requests(v: int, requests: int = 6, depth: int = 3,
                   k: int = 8) -> Round:
  """A round with a grammar mask and a sparse support on the last shard.

  Request 0 drafts only inside the last block of an 8-shard layout, so its
  sparse support lives on one shard and the others own none of it.
  """
  gen = np.random.default_rng(v + 2)
  target = (gen.normal(size=(requests, depth + 1, v)) * 2).astype(np.float32)
  target[:, :, : v // 3] = -np.inf            # a grammar mask
  draft = target[:, :depth] + gen.normal(size=(requests, depth, v)).astype(
      np.float32)
  draft[0, :, : v - (-(-v // 8))] = -np.inf
  w, _ = weights.draft_weights(draft)
  counts, _ = allocation.allocate_dense(w)
  ids, scounts, n, _ = allocation.allocate_sparse(w, min(k, v))
  keys = jax.vmap(lambda r: rng.round_key(3, 0, r))(jnp.arange(requests))
  u = rng.proposal_draws(keys, depth)
  tokens = draws.sample_counts(counts, u)
  return Round(target, verification.DenseQ(counts),
               verification.SparseQ(ids, scounts, n), tokens, keys)
