"""Trains the shipped draft/target pair on the Python standard library.

    python -m experiments.train_pair            # a pair from scratch, in ./stdlib_pair
    python -m experiments.pp1_pipeline --model=stdlib_pair

The shipped checkpoint is three runs, each continuing the last
(--init_from; config.json records each command, its steps and held-out
loss), 861 steps of 8 x 512 tokens (3.5M tokens seen of the 8.9M of the
training split), 59 min of training on 2 cores shared with other jobs,
measured 2026-12-03. To make it again (in ./stdlib_pair):

    python -m experiments.train_pair --steps=240 --warmup=24
    python -m experiments.train_pair --init_from=stdlib_pair \
        --steps=300 --warmup=10 --lr=1e-3 --draft_lr=1.5e-3 --seed=1
    python -m experiments.train_pair --init_from=stdlib_pair \
        --steps=400 --warmup=10 --lr=8e-4 --draft_lr=1.2e-3 --seed=2 \
        --stop_after_steps=321

(the last run's --time_budget_s=1200 stopped it after 321 of its 400
steps; --stop_after_steps replays that stop). Held-out loss: target 4.875,
then 4.519, then 4.182 nats/token (perplexity 65.5); draft 5.014, 4.724,
4.447 (85.4): both still undertrained.

Its draft was then distilled for that target (issue 39): the draft alone,
the target fixed, first forward KL then total variation to the target's
softmax at temperature 1, 1,103 steps of 8 x 512 tokens, 23 min of
training on 2 cores shared with other jobs, measured 2026-12-06:

    python -m experiments.train_pair --init_from=stdlib_pair \
        --output_dir=stdlib_kl --draft_only --distill=kl --steps=1000 \
        --warmup=20 --draft_lr=1e-3 --seed=3 --stop_after_steps=743
    python -m experiments.train_pair --init_from=stdlib_kl \
        --output_dir=stdlib_tv --draft_only --distill=tv --steps=360 \
        --warmup=10 --draft_lr=5e-4 --seed=4

(--time_budget_s=1080 stopped the first after 743 of its 1000 steps).
The exact expected acceptance sum min(p, q) per position on 32,768
held-out positions went from 0.663 to 0.793 with dense q and from 0.467
to 0.542 with sparse k = 32 (KL(p || q) 0.464 to 0.189 nats); the
draft's own held-out loss from 4.447 to 4.305. A third run with
--topk_penalty=0.5 (k = 32) instead of the second cut the draft's mass
outside its top 32 from 0.42 to 0.30 but left k = 32's acceptance where
it was (0.532 against 0.535) and cost dense q 0.03: a sparse q of k ids
accepts at most the target's own mass on them, and this target keeps 0.39
of its mass outside its top 32 (the ceiling is 0.61).

**Draft-only mode** (--draft_only, with --init_from): the draft alone is
trained, against the fixed target of --init_from, by next-token loss
(--distill=none), forward KL(p || q) (kl) or total variation 1/2 sum |p -
q| = 1 - sum min(p, q) (tv), p and q the softmax of the target's and the
draft's logits / --distill_temperature; the target's logits of each batch
are computed inside the jitted step and never stored. --topk_penalty adds
the draft's mass outside its own top --topk_penalty_k. The draft continues
from --init_from's or starts fresh (--draft_from_scratch, any --draft_*
shape). The progress line adds the batch's KL, TV and mass outside the
top k; the held-out report adds the exact acceptance of dense q and of
sparse q for each --acceptance_ks, before and after, with the mass
outside the top k of both models (experiments/overlap.py); config.json
records them (held_out_acceptance, distillation) and the target's
weights are written back unchanged.

Trains a byte-level BPE tokenizer on the training split of
`experiments.corpus`, then the target and the draft transformers
(`dyadic_jax.models.transformer`) side by side: one jitted step updates
both on the same batch, so they see the same data in the same order.
Batches are random windows of the tokenized training split (files joined
by the end-of-text token), drawn from --seed. Prints the held-out loss and
perplexity of both models, their parameter counts and their measured
decode time per token, and writes the checkpoint (`dyadic_jax.models.
checkpoint`) to --output_dir.

Deterministic for a given seed and corpus: the same flags on the same
Python version give the same tokenizer and the same weights (CPU XLA is
deterministic), unless --time_budget_s stops the run early.

The tokenizer and the tokenized corpus are cached under --cache_dir
(keyed by the corpus fingerprint and the vocabulary), never in the repo.
"""

