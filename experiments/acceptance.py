"""What the wire format costs in acceptance: exact per-position figures.

    python -m experiments.acceptance --json_out /tmp/acceptance.json \
        --plot_out /tmp/acceptance.png

Runtime with the defaults: 198 s, measured 2026-12-03 on 2 cores with load
average 10.0 before and 9.7 after (memcpy of 10 MB: 1.07 ms before, 0.86 ms
after); docs/figures.json, recorded by `python -m experiments.record_figures
--commands=acceptance`.

The defaults: V = 129280, closeness 0.9, 256 contexts, 64 verified rounds
per dyadic q; each further --closeness value adds its own contexts and
verified rounds. A smaller preset (its runtime is not recorded):

    python -m experiments.acceptance --vocab=4096 --contexts=64 \
        --empirical_rounds=16

The toy pair of dyadic_jax/models/toy_pair.py (processed bigram target,
DSpark-style draft). A context is a random committed token x_0 (uniform,
--seed); its rows are

  draft   head(x_0) + backbone(x_0)[0]   -> w = draft softmax in float64
  target  target.row([x_0])              -> p = P / T, the verifier's fixed
          point target (docs/numerics.md section 6; within V 2^-38 of the
          float64 softmax), with its processors applied

and q is one of: `ideal` (w itself, unrounded: the best any wire could
do), `dense` (allocate_dense counts / 2^24) or `kN` (allocate_sparse top-N).

No sampling is needed for the main table. For one position the standard
rule accepts the drafted token with probability

    alpha(p, q) = sum_x q(x) min(1, p(x) / q(x)) = sum_x min(p(x), q(x))
                = 1 - TV(p, q),

which the library's integer rule reproduces up to 2^-64 per decision. The
table reports, over the contexts: mean alpha; the rounding / truncation
cost TV(w, q) (dense: below V 2^-25 by |c_v - w_v 2^24| < 1; sparse: about
the mass outside the top k); and, per row, |alpha(q) - alpha(w)| <=
TV(w, q) (triangle inequality; checked in every row).

Mean accepted length at depth D uses the standard **i.i.d.-position
approximation**: every position accepted independently with the same
alpha, so E[accepted] = sum_{i=1..D} alpha^i (and one more token per round,
the correction or bonus). It ignores that later positions have other
contexts (drafted tokens, other backbone rows) and that acceptance is
correlated along a chain. --empirical_rounds checks it: that many real
rounds per dyadic q (drafted chains of depth D from the same contexts,
then `dj.verify_chain`), reporting the sampled mean accepted count and
the exact conditional expectation given each drafted chain,
sum_j prod_{i<=j} min(1, p_i(x_i) / q_i(x_i)) (same mean, lower variance),
each with its standard error, plus alpha at each chain position.
"""

import json
import logging
import math
import time
import typing

from absl import flags

from experiments import cli

_VOCAB = flags.DEFINE_integer(
    "vocab", cli.DEFAULT_VOCAB, f"Vocabulary size V of the toy target and "
    f"draft, 2..{cli.MAX_VOCAB}.", lower_bound=2, upper_bound=cli.MAX_VOCAB)
_CLOSENESS = flags.DEFINE_list(
    "closeness", ["0.9"], "Draft closeness values in [0, 1] (1: the "
    "draft is the target's bigram without its processors); one table each.")
_CONTEXTS = flags.DEFINE_integer(
    "contexts", 256, "Contexts (random committed tokens x_0) per closeness "
    "for the exact per-position figures (>= 1).", lower_bound=1,
    upper_bound=1_000_000)
_DEPTH = flags.DEFINE_integer(
    "depth", 5, "Fixed draft depth D of the mean accepted length, 1..64.",
    lower_bound=1, upper_bound=64)
_KS = flags.DEFINE_list(
    "ks", ["16", "32", "64", "256"], "Sparse support sizes k, each in "
    "[1, V].")
