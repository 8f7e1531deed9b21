"""Adaptive depth against fixed depth: tokens per unit of round cost.

  python -m experiments.adaptive_depth [--model=stdlib --prompts=16
      --prompt_tokens=64 --new_tokens=96 --depth=5 --max_depth=8 --q=dense
      --step_cost=0 --lookahead --prior_weight=16 --train_prompts
      --json_out=F]

On held-out prompts of the standard library's source (experiments/corpus.py;
`--train_prompts`: the same cut from the training files, where the rule's
parameters are tuned, never reported)
and the shipped stdlib pair, at temperature 1, the same prompts and seeds
are decoded speculatively in this process (`bridge.generate.Local`) twice:
with `FixedDepth(--depth)` (every round drafts D rows), and with
`AdaptiveDepth(max_depth=--max_depth)` (`dyadic_jax.admission`: a
sequential stopping rule on the draft rows' statistics and the acceptance
recorded in earlier rounds; docs/numerics.md section 7).

Cost model: a round costs one target pass plus c per draft step, c the
draft's step cost over the target's. c is measured here as bench_pair
does (the fixed run's draft seconds per drafted position of a round over
one batched target-only step, both over the whole batch of --requests),
or given by --step_cost; the rule is told the same c. A fixed round computes D rows; an adaptive round d for
d admitted, or with --lookahead min(d + 1, max_depth)
(`admission.draft_steps`: the row a stop is decided on is paid for). Reported for each: rounds, mean drafted
rows, mean accepted, tokens per round (accepted + 1), and tokens per unit
of cost; then the ratio adaptive / fixed. Wall-clock speed is not the
measure: the adaptive proposer reads each row's statistics on the host,
one dispatch a step, where the fixed one drafts D rows in one call.

About 3 minutes on 2 CPU cores with the defaults.
"""

import json
import logging

from absl import flags

from experiments import cli

_MODEL = flags.DEFINE_string(
    "model", "stdlib", "The trained pair: a shipped one's name "
    "(dyadic_jax/models/checkpoints/NAME) or a checkpoint directory.")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Held-out prompts.",
                                lower_bound=1, upper_bound=4096)
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens of each "
                                      "prompt.", lower_bound=1,
                                      upper_bound=1 << 16)
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 96, "New tokens per "
                                   "prompt.", lower_bound=1,
                                   upper_bound=1 << 16)
_DEPTH = flags.DEFINE_integer("depth", 5, "FixedDepth's D.", lower_bound=1,
                              upper_bound=32)
_MAX_DEPTH = flags.DEFINE_integer("max_depth", 8, "AdaptiveDepth's bound "
                                  "(the session's max depth).",
                                  lower_bound=1, upper_bound=32)
_Q = flags.DEFINE_string("q", "dense", "q format: dense or a sparse k.")
_STEP_COST = flags.DEFINE_float("step_cost", 0.0, "Draft step cost over "
                                "the target's; 0: measured in this run.",
                                lower_bound=0.0)
_LOOKAHEAD = flags.DEFINE_bool("lookahead", False, "AdaptiveDepth reads "
                                "position i's own row before admitting it "
                                "(a stop then wastes that row).")
_PRIOR_WEIGHT = flags.DEFINE_float("prior_weight", 16.0, "AdaptiveDepth's "
                                   "prior weight (`admission.estimate`).",
                                   lower_bound=1e-3)
_TRAIN_PROMPTS = flags.DEFINE_bool("train_prompts", False, "Prompts from "
                                   "the training files (tuning), not the "
                                   "held-out ones.")
_REQUESTS = flags.DEFINE_integer("requests", 4, "Requests per batch.",
                                 lower_bound=1, upper_bound=64)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the prompts and the "
                             "draws.", lower_bound=0)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Where the record goes "
                                "(none: printed only).")
cli.check("q", lambda q: q == "dense" or (q.isdigit() and int(q) >= 1),
          "dense, or a sparse k (a positive integer)")
cli.check_checkpoint("model", "--model is a shipped pair's name (stdlib) "
                     "or a checkpoint directory")
cli.check_output_path("json_out")
cli.parse_flags_early(__name__, extra="experiments")

# pylint: disable=g-import-not-at-top
import numpy as np

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import generate
from dyadic_jax.models import pair as pair_lib
from dyadic_jax.wire.layouts import Representation
from experiments import corpus
# pylint: enable=g-import-not-at-top


class Tally:
  """Per request-round: rows drafted, draft steps computed, accepted."""

  def __init__(self, max_depth: int, lookahead: bool = False) -> None:
    self.max_depth = max_depth
    self.lookahead = lookahead
    self.rows: list[int] = []
    self.accepted: list[int] = []

  def __call__(self, rids, proposals, logits, outcomes) -> None:
    del rids, logits
    for p, (accepted, _) in zip(proposals, outcomes):
      self.rows.append(len(p.tokens))
      self.accepted.append(int(accepted))

  def record(self, step_cost: float) -> dict:
    rows, acc = np.asarray(self.rows), np.asarray(self.accepted)
    steps = (np.minimum(rows + 1, self.max_depth) if self.lookahead
             else rows)
    tokens = float((acc + 1).sum())
    cost = float(len(rows) + step_cost * steps.sum())
    return {"rounds": len(rows), "mean_rows": float(rows.mean()),
            "mean_steps": float(steps.mean()),
            "mean_accepted": float(acc.mean()),
            "tokens_per_round": tokens / len(rows),
            "tokens_per_cost": tokens / cost}