import datetime
import functools
import hashlib
import logging
import math
import os
import pathlib
import shlex
import sys
import tempfile
import time
import typing

from absl import flags

from experiments import cli
from experiments import interrupt

_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "stdlib_pair",
    "Checkpoint directory to write (created if missing); the pipeline and "
    "bench_pair run it with --model=DIR. A folder that holds a checkpoint "
    "is replaced only with --force, or when it is --init_from (continued "
    "in place). The shipped pair is dyadic_jax/models/checkpoints/stdlib.")
_FORCE = flags.DEFINE_bool(
    "force", False, "Replace the checkpoint already in --output_dir.")
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", os.path.join(tempfile.gettempdir(), "dyadic_jax_corpus"),
    "Where the tokenizer and the tokenized corpus are cached.")
_CORPUS_ROOT = flags.DEFINE_string(
    "corpus_root", None, "Train on the *.py files under this directory "
    "instead of the whole standard library (e.g. one stdlib package, for a "
    "quick trial); split by path the same way.")
_VOCAB = flags.DEFINE_integer(
    "vocab", 4096, "Tokenizer vocabulary size, 258..65536.", lower_bound=258,
    upper_bound=65536)
_MAX_LEN = flags.DEFINE_integer(
    "max_len", 512, "Longest sequence of both models (their cache size).",
    lower_bound=2, upper_bound=1 << 16)
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", 512, "Training window length, 1..--max_len.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 8, "Windows per step.", lower_bound=1,
                              upper_bound=4096)
_STEPS = flags.DEFINE_integer("steps", 240, "Training steps.", lower_bound=1)
_WARMUP = flags.DEFINE_integer(
    "warmup", None, "Linear warmup steps, < --steps (default: a tenth of "
    "--steps, 24 of the default 240).", lower_bound=0)
_LR = flags.DEFINE_float("lr", 2e-3, "Peak learning rate of the target.")
_DRAFT_LR = flags.DEFINE_float("draft_lr", 3e-3,
                               "Peak learning rate of the draft.")
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.1,
                                   "AdamW decay of the matrices.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and the batches.",
                             lower_bound=0)
_TIME_BUDGET = flags.DEFINE_float(
    "time_budget_s", 0.0, "Stop training after this many seconds (0: no "
    "limit; the schedule is still that of --steps).", lower_bound=0.0)
_EVAL_WINDOWS = flags.DEFINE_integer(
    "eval_windows", 64, "Held-out windows of --seq_len tokens scored at the "
    "end.", lower_bound=1)
_STOP_AFTER = flags.DEFINE_integer(
    "stop_after_steps", 0, "Stop after this many steps of the --steps "
    "schedule (0: run it all): what a --time_budget_s stop did, replayed "
    "exactly.", lower_bound=0)
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Continue from the pair in this checkpoint directory "
    "(its weights; its tokenizer must be the one this run trains or "
    "caches): a fresh optimizer and schedule over --steps more steps. The "
    "record keeps the earlier runs' commands and training.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 25, "Steps between progress "
                                  "lines.", lower_bound=1)
_DRAFT_ONLY = flags.DEFINE_bool(
    "draft_only", False, "Train the draft alone against the fixed target "
    "of --init_from (its weights, unchanged, are written back beside the "
    "new draft); the draft continues from --init_from's unless "
    "--draft_from_scratch. Reports the exact held-out acceptance before "
    "and after (--acceptance_windows).")
_DISTILL = flags.DEFINE_enum(
    "distill", "none", ["none", "kl", "tv"], "The draft's loss with "
    "--draft_only: none (next-token cross-entropy on the corpus), kl "
    "(forward KL(p || q) to the target's softmax p at "
    "--distill_temperature) or tv (the total variation 1/2 sum |p - q| = 1 "
    "- sum min(p, q), the acceptance itself). The target's rows are "
    "computed inside the jitted step, per batch, never stored.")
_DISTILL_T = flags.DEFINE_float(
    "distill_temperature", 1.0, "Sampling temperature T of the distilled "
    "rows and of the acceptance report: p = softmax(target logits / T), q "
    "= softmax(draft logits / T).", lower_bound=1e-3, upper_bound=1e3)
