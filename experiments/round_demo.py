"""One speculative round of one request on the toy models, then a check.

    python -m experiments.round_demo [--vocab=129280 --depth=5 --k=32]

Expected runtime: 20-30 s on a 2-core CPU at the default V = 129280 and
--check_samples=2000 (most of it compilation); smaller --vocab is faster.

The round (docs/architecture.md, "One round": the worker's and the
verifier's steps, without the wire):

1. Draft: for i = 1..D, draft logits of the position after x_{i-1} (x_0 is
   the committed prefix token), `draft_weights`, `allocate_sparse` (top-k),
   and x_i drawn from the dyadic q with the PROPOSAL key of its position.
2. Verify: target logits for the D + 1 positions conditioned on the drafted
   chain, then `verify_chain` with the exact q each x_i was drawn from.

The check then runs many independent one-position rounds (D = 1, same
prefix, one round key each) and compares the histogram of the first emitted
token with the ordinary target-only sampler (`sample_target`, TARGET_ONLY
keys) on the same number of samples: a two-sample chi-square test, plus a
goodness-of-fit test of the speculative sample against the exact P / T.
The exit status is 1 when either test rejects at --alpha.
"""

import json
import logging
import typing

from absl import flags

from experiments import cli

_VOCAB = flags.DEFINE_integer(
    "vocab", cli.DEFAULT_VOCAB, f"Vocabulary size V of the toy target and "
    f"draft, 2..{cli.MAX_VOCAB}.", lower_bound=2, upper_bound=cli.MAX_VOCAB)
_DEPTH = flags.DEFINE_integer(
    "depth", 5, "Draft depth D: tokens proposed in the round, 1..64.",
    lower_bound=1, upper_bound=64)
_K = flags.DEFINE_integer(
    "k", 32, "Sparse draft support: top-k tokens per proposal row, in "
    "[1, V].", lower_bound=1)
_SEED = flags.DEFINE_integer(
    "seed", 0, "Request seed of the RNG key schedule, in [0, 2^31) (the toy "
    "models always use their own fixed seed).", lower_bound=0,
    upper_bound=(1 << 31) - 1)
_CLOSENESS = flags.DEFINE_float(
    "closeness", 0.9, "Draft closeness to the target in [0, 1]; 1 makes the "
    "draft logits equal to the target's.")
_PREFIX_TOKEN = flags.DEFINE_integer(
    "prefix_token", 0, "Committed token x_0 the round starts after, in "
    "[0, V).", lower_bound=0)
_CHECK_SAMPLES = flags.DEFINE_integer(
    "check_samples", 2000, "Independent rounds (and target-only samples) in "
    "the empirical check, 0..10^6; 0 skips it.", lower_bound=0,
    upper_bound=1_000_000)
_ALPHA = flags.DEFINE_float(
    "alpha", 1e-3, "Significance level of the chi-square tests, in (0, 1) "
    "(their false failure rate for a correct implementation).")
_JSON_OUT = flags.DEFINE_string(
    "json_out", None, "Optional path for a JSON record of the round and the "
    "check.")

cli.check(["k", "vocab"], lambda k, vocab: k <= vocab,
          "--k must be <= --vocab")
cli.check(["prefix_token", "vocab"],
          lambda prefix_token, vocab: prefix_token < vocab,
          "--prefix_token must be < --vocab")
cli.check("closeness", lambda c: 0.0 <= c <= 1.0,
          "--closeness must be a number in [0, 1]")
cli.check("alpha", cli.in_open_unit, "--alpha must be in (0, 1)")
cli.check_output_path("json_out")
cli.parse_flags_early(__name__, extra="experiments")

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

import dyadic_jax as dj
from dyadic_jax.testing import stats
from dyadic_jax.models import toy_pair
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

_TOP = 10          # histogram bins: the top target tokens, then "other"
_CHECK_BATCH = 50  # rounds per vmapped chunk: bounds the [B, 2, V] buffers