def caps_of(depth: int, vocab: int) -> bridge.Capabilities:
  dense = _Q.value == "dense"
  return bridge.Capabilities(
      vocab=vocab, max_depth=depth, max_requests=_REQUESTS.value,
      representation=Representation.DENSE if dense else
      Representation.SPARSE, max_support=32 if dense else int(_Q.value))


def run(pair, prompts, depth: int, rule, tally: Tally) -> generate.Result:
  link = generate.Local(pair.draft, pair.target,
                        caps_of(depth, pair.target.vocab), admission=rule)
  # Compiled on two short requests first (not counted: another seed).
  generate.generate(link, prompts[:2], max_new_tokens=2 * (depth + 1),
                    seed=_SEED.value + 1)
  link.seconds.clear()
  link.observe = tally
  return generate.generate(link, prompts, max_new_tokens=_NEW_TOKENS.value,
                           seed=_SEED.value)


def main(argv):
  del argv
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  depth, max_depth = _DEPTH.value, _MAX_DEPTH.value
  pair = pair_lib.load_dir(cli.model_dir(_MODEL.value),
                           max_depth=max(depth, max_depth))
  need = _PROMPT_TOKENS.value + _NEW_TOKENS.value + max(depth, max_depth) + 1
  if need > pair.target.max_len:
    cli.usage_error(f"--prompt_tokens + --new_tokens + depth + 1 = {need} "
                    f"exceeds the model's context ({pair.target.max_len})")
  if _Q.value != "dense" and int(_Q.value) > pair.target.vocab:
    cli.usage_error(f"--q: k={_Q.value} exceeds V={pair.target.vocab}")
  prompts = [list(p) for p in corpus.prompts(
      pair.tokenizer, _PROMPTS.value, _PROMPT_TOKENS.value, _SEED.value,
      held_out=not _TRAIN_PROMPTS.value)]

  cli.progress(f"FixedDepth({depth}), q {_Q.value}")
  fixed = Tally(depth)
  out = run(pair, prompts, depth, None, fixed)
  c = _STEP_COST.value
  if not c:
    cli.progress("target-only decoding (the step cost's denominator)")
    batch = _REQUESTS.value
    few = prompts[:batch]
    generate.target_only(pair.target, few, batch=batch,
                         max_new_tokens=2)   # warm
    base = generate.target_only(pair.target, few, batch=batch,
                                max_new_tokens=32, seed=_SEED.value)
    # One batched target-only step, bench_pair's unit; the draft's
    # seconds per drafted position of a batch's round.
    step_s = base.seconds["target"] / base.rounds
    c = out.seconds["draft"] / depth / max(out.rounds, 1) / step_s
  cli.progress(f"AdaptiveDepth(max_depth={max_depth}, step_cost={c:.3f})")
  adaptive = Tally(max_depth, _LOOKAHEAD.value)
  rule = dj.AdaptiveDepth(max_depth=max_depth, step_cost=c, min_depth=1,
                          lookahead=_LOOKAHEAD.value,
                          prior_weight=_PRIOR_WEIGHT.value)
  run(pair, prompts, max_depth, rule, adaptive)
  record = {"model": _MODEL.value, "q": _Q.value, "prompts": _PROMPTS.value,
            "prompt_tokens": _PROMPT_TOKENS.value,
            "train_prompts": _TRAIN_PROMPTS.value,
            "new_tokens": _NEW_TOKENS.value, "seed": _SEED.value,
            "step_cost": c, "measured": not _STEP_COST.value,
            "fixed": dict(depth=depth, **fixed.record(c)),
            "adaptive": dict(max_depth=max_depth, lookahead=_LOOKAHEAD.value,
                             prior_weight=_PRIOR_WEIGHT.value,
                             **adaptive.record(c))}
  record["ratio"] = (record["adaptive"]["tokens_per_cost"]
                     / record["fixed"]["tokens_per_cost"])
  how = "given" if _STEP_COST.value else "measured"
  print(f"step cost c = {c:.4f} ({how})")
  for name in ("fixed", "adaptive"):
    r = record[name]
    print(f"  {name:>8}: {r['rounds']} rounds, rows {r['mean_rows']:.2f}, "
          f"steps {r['mean_steps']:.2f}, accepted {r['mean_accepted']:.2f}, "
          f"tokens/round {r['tokens_per_round']:.3f}, tokens/cost "
          f"{r['tokens_per_cost']:.4f}")
  print(f"adaptive / fixed tokens per unit cost: {record['ratio']:.3f}x")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