_DRAFT_FROM_SCRATCH = flags.DEFINE_bool(
    "draft_from_scratch", False, "With --draft_only: start the draft from "
    "fresh weights of the --draft_* shape (seeded by --seed) instead of "
    "--init_from's draft (e.g. a draft with one more layer).")
_TOPK_PENALTY = flags.DEFINE_float(
    "topk_penalty", 0.0, "With --draft_only: add this weight times the "
    "draft's mass outside its own top --topk_penalty_k (what a sparse q "
    "of that k truncates) to the loss.", lower_bound=0.0)
_TOPK_PENALTY_K = flags.DEFINE_integer(
    "topk_penalty_k", 32, "The k of --topk_penalty.", lower_bound=1)
_ACCEPTANCE_WINDOWS = flags.DEFINE_integer(
    "acceptance_windows", 16, "Held-out windows (the first of the "
    "--eval_windows) on which the exact acceptance sum min(p, q) of dense "
    "and sparse q is reported (0: none).", lower_bound=0)
_ACCEPTANCE_KS = flags.DEFINE_list(
    "acceptance_ks", ["16", "32", "64", "256"], "The sparse k of the "
    "acceptance report (those below the vocabulary).")


def _define_model(role: str, d_model: int, layers: int, heads: int,
                  d_ff: int) -> dict[str, flags.FlagHolder[int]]:
  return {
      "d_model": flags.DEFINE_integer(f"{role}_d_model", d_model,
                                      f"{role}: residual width.",
                                      lower_bound=2),
      "n_layers": flags.DEFINE_integer(f"{role}_layers", layers,
                                       f"{role}: blocks.", lower_bound=1),
      "n_heads": flags.DEFINE_integer(f"{role}_heads", heads,
                                      f"{role}: attention heads.",
                                      lower_bound=1),
      "d_ff": flags.DEFINE_integer(f"{role}_d_ff", d_ff,
                                   f"{role}: MLP width.", lower_bound=1),
  }


_ROLES = ("target", "draft")
_TARGET = _define_model("target", 320, 4, 5, 1280)
_DRAFT = _define_model("draft", 128, 1, 2, 512)

cli.check(["seq_len", "max_len"], lambda seq_len, max_len: seq_len <= max_len,
          "--seq_len must be <= --max_len")