def propose(toy: toy_pair.ToyModel, key: jax.Array, prefix_token: int, *,
            depth: int, k: int, anchor: int
            ) -> tuple[jax.Array, jax.Array, dj.SparseQ, jax.Array]:
  """Draws x_1..x_D from sparse dyadic draft rows (worker side).

  Returns (tokens int32[D], slots int32[D], q, status int32[D]): slots[i]
  is the position of x_i inside its sparse row, q a `SparseQ` of [D, k] rows.
  """
  prev = jnp.int32(prefix_token)
  tokens, slots, ids, counts, n, status = [], [], [], [], [], []
  for i in range(depth):
    # Row i depends on the token drawn just before it: the Markov dependency.
    logits = toy_pair.draft_logits(toy, prev)
    w, w_status = dj.draft_weights(logits)
    row_ids, row_counts, row_n, a_status = dj.allocate_sparse(w, k)
    u = dj.draw24(dj.draw_key(key, anchor + i, dj.Domain.PROPOSAL))
    slot = dj.sample_counts(row_counts, u)
    prev = row_ids[slot]
    tokens.append(prev)
    slots.append(slot)
    ids.append(row_ids)
    counts.append(row_counts)
    n.append(row_n)
    status.append(jnp.where(w_status != dj.Status.OK, w_status, a_status))
  q = dj.SparseQ(jnp.stack(ids), jnp.stack(counts), jnp.stack(n))
  return jnp.stack(tokens), jnp.stack(slots), q, jnp.stack(status)


def chain_target_logits(toy: toy_pair.ToyModel, prefix_token: int,
                        tokens: jax.Array) -> jax.Array:
  """Target logits f32[D+1, V] for the positions of x_1..x_D and the bonus."""
  prev = jnp.concatenate([jnp.asarray([prefix_token], jnp.int32), tokens])
  return toy_pair.target_logits(toy, prev)


def first_emitted(toy: toy_pair.ToyModel, prefix_token: int,
                  q_row: tuple[jax.Array, jax.Array, jax.Array],
                  key: jax.Array, *, anchor: int) -> jax.Array:
  """First emitted token of a D = 1 round (the drafted one if accepted)."""
  ids, counts, n = q_row
  u = dj.draw24(dj.draw_key(key, anchor, dj.Domain.PROPOSAL))
  x1 = ids[dj.sample_counts(counts, u)]
  tl = chain_target_logits(toy, prefix_token, x1[None])
  q = dj.SparseQ(ids[None], counts[None], n[None])
  accepted, token, _ = dj.verify_chain(tl, q, x1[None], key, anchor=anchor)
  return jnp.where(accepted > 0, x1, token)


def histogram(tokens: jax.typing.ArrayLike,
              top_ids: np.ndarray) -> np.ndarray:
  """Counts of each of top_ids, then of everything else."""
  tokens = np.asarray(tokens)
  hits = [int(np.sum(tokens == t)) for t in top_ids]
  return np.array(hits + [tokens.size - sum(hits)], np.int64)


def run_check(toy: toy_pair.ToyModel, prefix_token: int, *, k: int,
              seed: int, anchor: int, samples: int,
              alpha: float) -> dict[str, typing.Any]:
  """Speculative first token vs target-only sampling; prints a table."""
  t0 = toy_pair.target_logits(toy, prefix_token)
  w, _ = dj.draft_weights(toy_pair.draft_logits(toy, prefix_token))
  ids, counts, n, status = dj.allocate_sparse(w, k)
  dj.raise_for_status("allocate_sparse", status)

  # Generation 1 keeps the check's rounds apart from the demo round (gen 0).
  rounds = jnp.arange(samples)
  round_keys = jax.vmap(lambda r: dj.round_key(seed, 1, r))(rounds)
  # The library's ops scope x64 to their own traces; a caller's jit around
  # them compiles outside that scope, so it runs under enable_x64 itself
  # (dyadic_jax/x64.py; without it the ops raise X64Required).
  with jax.enable_x64(True):
    spec = jax.jit(lambda keys: jax.lax.map(
        lambda key: first_emitted(toy, prefix_token, (ids, counts, n), key,
                                  anchor=anchor),
        keys, batch_size=_CHECK_BATCH))(round_keys)
  # Same rounds, TARGET_ONLY domain: independent of every speculative draw.
  target_keys = jax.vmap(lambda key: dj.draw_key(
      key, anchor, dj.Domain.TARGET_ONLY))(round_keys)
  target, t_status = jax.vmap(dj.sample_target, in_axes=(None, 0))(
      t0, target_keys)
  dj.raise_for_status("sample_target", t_status)

  with jax.enable_x64(True):
    probs, _ = dj.target_probs(t0)
    p_fixed_j, total_j = dj.quantize_target(probs)
  p_fixed, total = np.asarray(p_fixed_j), int(total_j)
  top_ids = np.argsort(-p_fixed, kind="stable")[:_TOP]
  expected = [int(p_fixed[t]) / total for t in top_ids]
  expected.append(1.0 - sum(expected))
  spec_hist, target_hist = histogram(spec, top_ids), histogram(target, top_ids)

  print(f"\nCheck: first emitted token of {samples} independent rounds "
        f"(D=1, k={k}) vs {samples} target-only samples")
  print(f"  {'token':>8} {'P/T':>9} {'spec':>7} {'freq':>7} "
        f"{'target':>7} {'freq':>7}")
  labels = [str(int(t)) for t in top_ids] + ["other"]
  rows = []
  for label, e, s, t in zip(labels, expected, spec_hist, target_hist):
    print(f"  {label:>8} {e:9.5f} {s:7d} {s / samples:7.4f} "
          f"{t:7d} {t / samples:7.4f}")
    rows.append({"token": label, "expected": e, "speculative": int(s),
                 "target_only": int(t)})
  stat2, dof2, p2 = stats.two_sample(spec_hist, target_hist)
  stat1, dof1, p1 = stats.goodness_of_fit(spec_hist, expected)
  verdict = lambda p: "consistent" if p >= alpha else "REJECTED"
  print(f"  two-sample chi2 (speculative vs target-only): stat={stat2:.2f} "
        f"dof={dof2} p={stats.format_p(p2)} -> {verdict(p2)} at alpha={alpha:g}")
  print(f"  goodness of fit (speculative vs exact P/T):   stat={stat1:.2f} "
        f"dof={dof1} p={stats.format_p(p1)} -> {verdict(p1)} at alpha={alpha:g}")
  return {"samples": samples, "alpha": alpha, "bins": rows,
          "two_sample": {"stat": stat2, "dof": dof2, "p": p2},
          "goodness_of_fit": {"stat": stat1, "dof": dof1, "p": p1},
          "passed": bool(p2 >= alpha and p1 >= alpha)}