_SEED = flags.DEFINE_integer(
    "seed", 0, "Seed of the contexts and of the verified rounds' keys, in "
    "[0, 2^31).", lower_bound=0, upper_bound=(1 << 31) - 1)
_MODEL_SEED = flags.DEFINE_integer(
    "model_seed", 0, "Seed of the toy models' factors, in [0, 2^31 - 1).",
    lower_bound=0, upper_bound=(1 << 31) - 2)
_PENALTY, _GRAMMAR = cli.define_target_processor()
_EMPIRICAL = flags.DEFINE_integer(
    "empirical_rounds", 64, "Verified rounds per dyadic q and closeness for "
    "the empirical accepted length (the first contexts); 0 skips them.",
    lower_bound=0)
_CHUNK = flags.DEFINE_integer(
    "chunk", 16, "Rows processed together (bounds the [chunk, V] buffers), "
    "1..4096.", lower_bound=1, upper_bound=4096)
_JSON_OUT = flags.DEFINE_string(
    "json_out", None, "Optional path for a JSON record of every figure.")
_PLOT_OUT = flags.DEFINE_string(
    "plot_out", None, "Optional path for a PNG plot (matplotlib Agg).")

cli.check("closeness", lambda c: cli.float_list(c, 0.0, 1.0),
          "--closeness must be numbers in [0, 1]")
cli.check(["ks", "vocab"], lambda ks, vocab: cli.int_list(ks, 1, vocab),
          "--ks must be integers in [1, --vocab]")
cli.check_output_path("json_out")
cli.check_output_path("plot_out")
cli.parse_flags_early(__name__, extra="experiments")

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

import dyadic_jax as dj
from dyadic_jax.models import toy_pair
from experiments import overlap
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

_ANCHOR = 1  # x_0 sits at position 0; x_1 is decided at position 1


def expected_accepted(alpha: float, depth: int) -> float:
  """sum_{i=1..depth} alpha^i: E[accepted] if positions were i.i.d."""
  return sum(alpha ** i for i in range(1, depth + 1))


def target_fixed(target_logits: jax.typing.ArrayLike) -> np.ndarray:
  """p = P / T float64[..., V]: the distribution the verifier reproduces."""
  probs, status = dj.target_probs(target_logits)
  dj.raise_for_status("target_probs", status)
  with jax.enable_x64(True):
    p_fixed, total = dj.quantize_target(probs)
  return np.asarray(p_fixed) / np.asarray(total)[..., None]