def _head_width_ok(d_model: int, heads: int) -> bool:
  return d_model % heads == 0 and (d_model // heads) % 2 == 0


for _role in _ROLES:
  cli.check([f"{_role}_d_model", f"{_role}_heads"],
            lambda **v: _head_width_ok(*v.values()),
            f"--{_role}_d_model must be a multiple of --{_role}_heads with "
            "an even quotient (the head width)")
cli.check("corpus_root", lambda root: root is None or os.path.isdir(root),
          "--corpus_root must be a directory")
cli.check_checkpoint("init_from", "--init_from must be a checkpoint "
                     "directory (or a shipped pair's name)")
cli.check("lr", lambda x: 0.0 < x < 1.0, "--lr must be in (0, 1)")
cli.check("draft_lr", lambda x: 0.0 < x < 1.0, "--draft_lr must be in (0, 1)")
cli.check("weight_decay", lambda x: 0.0 <= x < 1.0,
          "--weight_decay must be in [0, 1)")
cli.check(["draft_only", "init_from"],
          lambda draft_only, init_from: not draft_only or init_from,
          "--draft_only needs --init_from (the target it trains against)")
for _name in ("distill", "distill_temperature", "draft_from_scratch",
              "topk_penalty", "topk_penalty_k"):
  cli.check(["draft_only", _name],
            lambda draft_only, n=_name, **_: draft_only or not flags.FLAGS[
                n].present, f"--{_name} needs --draft_only")
cli.check("acceptance_ks", lambda ks: cli.int_list(ks, 1, 1 << 16),
          "--acceptance_ks must be positive integers")
cli.check(["warmup", "steps"],
          lambda warmup, steps: warmup is None or warmup < steps,
          "--warmup must be < --steps")


def _output_problem(output_dir: str, force: bool,
                    init_from: str | None) -> str | None:
  """Why --output_dir cannot take this run's checkpoint (found before
  training, so a trained pair is never lost to an unwritable folder)."""
  if not output_dir.strip():
    return ("--output_dir is empty: name the checkpoint's folder (an empty "
            "value would write into the current folder)")
  if cli.shipped_name(output_dir):
    return (f"--output_dir={output_dir} is a shipped pair's name: "
            f"--model={output_dir} would load the shipped one, not this "
            "folder; give another name")
  out = pathlib.Path(output_dir).resolve()
  if out.exists() and not out.is_dir():
    return f"--output_dir={output_dir}: {out} exists and is not a folder"
  existing = out
  while not existing.exists():      # the folder to be made, or its parent
    existing = existing.parent
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    return f"--output_dir={output_dir}: {existing} is not a writable folder"
  held = out.is_dir() and any(
      (out / name).exists() for name in (cli.CHECKPOINT_CONFIG,
                                         *cli.CHECKPOINT_FILES.values()))
  continued = init_from is not None and cli.model_dir(init_from) == out
  if held and not (force or continued):
    return (f"--output_dir={output_dir}: {out} holds a checkpoint; give "
            "another folder, or --force to replace it")
  return None


cli.check_problem(["output_dir", "force", "init_from"], _output_problem)
cli.parse_flags_early(__name__, extra="train")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dyadic_jax.models import checkpoint
from dyadic_jax.models import tokenizer as tokenizer_lib
from dyadic_jax.models import transformer
from experiments import corpus
from experiments import overlap


def _model_config(role: str, vocab: int) -> transformer.Config:
  holders = _TARGET if role == "target" else _DRAFT
  return transformer.Config(vocab=vocab, max_len=_MAX_LEN.value,
                            **{k: h.value for k, h in holders.items()
                               })  # type: ignore[arg-type]


# -- data ---------------------------------------------------------------------


def _cached_tokenizer(train_files: list[corpus.SourceFile], key: str,
                      cache: pathlib.Path) -> tokenizer_lib.Tokenizer:
  path = cache / f"tokenizer-{key}.json"
  if path.exists():
    cli.progress(f"tokenizer from the cache {path}")
    return tokenizer_lib.load(path)
  start = time.perf_counter()
  tok = tokenizer_lib.train((f.text for f in train_files), _VOCAB.value)
  tok.save(path)
  cli.progress(f"trained the tokenizer ({tok.vocab} ids) in "
               f"{time.perf_counter() - start:.1f} s")
  return tok


def _joined_tokens(tok: tokenizer_lib.Tokenizer,
                   files: list[corpus.SourceFile],
                   path: pathlib.Path) -> np.ndarray:
  """The files' tokens, each followed by end-of-text, as uint16 (cached)."""
  if path.exists():
    return np.load(path)
  parts = []
  eot = np.asarray([tok.end_of_text], np.int32)
  for ids in tok.encode_batch([f.text for f in files]):
    parts.extend([ids, eot])
  joined = np.concatenate(parts).astype(np.uint16)
  np.save(path, joined)
  return joined


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """int32[len(starts), length + 1] windows (inputs and shifted targets)."""
  return tokens[starts[:, None] + np.arange(length + 1)].astype(np.int32)


# -- training -----------------------------------------------------------------


def _loss(params: transformer.Params, batch: jax.Array) -> jax.Array:
  logits = transformer.forward(params, batch[:, :-1])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[:, 1:]))


def _warmup() -> int:
  """--warmup, or a tenth of --steps (< --steps, so a short trial runs)."""
  return _STEPS.value // 10 if _WARMUP.value is None else _WARMUP.value


# The pipeline's defaults (experiments/pp1/flags.py, pipeline_config.py)
# that its context check adds up: --prompt_tokens, --tokens, --depth.
_RUN_PROMPT, _RUN_TOKENS, _RUN_DEPTH = 64, 48, 5


def run_command(out: pathlib.Path, max_len: int) -> str:
  """The pipeline's command for the pair in `out`: its defaults when they
  fit max_len, else a prompt and a length that do (its context check)."""
  command = f"python -m experiments.pp1_pipeline --model={out}"
  if _RUN_PROMPT + _RUN_TOKENS + _RUN_DEPTH + 1 <= max_len:
    return command
  prompt = min(_RUN_PROMPT, max_len // 2)
  return (f"{command} --prompt_tokens={prompt} --tokens="
          f"{max_len - prompt - _RUN_DEPTH - 1}")


def _optimizer(peak_lr: float) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, peak_lr, _warmup(), _STEPS.value, end_value=peak_lr * 0.1)
  # Decay the matrices only: norms' scales stay near 1.
  decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, b1=0.9, b2=0.95,
                  weight_decay=_WEIGHT_DECAY.value, mask=decay_mask))