def main(argv: list[str]) -> int:
  del argv
  # absl shows INFO records; JAX's backend probe logs "Unable to initialize
  # backend 'tpu'" at INFO on every machine without a TPU.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  config = toy_pair.ToyConfig(vocab=_VOCAB.value,
                                closeness=_CLOSENESS.value)
  toy = toy_pair.make_toy(config)
  prefix, depth, k = _PREFIX_TOKEN.value, _DEPTH.value, _K.value
  anchor = 1  # x_0 sits at position 0; x_1 is decided at position 1
  key = dj.round_key(_SEED.value, 0, 0)

  print(f"Toy round: V={config.vocab} D={depth} k={k} "
        f"closeness={config.closeness} seed={_SEED.value} prefix={prefix}")
  tokens, slots, q, status = propose(toy, key, prefix, depth=depth, k=k,
                                     anchor=anchor)
  dj.raise_for_status("propose", status)
  tl = chain_target_logits(toy, prefix, tokens)
  p_rows, _ = dj.target_probs(tl)
  tokens_np = np.asarray(tokens)
  pos = np.arange(depth)
  c_x = np.asarray(q.counts)[pos, np.asarray(slots)]
  p_x = np.asarray(p_rows)[pos, tokens_np]
  proposed = []
  print(f"  {'pos':>4} {'token':>7} {'q(x) = c/2^24':>22} {'p(x)':>9} "
        f"{'n':>4}")
  for i in range(depth):
    c, n = int(c_x[i]), int(np.asarray(q.n)[i])
    print(f"  {anchor + i:4d} {tokens_np[i]:7d} {c:>10d}/2^24 "
          f"({c / dj.M:7.5f}) {p_x[i]:9.5f} {n:4d}")
    proposed.append({"position": anchor + i, "token": int(tokens_np[i]),
                     "count": c, "q": c / dj.M, "p": float(p_x[i]),
                     "support": n})

  verdict = dj.verify_chain(tl, q, tokens, key, anchor=anchor)
  dj.raise_for_status("verify_chain", verdict[2])
  accepted, next_token = int(verdict[0]), int(verdict[1])
  emitted = [int(t) for t in tokens_np[:accepted]] + [next_token]
  kind = "bonus" if accepted == depth else "correction"
  print(f"Verified: accepted {accepted}/{depth}, next token {next_token} "
        f"({kind}), emitted {emitted}")

  record: dict[str, typing.Any] = {"vocab": config.vocab, "depth": depth, "k": k,
            "closeness": config.closeness, "seed": _SEED.value,
            "prefix_token": prefix, "proposed": proposed,
            "accepted": accepted, "next_token": next_token,
            "emitted": emitted}
  if _CHECK_SAMPLES.value > 0:
    record["check"] = run_check(
        toy, prefix, k=k, seed=_SEED.value, anchor=anchor,
        samples=_CHECK_SAMPLES.value, alpha=_ALPHA.value)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=2)
    print(f"Wrote {_JSON_OUT.value}")
  # A rejected check is a failed run (exit status 1), so scripts can gate on it.
  return 0 if record.get("check", {}).get("passed", True) else 1


if __name__ == "__main__":
  cli.run(main)