def exact_table(target: toy_pair.ToyTarget,
                draft_rows: typing.Callable[[jax.Array], jax.Array],
                prevs: np.ndarray, variants: list[str], chunk: int
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """Per-row alpha and TV(w, q) of every variant over the contexts."""
  alpha: dict[str, list[np.ndarray]] = {v: [] for v in variants}
  tv: dict[str, list[np.ndarray]] = {v: [] for v in variants}
  for s in range(0, len(prevs), chunk):
    part = prevs[s:s + chunk]
    w, status = dj.draft_weights(draft_rows(jnp.asarray(part, jnp.int32)))
    dj.raise_for_status("draft_weights", status)
    p = target_fixed(jnp.stack([target.row([int(x)]) for x in part]))
    w_np = np.asarray(w)
    for v in variants:
      q = w_np if v == "ideal" else overlap.allocate(w, v)[0]
      a, t = overlap.row_figures(p, w_np, q)
      alpha[v].append(a)
      tv[v].append(t)
  return ({v: np.concatenate(a) for v, a in alpha.items()},
          {v: np.concatenate(t) for v, t in tv.items()})


def verified_rounds(target: toy_pair.ToyTarget,
                    head: typing.Callable[[jax.Array], jax.Array],
                    backbone: typing.Callable[[jax.Array], jax.Array],
                    prevs: np.ndarray, variant: str, *, depth: int,
                    seed: int, chunk: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Real rounds: drafted chains of one dyadic q, then verify_chain.

  Args:
    target: the `ToyTarget`.
    head: batched draft head, int32[B] -> float32[B, V].
    backbone: batched draft backbone, int32[B] -> float32[B, depth, V].
    prevs: committed tokens x_0, one round each.
    variant: "dense" or "k<N>".
    depth: draft depth D.
    seed: request seed of the round keys (round r: generation 0, round r).
    chunk: rounds drafted and verified together.

  Returns:
    (sampled accepted int[R], conditional expectation of the accepted
    count given the drafted chain float[R], alpha at each chain position
    float[R, D]).
  """
  verify = jax.vmap(lambda tl, q, x, key: dj.verify_chain(
      tl, q, x, key, anchor=_ANCHOR))
  sampled, conditional, alphas = [], [], []
  for s in range(0, len(prevs), chunk):
    part = jnp.asarray(prevs[s:s + chunk], jnp.int32)
    keys = jax.vmap(lambda r: dj.round_key(seed, 0, r))(
        jnp.arange(s, s + len(part)))
    base = backbone(part)                                # [B, D, V]
    prev, q_dense = part, []
    drawn: list[jax.Array] = []
    q_rows: list[typing.Any] = []
    for i in range(depth):
      # Row i depends on x_{i-1}: the Markov head runs after each draw.
      w, status = dj.draft_weights(head(prev) + base[:, i])
      dj.raise_for_status("draft_weights", status)
      q, counts, ids = overlap.allocate(w, variant)
      u = dj.draw24(jax.vmap(lambda k: dj.draw_key(
          k, _ANCHOR + i, dj.Domain.PROPOSAL))(keys))
      slot = dj.sample_counts(counts, u)
      prev = slot if ids is None else jnp.take_along_axis(
          ids, slot[:, None], -1)[:, 0]
      drawn.append(prev)
      q_rows.append(counts if ids is None else (ids, counts))
      q_dense.append(q)
    tokens = jnp.stack(drawn, 1)                         # [B, D]
    tl = jnp.stack([target.rows([int(x0)], x)
                    for x0, x in zip(np.asarray(part), np.asarray(tokens))])
    qq: dj.DenseQ | dj.SparseQ
    if variant == "dense":
      qq = dj.DenseQ(jnp.stack(q_rows, 1))
    else:
      ids = jnp.stack([r[0] for r in q_rows], 1)
      qq = dj.SparseQ(ids, jnp.stack([r[1] for r in q_rows], 1),
                      jnp.sum(ids >= 0, -1, dtype=jnp.int32))
    accepted, _, status = verify(tl, qq, tokens, keys)
    dj.raise_for_status("verify_chain", status)
    sampled.append(np.asarray(accepted))
    p = target_fixed(tl)[:, :depth]                      # [B, D, V]
    q = np.stack(q_dense, 1)                             # [B, D, V]
    x = np.asarray(tokens)[..., None]
    p_x = np.take_along_axis(p, x, -1)[..., 0]
    q_x = np.take_along_axis(q, x, -1)[..., 0]
    accept = np.minimum(1.0, p_x / q_x)                  # q_x > 0: x ~ q
    conditional.append(np.cumprod(accept, -1).sum(-1))
    alphas.append(np.minimum(p, q).sum(-1))
  return (np.concatenate(sampled), np.concatenate(conditional),
          np.concatenate(alphas))


def mean_se(x: jax.typing.ArrayLike) -> tuple[float, float]:
  """(mean, standard error of the mean) of a sample."""
  x = np.asarray(x, np.float64)
  se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0
  return float(x.mean()), se


def run_closeness(closeness: float, variants: list[str], prevs: np.ndarray,
                  *, depth: int, seed: int, empirical: int,
                  chunk: int) -> dict[str, typing.Any]:
  """All figures of one closeness value (prints its table)."""
  config = toy_pair.ModelConfig(
      vocab=_VOCAB.value, seed=_MODEL_SEED.value, closeness=closeness,
      repetition_penalty=_PENALTY.value, grammar_modulus=_GRAMMAR.value,
      max_depth=max(depth, 1))
  target, draft = toy_pair.make_models(config)
  draft_rows = jax.jit(jax.vmap(
      lambda x: draft.head(x) + draft.backbone(x, _ANCHOR, 1)[0]))
  t0 = time.perf_counter()
  alpha, tv = exact_table(target, draft_rows, prevs, variants, chunk)
  t1 = time.perf_counter()
  ideal = alpha["ideal"]
  rows = []
  for v in variants:
    a_mean, a_se = mean_se(alpha[v])
    row: dict[str, typing.Any] = {"q": v, "alpha": a_mean, "alpha_se": a_se,
           "alpha_min": float(alpha[v].min()),
           "alpha_max": float(alpha[v].max()),
           "alpha_loss_vs_ideal": float(np.mean(ideal - alpha[v])),
           "tv_draft": float(tv[v].mean()),
           "tv_draft_max": float(tv[v].max()),
           # |alpha(q) - alpha(w)| <= TV(w, q), row by row (with float slack).
           "triangle_bound_ok": bool(np.all(
               np.abs(alpha[v] - ideal) <= tv[v] + 1e-12)),
           "expected_accepted_iid": expected_accepted(a_mean, depth)}
    rows.append(row)
  if empirical:
    head = jax.jit(jax.vmap(draft.head))
    backbone = jax.jit(jax.vmap(lambda x: draft.backbone(x, _ANCHOR, depth)))
    for row in rows[1:]:
      sampled, conditional, by_pos = verified_rounds(
          target, head, backbone, prevs[:empirical], row["q"], depth=depth,
          seed=seed, chunk=chunk)
      row["empirical"] = {
          "rounds": int(len(sampled)),
          "sampled_accepted": mean_se(sampled),
          "conditional_accepted": mean_se(conditional),
          "alpha_by_position": [float(a) for a in by_pos.mean(0)]}
  t2 = time.perf_counter()

  print(f"\ncloseness={closeness}: {len(prevs)} contexts, V={_VOCAB.value}, "
        f"D={depth}; exact figures {t1 - t0:.1f} s, verified rounds "
        f"{t2 - t1:.1f} s (E[acc] iid = sum_i alpha^i; +1 token per round)")
  print(f"  {'q':>6} {'alpha':>9} {'+-se':>8} {'loss':>10} {'TV(w,q)':>10} "
        f"{'max':>10} {'E[acc] iid':>10}"
        + (f" {'sampled':>13} {'given chain':>13}" if empirical else ""))
  for row in rows:
    line = (f"  {row['q']:>6} {row['alpha']:9.5f} {row['alpha_se']:8.5f} "
            f"{row['alpha_loss_vs_ideal']:10.2e} {row['tv_draft']:10.2e} "
            f"{row['tv_draft_max']:10.2e} {row['expected_accepted_iid']:10.3f}")
    if "empirical" in row:
      for mean, se in (row["empirical"]["sampled_accepted"],
                       row["empirical"]["conditional_accepted"]):
        line += f" {mean:7.3f}+-{se:.3f}"
    print(line)
  if empirical:
    for row in rows[1:]:
      by_pos = row["empirical"]["alpha_by_position"]
      print(f"  alpha by chain position ({row['q']}): "
            + " ".join(f"{a:.4f}" for a in by_pos))
  return {"closeness": closeness, "rows": rows,
          "time_s": {"exact": t1 - t0, "rounds": t2 - t1}}


def plot(record: dict[str, typing.Any], path: str) -> None:
  """Bars of alpha, TV(w, q) and accepted length per q and closeness."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  results = record["results"]
  names = [r["q"] for r in results[0]["rows"]]
  width = 0.8 / len(results)
  for j, res in enumerate(results):
    xs = np.arange(len(names)) + (j - (len(results) - 1) / 2) * width
    rows = res["rows"]
    label = f"closeness {res['closeness']}"
    axes[0].bar(xs, [r["alpha"] for r in rows], width,
                yerr=[r["alpha_se"] for r in rows], label=label)
    # TV(w, w) = 0 cannot sit on a log axis: the ideal bar is left empty.
    axes[1].bar(xs[1:], [r["tv_draft"] for r in rows[1:]], width,
                label=label)
    axes[2].bar(xs, [r["expected_accepted_iid"] for r in rows], width,
                label=f"{label}: iid approx.")
    emp = [(x, r["empirical"]["conditional_accepted"]) for x, r in
           zip(xs, rows) if "empirical" in r]
    if emp:
      axes[2].errorbar([x for x, _ in emp], [m for _, (m, _) in emp],
                       yerr=[s for _, (_, s) in emp], fmt="k.",
                       label=f"{label}: verified rounds" if j == 0 else None)
  lo = min(r["alpha"] for res in results for r in res["rows"])
  axes[0].set(title="per-position acceptance alpha = E[1 - TV(p, q)]",
              ylim=(max(0.0, lo - 0.1), 1.0), ylabel="alpha")
  axes[1].set(title="rounding / truncation cost TV(w, q)", yscale="log")
  axes[2].set(title=f"mean accepted length, D={record['depth']}",
              ylabel="E[accepted]")
  for ax in axes:
    ax.set_xticks(range(len(names)), names)
    ax.legend(fontsize=8)
  fig.suptitle(f"Acceptance cost of the wire format: V={record['vocab']}, "
               f"{record['contexts']} contexts")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: list[str]) -> int:
  del argv
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  start = time.perf_counter()
  vocab, depth = _VOCAB.value, _DEPTH.value
  ks = [int(k) for k in _KS.value]
  closeness = [float(c) for c in _CLOSENESS.value]
  variants = ["ideal", "dense"] + [f"k{k}" for k in ks]
  prevs = np.random.default_rng(_SEED.value).integers(
      0, vocab, _CONTEXTS.value)
  empirical = min(_EMPIRICAL.value, _CONTEXTS.value)
  record: dict[str, typing.Any] = {"vocab": vocab, "depth": depth, "contexts": _CONTEXTS.value,
            "ks": ks, "seed": _SEED.value, "model_seed": _MODEL_SEED.value,
            "repetition_penalty": _PENALTY.value,
            "grammar_modulus": _GRAMMAR.value, "empirical_rounds": empirical,
            "dense_tv_bound": vocab / 2 / dj.M,
            "approximation": "E[accepted] = sum_{i=1..D} alpha^i (iid "
                             "positions)", "results": []}
  for c in closeness:
    record["results"].append(run_closeness(
        c, variants, prevs, depth=depth, seed=_SEED.value,
        empirical=empirical, chunk=_CHUNK.value))
  record["wall_s"] = time.perf_counter() - start
  bound_ok = all(r["triangle_bound_ok"] and r["tv_draft_max"] <= (
      record["dense_tv_bound"] if r["q"] == "dense" else 1.0)
                 for res in record["results"] for r in res["rows"])
  record["checks_ok"] = bound_ok
  print(f"\nchecks: |alpha(q) - alpha(w)| <= TV(w, q) in every row, dense "
        f"TV(w, q) <= V 2^-25 = {record['dense_tv_bound']:.2e}: "
        f"{'ok' if bound_ok else 'FAILED'}; wall {record['wall_s']:.1f} s")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=2)
    print(f"Wrote {_JSON_OUT.value}")
  if _PLOT_OUT.value:
    plot(record, _PLOT_OUT.value)
    print(f"Wrote {_PLOT_OUT.value}")
  return 0 if bound_ok else 1


if __name__ == "__main__":
  cli.run(main)