def _make_step(optimizers: tuple[optax.GradientTransformation, ...]
               ) -> typing.Callable[..., typing.Any]:
  @jax.jit
  def step(params, opt_states, batch):
    new_params, new_states, losses = [], [], []
    for p, s, opt in zip(params, opt_states, optimizers):
      loss, grads = jax.value_and_grad(_loss)(p, batch)
      updates, s = opt.update(grads, s, p)
      new_params.append(optax.apply_updates(p, updates))
      new_states.append(s)
      losses.append(loss)
    return tuple(new_params), tuple(new_states), jnp.stack(losses)
  return step


# The draft-only step's metrics, in this order (the progress line's).
_DRAFT_METRICS = ("target", "draft", "kl", "tv", "outside_top_k")


def _draft_loss(draft: transformer.Params, target_logits: jax.Array,
                batch: jax.Array, *, objective: str, temperature: float,
                penalty: float, k: int) -> tuple[jax.Array, jax.Array]:
  """The draft-only objective and its metrics f32[5] (`_DRAFT_METRICS`):
  the target's and the draft's next-token loss, KL(p || q), TV(p, q) and
  the mass of q outside its top k, means over the batch's positions, p and
  q the softmax of the target's and the draft's logits / temperature."""
  logits = transformer.forward(draft, batch[:, :-1])
  labels = batch[:, 1:]
  ce = lambda x: jnp.mean(
      optax.softmax_cross_entropy_with_integer_labels(x, labels))
  log_p = jax.nn.log_softmax(target_logits / temperature)
  log_q = jax.nn.log_softmax(logits / temperature)
  p, q = jnp.exp(log_p), jnp.exp(log_q)
  kl = jnp.mean(jnp.sum(p * (log_p - log_q), -1))
  tv = jnp.mean(0.5 * jnp.sum(jnp.abs(p - q), -1))
  kept = jnp.sum(jax.lax.top_k(q, min(k, q.shape[-1]))[0], -1)
  outside = jnp.mean(jnp.maximum(1.0 - kept, 0.0))
  draft_ce = ce(logits)
  loss = {"none": draft_ce, "kl": kl, "tv": tv}[objective]
  if penalty:
    loss = loss + penalty * outside
  return loss, jnp.stack([ce(target_logits), draft_ce, kl, tv, outside])


def _make_draft_step(optimizer: optax.GradientTransformation
                     ) -> typing.Callable[..., typing.Any]:
  """One jitted step of the draft alone: the fixed target's logits of the
  batch are computed inside it (an argument, not a constant: never folded
  into the program, never stored)."""
  loss = functools.partial(
      _draft_loss, objective=_DISTILL.value, temperature=_DISTILL_T.value,
      penalty=_TOPK_PENALTY.value, k=_TOPK_PENALTY_K.value)

  @jax.jit
  def step(draft, opt_state, target, batch):
    target_logits = jax.lax.stop_gradient(
        transformer.forward(target, batch[:, :-1]))
    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(
        draft, target_logits, batch)
    updates, opt_state = optimizer.update(grads, opt_state, draft)
    return optax.apply_updates(draft, updates), opt_state, metrics
  return step


def _held_out_loss(params: transformer.Params, windows: np.ndarray,
                   batch: int) -> float:
  loss = jax.jit(_loss)
  total = 0.0
  for i in range(0, len(windows), batch):
    interrupt.check()
    chunk = windows[i:i + batch]
    total += float(loss(params, jnp.asarray(chunk))) * len(chunk)
  return total / len(windows)


def decode_ms_per_token(params: transformer.Params,
                        config: transformer.Config, steps: int = 32,
                        repeats: int = 5) -> dict[str, float]:
  """Measured decode time of one token with the cache, in ms.

  `in_jit`: `steps` single-token `extend`s in one jitted loop (how the
  proposer runs the draft: no dispatch per token), per token, best of
  `repeats`. `per_call`: one jitted single-token `extend` call (dispatch
  included), median of 20. Both start at position max_len / 2 over a
  filled cache.
  """
  start = config.max_len // 2
  cache = transformer.empty_cache(config)
  tokens = jnp.arange(start, dtype=jnp.int32) % config.vocab
  _, cache = transformer.feed(params, cache, tokens, 0)

  @jax.jit
  def loop(params, cache):
    def body(i, carry):
      cache, token = carry
      logits, cache = transformer.extend_traced(
          params, cache, token[None], start + i)
      return cache, jnp.argmax(logits[0]).astype(jnp.int32)
    return jax.lax.fori_loop(0, steps, body, (cache, jnp.int32(1)))[1]

  loop(params, cache).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    loop(params, cache).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  one = jnp.asarray([1], jnp.int32)
  transformer.extend(params, cache, one, start)[0].block_until_ready()
  times = []
  for _ in range(20):
    t0 = time.perf_counter()
    transformer.extend(params, cache, one, start)[0].block_until_ready()
    times.append(time.perf_counter() - t0)
  return {"in_jit": 1e3 * best / steps,
          "per_call": 1e3 * float(np.median(times))}


def _continued(directory: pathlib.Path,
               configs: tuple[transformer.Config, ...],
               tok: tokenizer_lib.Tokenizer,
               roles: tuple[str, ...] = _ROLES
               ) -> tuple[tuple[transformer.Params | None, ...],
                          list[dict[str, typing.Any]]]:
  """The weights of `roles` in checkpoint `directory` (shapes as
  `configs`, the same tokenizer; None for a role not loaded) and the
  record of the runs that made them."""
  meta = checkpoint.read_config(directory / checkpoint.CONFIG_FILE)
  theirs = tokenizer_lib.load(directory / meta.get(
      "tokenizer_file", checkpoint.TOKENIZER_FILE))
  if theirs.to_json() != tok.to_json():
    cli.fail(f"--init_from={directory}: its tokenizer is not this run's")
  for role, config in zip(_ROLES, configs):
    if role in roles and checkpoint.model_config(meta, role) != config:
      cli.fail(f"--init_from={directory}: its {role} is "
               f"{meta[role]}, this run's {config.to_dict()}")
  params = tuple(checkpoint.load_params(directory / name, config)
                 if role in roles else None
                 for role, name, config in zip(
                     _ROLES, (checkpoint.TARGET_FILE, checkpoint.DRAFT_FILE),
                     configs))
  cli.progress(f"continuing from {directory} ({meta['training']['steps']} "
               "steps before)")
  run = {"command": meta["command"], "training": meta["training"],
         "held_out": meta["held_out"], "date": meta["date"]}
  for key in ("distillation", "held_out_acceptance"):
    if key in meta:
      run[key] = meta[key]
  return params, [*meta.get("earlier_runs", []), run]


def _acceptance(params: tuple[transformer.Params, ...],
                windows: np.ndarray, ks: list[int]) -> dict[str, typing.Any]:
  """The exact held-out acceptance of the pair (`overlap.held_out`)."""
  start = time.perf_counter()
  record = overlap.held_out(params[0], params[1], windows, ks=ks,
                            temperature=_DISTILL_T.value, batch=_BATCH.value)
  cli.progress(f"exact acceptance of {record['positions']} held-out "
               f"positions: dense {record['dense']:.4f} "
               f"({time.perf_counter() - start:.1f} s)")
  return record


def main(argv: list[str]) -> int:
  del argv
  # JAX's backend probe logs "Unable to initialize backend 'tpu'" at INFO.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  command = shlex.join(["python", "-m", "experiments.train_pair", *sys.argv[1:]])
  wall_start = time.perf_counter()
  source = (pathlib.Path(_CORPUS_ROOT.value) if _CORPUS_ROOT.value
            else corpus.stdlib_root())
  files = corpus.load_files(source)
  train_files, held_files = corpus.split(files)
  if not train_files or not held_files:
    cli.fail(f"{source}: {len(train_files)} training and {len(held_files)} "
             f"held-out files; both splits need at least one")
  fingerprint = corpus.fingerprint(files)
  cli.progress(f"corpus: {len(train_files)} training and {len(held_files)} "
               f"held-out files from {source} (fingerprint "
               f"{fingerprint[:16]})")
  cache = pathlib.Path(_CACHE_DIR.value)
  cache.mkdir(parents=True, exist_ok=True)
  key = f"{fingerprint[:16]}-v{_VOCAB.value}"
  tok = _cached_tokenizer(train_files, key, cache)
  tok_key = hashlib.sha256(tok.to_json().encode()).hexdigest()[:16]
  train_tokens = _joined_tokens(tok, train_files,
                                cache / f"train-{key}-{tok_key}.npy")
  held_tokens = _joined_tokens(tok, held_files,
                               cache / f"held-{key}-{tok_key}.npy")
  cli.progress(f"tokens: {train_tokens.size} training, {held_tokens.size} "
               f"held out ({time.perf_counter() - wall_start:.1f} s so far)")

  seq_len, batch = _SEQ_LEN.value, _BATCH.value
  configs = tuple(_model_config(role, tok.vocab) for role in _ROLES)
  root = jax.random.key(_SEED.value)
  params = tuple(transformer.init(c, jax.random.fold_in(root, i))
                 for i, c in enumerate(configs))
  earlier: list[dict[str, typing.Any]] = []
  draft_only = _DRAFT_ONLY.value
  if _INIT_FROM.value:
    roles = (("target",) if draft_only and _DRAFT_FROM_SCRATCH.value
             else _ROLES)
    loaded, earlier = _continued(cli.model_dir(_INIT_FROM.value), configs,
                                 tok, roles)
    params = tuple(p if l is None else l for l, p in zip(loaded, params))
  counts = [transformer.param_count(p) for p in params]
  cli.progress(f"params: target {counts[0]:,}, draft {counts[1]:,}"
               + (" (the target fixed)" if draft_only else ""))
  eval_rng = np.random.default_rng(_SEED.value + 1)
  held_windows = _windows(
      held_tokens, eval_rng.integers(0, held_tokens.size - seq_len - 1,
                                     _EVAL_WINDOWS.value), seq_len)
  acceptance_windows = held_windows[:_ACCEPTANCE_WINDOWS.value, :-1]
  ks = [int(k) for k in _ACCEPTANCE_KS.value if int(k) < tok.vocab]
  acceptance: dict[str, typing.Any] = {}
  if draft_only and len(acceptance_windows):
    acceptance["before"] = _acceptance(params, acceptance_windows, ks)
  if draft_only:
    optimizers: tuple[optax.GradientTransformation, ...] = (
        _optimizer(_DRAFT_LR.value),)
    opt_states = (optimizers[0].init(params[1]),)
    draft_step = _make_draft_step(optimizers[0])
  else:
    optimizers = (_optimizer(_LR.value), _optimizer(_DRAFT_LR.value))
    opt_states = tuple(o.init(p) for o, p in zip(optimizers, params))
    step = _make_step(optimizers)
  rng = np.random.default_rng(_SEED.value)
  n_windows = train_tokens.size - seq_len - 1

  train_start = time.perf_counter()
  last_t, last_step, done = train_start, 0, 0
  losses = np.zeros(2)
  for i in range(_STEPS.value):
    interrupt.check()      # SIGTERM/Ctrl-C: stop between steps
    windows = _windows(train_tokens, rng.integers(0, n_windows, batch),
                       seq_len)
    if draft_only:
      draft, opt_state, loss = draft_step(params[1], opt_states[0],
                                          params[0], jnp.asarray(windows))
      params, opt_states = (params[0], draft), (opt_state,)
    else:
      params, opt_states, loss = step(params, opt_states,
                                      jnp.asarray(windows))
    done = i + 1
    if done % _LOG_EVERY.value == 0 or done == _STEPS.value:
      losses = np.asarray(loss)
      now = time.perf_counter()
      rate = (done - last_step) * batch * seq_len / (now - last_t)
      extra = ("" if not draft_only else
               f", kl {losses[2]:.3f} tv {losses[3]:.3f} outside top "
               f"{_TOPK_PENALTY_K.value} {losses[4]:.3f}")
      cli.progress(f"step {done}/{_STEPS.value} loss target {losses[0]:.3f} "
                   f"draft {losses[1]:.3f}{extra}, {rate:,.0f} tokens/s, "
                   f"{now - train_start:.0f} s")
      last_t, last_step = now, done
    if done < _STEPS.value and _TIME_BUDGET.value and \
        time.perf_counter() - train_start > _TIME_BUDGET.value:
      cli.progress(f"time budget reached after {done} steps")
      break
    if done == _STOP_AFTER.value:
      cli.progress(f"stopped after {done} steps (--stop_after_steps)")
      break
  train_s = time.perf_counter() - train_start

  held: dict[str, dict[str, float]] = {}
  timing: dict[str, dict[str, float]] = {}
  for role, p, c in zip(_ROLES, params, configs):
    # After the last step: each phase says what it does, and beats.
    cli.progress(f"after training: the {role}'s held-out loss "
                 f"({len(held_windows)} windows) and decode timing")
    with cli.heartbeat(f"after training: the {role}'s held-out loss and "
                       "decode timing"):
      loss = _held_out_loss(p, held_windows, batch)
      held[role] = {"loss": loss, "perplexity": math.exp(loss)}
      timing[role] = decode_ms_per_token(p, c)
  for role, n in zip(_ROLES, counts):
    print(f"{role}: {n:,} params, held-out loss {held[role]['loss']:.4f} "
          f"nats/token (perplexity {held[role]['perplexity']:.2f}), decode "
          f"{timing[role]['in_jit']:.3f} ms/token in one jit, "
          f"{timing[role]['per_call']:.3f} ms per call")
  print(f"target/draft: params {counts[0] / counts[1]:.2f}x, decode "
        f"{timing['target']['in_jit'] / timing['draft']['in_jit']:.2f}x in "
        f"one jit, {timing['target']['per_call'] / timing['draft']['per_call']:.2f}x "
        f"per call")

  if len(acceptance_windows):
    cli.progress(f"after training: the pair's exact acceptance on "
                 f"{len(acceptance_windows)} held-out windows")
    with cli.heartbeat("after training: the pair's exact acceptance"):
      acceptance["after"] = _acceptance(params, acceptance_windows, ks)
    print(f"exact acceptance sum min(p, q) per position, temperature "
          f"{_DISTILL_T.value:g} (p the target's, q the draft's as the "
          "wire carries it):")
    print("\n".join(overlap.table(acceptance, ks)))

  out = pathlib.Path(_OUTPUT_DIR.value)
  if (out / checkpoint.CONFIG_FILE).exists():
    cli.progress(f"replacing the checkpoint in {out}")
  out.mkdir(parents=True, exist_ok=True)
  cli.progress(f"after training: writing the checkpoint to {out}")
  checkpoint.save_params(out / checkpoint.TARGET_FILE, params[0])
  checkpoint.save_params(out / checkpoint.DRAFT_FILE, params[1])
  tok.save(out / checkpoint.TOKENIZER_FILE)
  v = sys.version_info
  checkpoint.write_config(out / checkpoint.CONFIG_FILE, {
      "target": configs[0].to_dict(), "draft": configs[1].to_dict(),
      "tokenizer_file": checkpoint.TOKENIZER_FILE,
      "corpus": {
          "fingerprint": fingerprint, "python": f"{v[0]}.{v[1]}.{v[2]}",
          "source": ("the Python standard library's *.py files (not "
                     "site-packages), UTF-8 only; experiments/corpus.py"
                     + (f"; under {_CORPUS_ROOT.value} only"
                        if _CORPUS_ROOT.value else "")),
          "train_files": len(train_files), "held_out_files": len(held_files),
          "train_tokens": int(train_tokens.size),
          "held_out_tokens": int(held_tokens.size)},
      "command": command,
      "earlier_runs": earlier,
      "held_out": held,
      "params": dict(zip(_ROLES, counts)),
      "decode_ms_per_token": timing,
      "training": {"steps": done, "batch": batch, "seq_len": seq_len,
                   "tokens_seen": done * batch * seq_len,
                   "train_s": round(train_s, 1),
                   "wall_s": round(time.perf_counter() - wall_start, 1),
                   "seed": _SEED.value},
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      **({"held_out_acceptance": {
          "windows": len(acceptance_windows), "seq_len": seq_len,
          "temperature": _DISTILL_T.value, "ks": ks, **acceptance}}
         if acceptance else {}),
      **({"distillation": {
          "objective": _DISTILL.value, "temperature": _DISTILL_T.value,
          "topk_penalty": _TOPK_PENALTY.value,
          "topk_penalty_k": _TOPK_PENALTY_K.value,
          "draft_init": ("scratch" if _DRAFT_FROM_SCRATCH.value else
                         f"the draft of {_INIT_FROM.value}"),
          "target": f"the target of {_INIT_FROM.value}, unchanged"}}
         if draft_only else {}),
  })
  size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
  print(f"Wrote {out} ({size / 1e6:.2f} MB); run it with "
        f"{run_command(out, _MAX_LEN.value)}")
  return 0


if __name__ == "__main__":
  cli.run(main)
