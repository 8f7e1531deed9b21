r"""Trains SmolLM2's draft on the target's own samples (sequence-level).

    python -m experiments.distill_draft --phase=sample   # target's samples
    python -m experiments.distill_draft --phase=train    # the draft
    python -m experiments.distill_draft --phase=eval     # held-out acceptance

Three phases, each resumable (what a phase has written is kept and
skipped on a rerun):

  sample  SmolLM2-135M-Instruct (the pinned GGUF, float32) answers the
          project's own chat prompts (`chat_prompts`, the train split) at
          temperature 1, batch --batch, up to --answer tokens each, with
          the batched engine (`SlabTarget.decode`, the draw fused).
          Token ids only are written (--output_dir/samples/*.npz), never
          the target's rows.
  train   The draft: a small Llama over a restricted output vocabulary
          (the --keep most frequent answer tokens plus eos; its q is zero
          outside that set, which keeps verification exact and makes
          each step cheap), initialised from the target (the kept rows of
          its embedding, its final norm and the blocks --init_layers),
          trained with Adam on the answers' next-token loss (sequence-
          level distillation). Checkpoints every --save_every steps; the
          last is resumed.
  eval    Held-out acceptance: sum_v min(p, q) per drafted position on the
          held-out prompts' target samples, for dense q and sparse k = 32.

The draft ships in dyadic_jax/models/checkpoints/smollm2_draft/ (float16,
`draft_vocab.SmallVocabDraft`), written by --phase=train --ship.
Runtime on 2 cores: sample about 25 min (1,852 prompts x 160 tokens),
train about 60 min, eval 2 min.
"""

import glob
import os
import pathlib
import time
import typing

from absl import app
from absl import flags

from experiments import chat_prompts
from experiments import cli

_PHASE = flags.DEFINE_enum("phase", "sample", ["sample", "train", "eval"],
                           "Which phase to run (module doc).")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "results/smollm2_draft", "Where samples and checkpoints "
    "go (made if missing).")
_BATCH = flags.DEFINE_integer("batch", 16, "Prompts answered at once "
                              "(sample), 1..64.")
_ANSWER = flags.DEFINE_integer("answer", 160, "Tokens drawn per answer "
                               "(sample), 8..1024.")
_MAX_PROMPTS = flags.DEFINE_integer("max_prompts", 0, "Stop after this many "
                                    "prompts (0: all of the split).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling and init seed.")
_SPLITS = flags.DEFINE_list("splits", ["train", "held_out"], "Which prompt "
                            "splits to sample (sample).")
cli.check("batch", lambda v: 1 <= v <= 64, "--batch must be in [1, 64]")
cli.check("answer", lambda v: 8 <= v <= 1024, "--answer must be in "
          "[8, 1024]")
cli.check("max_prompts", lambda v: v >= 0, "--max_prompts must be >= 0")
cli.check("splits", lambda v: set(v) <= {"train", "held_out"} and v,
          "--splits: train, held_out or both")


def _sample_rows(logits: typing.Any, step: typing.Any,
                 aux: typing.Any) -> tuple[typing.Any, typing.Any]:
  """The fused draw: categorical at T = 1 under each row's key."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  keys = jax.vmap(lambda k: jax.random.fold_in(
      jax.random.wrap_key_data(k), step))(aux)
  tokens = jax.vmap(jax.random.categorical)(keys, logits)
  return tokens.astype(jnp.int32), jnp.zeros_like(tokens, jnp.int32)


def sample(output_dir: pathlib.Path, split: str = "train") -> None:
  """The sample phase (module doc): one .npz per batch of prompts."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import gguf_model  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import pair  # pylint: disable=import-outside-toplevel
  folder = output_dir / ("samples" if split == "train" else "held_out")
  folder.mkdir(parents=True, exist_ok=True)
  prompts = chat_prompts.prompts(split)
  if _MAX_PROMPTS.value:
    prompts = prompts[:_MAX_PROMPTS.value]
  batch = _BATCH.value
  model = gguf_model.read(gguf_model.locate(gguf_model.SMOLLM2),
                          max_len=256 if _ANSWER.value <= 200 else 1280)
  target = pair.TransformerTarget(
      jax.tree.map(jax.numpy.asarray, model.params), model.config)
  slab = target.batch(batch)
  started, done = time.time(), 0
  for first in range(0, len(prompts), batch):
    path = folder / f"{first:06d}.npz"
    if path.exists():
      continue
    texts = prompts[first:first + batch]
    encoded = [model.tokenizer.encode(gguf_model.chat(t)) for t in texts]
    rids = list(range(len(texts)))
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(
        jax.random.key(_SEED.value), first + i))) for i in rids])
    drawn, _ = slab.decode(rids, encoded, _ANSWER.value, _sample_rows, keys)
    answers = np.asarray(drawn)
    for rid in rids:
      slab.drop(rid)
    width = max(len(e) for e in encoded)
    prompt = np.full((len(texts), width), -1, np.int32)
    for i, e in enumerate(encoded):
      prompt[i, :len(e)] = e
    np.savez(path, prompt=prompt, answer=answers)
    done += len(texts)
    rate = done * _ANSWER.value / (time.time() - started)
    print(f"sample: {first + len(texts)}/{len(prompts)} prompts, "
          f"{rate:.0f} tokens/s", flush=True)
  print(f"sample: {len(glob.glob(str(folder / '*.npz')))} files in {folder}")


_KEEP = flags.DEFINE_integer("keep", 8192, "Output vocabulary of the draft "
                             "(train): the most frequent sample tokens, "
                             "eos included; 16..49152.")
_INIT_LAYERS = flags.DEFINE_list("init_layers", ["0", "29"], "The target's "
                                 "blocks the draft starts from (train), in "
                                 "order.")
_STEPS = flags.DEFINE_integer("steps", 240, "Training steps (train).")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch", 16, "Sequences per step "
                                    "(train).")
_LR = flags.DEFINE_float("lr", 3e-4, "Peak learning rate (train).")
_SAVE_EVERY = flags.DEFINE_integer("save_every", 20, "Checkpoint every this "
                                   "many steps (train).")
_SHIP = flags.DEFINE_string("ship", "", "Also write the trained draft to this "
                            "folder (train), e.g. dyadic_jax/models/"
                            "checkpoints/smollm2_draft.")
cli.check("keep", lambda v: 16 <= v <= 49152, "--keep must be in [16, 49152]")
cli.check("steps", lambda v: v >= 1, "--steps must be >= 1")
cli.check("train_batch", lambda v: 1 <= v <= 256, "--train_batch must be in "
          "[1, 256]")
cli.check("init_layers", lambda v: all(x.isdigit() for x in v) and v,
          "--init_layers must list block numbers")

_SEQ = 192   # prompt (<= 64 tokens) + a 128-token answer


def _sequences(folder: pathlib.Path, eos: int) -> typing.Any:
  """(tokens int32[N, _SEQ + 1], loss mask f32[N, _SEQ]) of every sample
  file: prompt then answer up to its first eos (inclusive), -1 padded
  (fed as 0, masked); the loss counts answer positions only."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  rows, masks = [], []
  for path in sorted(folder.glob("*.npz")):
    data = np.load(path)
    for prompt, answer in zip(data["prompt"], data["answer"]):
      prompt = prompt[prompt >= 0]
      end = np.flatnonzero(answer == eos)
      answer = answer[:end[0] + 1] if end.size else answer
      seq = np.concatenate([prompt, answer])[:_SEQ + 1]
      row = np.zeros(_SEQ + 1, np.int32)
      row[:seq.size] = seq
      mask = np.zeros(_SEQ, np.float32)
      mask[prompt.size - 1:seq.size - 1] = 1.0
      rows.append(row)
      masks.append(mask)
  return np.stack(rows), np.stack(masks)


def _kept_ids(tokens: typing.Any, masks: typing.Any, keep: int,
              eos: int) -> typing.Any:
  """The `keep` most frequent answer tokens (eos first), then prompt
  tokens where fewer: ascending id order within the set."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  answer = tokens[:, 1:][masks > 0]
  counts = np.bincount(answer, minlength=49152).astype(np.float64)
  counts += 1e-3 * np.bincount(tokens.ravel(), minlength=49152)
  counts[eos] = np.inf
  order = np.argsort(-counts, kind="stable")[:keep]
  return np.sort(order).astype(np.int32)


def _init_draft(model: typing.Any, kept: typing.Any) -> typing.Any:
  """(config, params) of the draft: the target's kept embedding rows plus
  an "other" row (their mean), its final norm and --init_layers."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import transformer  # pylint: disable=import-outside-toplevel
  layers = [int(x) for x in _INIT_LAYERS.value]
  p = model.params
  config = transformer.Config(
      **{**model.config.to_dict(), "vocab": kept.size + 1,
         "n_layers": len(layers), "max_len": 1024})
  other = np.delete(np.asarray(p.embed), kept, axis=0).mean(0, keepdims=True)
  fields: dict[str, typing.Any] = {
      name: np.asarray(getattr(p, name))[layers]
      for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_in", "w_out")}
  fields["embed"] = np.concatenate([np.asarray(p.embed)[kept], other])
  fields["final_norm"] = np.asarray(p.final_norm)
  return config, transformer.Params(**fields)


def train(output_dir: pathlib.Path) -> None:
  """The train phase (module doc)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import checkpoint  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import gguf_model  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import transformer  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import vocab_map  # pylint: disable=import-outside-toplevel
  model = gguf_model.read(gguf_model.locate(gguf_model.SMOLLM2), max_len=256)
  tokens, masks = _sequences(output_dir / "samples", model.eos)
  print(f"train: {len(tokens)} sequences, {int(masks.sum())} answer tokens",
        flush=True)
  ckpt = output_dir / "draft"
  ckpt.mkdir(parents=True, exist_ok=True)
  if (ckpt / checkpoint.CONFIG_FILE).exists():
    meta = checkpoint.read_config(ckpt / checkpoint.CONFIG_FILE)
    config = transformer.Config(**meta["draft"])
    kept = np.asarray(meta["kept"], np.int32)
    params = checkpoint.load_params(ckpt / checkpoint.DRAFT_FILE, config)
    done = int(meta["step"])
    last_loss = float(meta["train_loss"])
    print(f"train: resumed at step {done}", flush=True)
  else:
    kept = _kept_ids(tokens, masks, _KEEP.value, model.eos)
    config, params = _init_draft(model, kept)
    done, last_loss = 0, float("nan")
  vmap = vocab_map.make(kept, model.config.vocab)
  small = np.asarray(vocab_map.host_small(vmap, tokens), np.int32)
  arch = transformer.arch_of(config)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, _LR.value, max(1, _STEPS.value // 10), _STEPS.value,
      end_value=_LR.value * 0.1)
  # The learning rate is applied by hand from the step number, so a
  # resumed run continues the schedule (Adam's moments restart).
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.scale_by_adam(b1=0.9, b2=0.95))
  params = jax.tree.map(jnp.asarray, params)
  opt_state = optimizer.init(params)

  def loss_fn(p, batch, mask):
    logits = transformer.forward(p, batch[:, :-1], arch)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  @jax.jit
  def step(p, state, batch, mask, count):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch, mask)
    updates, state = optimizer.update(grads, state, p)
    updates = jax.tree.map(lambda u: -schedule(count) * u, updates)
    return optax.apply_updates(p, updates), state, loss

  rng = np.random.default_rng(_SEED.value + done)
  started, losses = time.time(), []
  for i in range(done, _STEPS.value):
    pick = rng.integers(0, len(small), _TRAIN_BATCH.value)
    params, opt_state, loss = step(params, opt_state, small[pick],
                                   masks[pick], i)
    losses.append(float(loss))
    if (i + 1) % 5 == 0:
      rate = (i + 1 - done) / (time.time() - started)
      print(f"train: step {i + 1}/{_STEPS.value} loss "
            f"{np.mean(losses[-5:]):.3f} ({rate * 60:.1f} steps/min)",
            flush=True)
    if (i + 1) % _SAVE_EVERY.value == 0 or i + 1 == _STEPS.value:
      _save(ckpt, config, params, kept, i + 1, float(np.mean(losses[-20:])))
  if _SHIP.value:
    _save(pathlib.Path(_SHIP.value), config, params, kept, max(done,
                                                               _STEPS.value),
          float(np.mean(losses[-20:])) if losses else last_loss)
    print(f"train: wrote {_SHIP.value}")


def _save(folder: pathlib.Path, config: typing.Any, params: typing.Any,
          kept: typing.Any, step: int, loss: float) -> None:
  from dyadic_jax.models import checkpoint  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import gguf_model  # pylint: disable=import-outside-toplevel
  folder.mkdir(parents=True, exist_ok=True)
  checkpoint.save_params(folder / checkpoint.DRAFT_FILE, params)
  checkpoint.write_config(folder / checkpoint.CONFIG_FILE, {
      "draft": config.to_dict(), "kept": [int(k) for k in kept],
      "step": step, "train_loss": loss,
      # pair.load_dir's form: the target is the shipped GGUF file.
      "target": {"gguf": gguf_model.SMOLLM2.name, "max_len": 2048,
                 "vocab": 49152, "sha256": gguf_model.SMOLLM2.sha256},
      "init_layers": [int(x) for x in _INIT_LAYERS.value],
      "command": ("python -m experiments.distill_draft --phase=sample && "
                  "python -m experiments.distill_draft --phase=train "
                  f"--steps={_STEPS.value} --keep={_KEEP.value} "
                  f"--init_layers={','.join(_INIT_LAYERS.value)}")})


_EVAL_SEQS = flags.DEFINE_integer("eval_sequences", 48, "Held-out "
                                  "sequences scored (eval).")


def acceptance(p: typing.Any, q: typing.Any, k: int | None = None
               ) -> typing.Any:
  """sum_v min(p_v, q_v) per row (float64 probabilities [..., V]); with k,
  q cut to its top k and renormalized first (the sparse q's support)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  if k is not None:
    cut = np.partition(q, -k, axis=-1)[..., -k][..., None]
    top = np.where(q >= cut, q, 0.0)
    q = top / top.sum(-1, keepdims=True)
  return np.minimum(p, q).sum(-1)


def evaluate(output_dir: pathlib.Path, draft_dir: pathlib.Path) -> dict:
  """The eval phase: held-out acceptance per answer position (module
  doc), dense and k = 32, against the draft in `draft_dir`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import checkpoint  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import gguf_model  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import transformer  # pylint: disable=import-outside-toplevel
  from dyadic_jax.models import vocab_map  # pylint: disable=import-outside-toplevel
  model = gguf_model.read(gguf_model.locate(gguf_model.SMOLLM2), max_len=256)
  tokens, masks = _sequences(output_dir / "held_out", model.eos)
  tokens, masks = tokens[:_EVAL_SEQS.value], masks[:_EVAL_SEQS.value]
  meta = checkpoint.read_config(draft_dir / checkpoint.CONFIG_FILE)
  config = transformer.Config(**meta["draft"])
  params = checkpoint.load_params(draft_dir / checkpoint.DRAFT_FILE, config)
  vmap = vocab_map.make(np.asarray(meta["kept"], np.int32),
                        model.config.vocab)
  target = jax.tree.map(jnp.asarray, model.params)
  t_arch, d_arch = transformer.arch_of(model.config), transformer.arch_of(
      config)
  dense, sparse = [], []
  for i in range(0, len(tokens), 8):
    batch, mask = tokens[i:i + 8, :-1], masks[i:i + 8] > 0
    p = jax.nn.softmax(transformer.forward(target, batch, t_arch), -1)
    small = vocab_map.host_small(vmap, batch)
    q = jax.nn.softmax(vocab_map.expand(vmap, transformer.forward(
        params, small, d_arch)), -1)
    p, q = np.asarray(p, np.float64)[mask], np.asarray(q, np.float64)[mask]
    dense.append(acceptance(p, q))
    sparse.append(acceptance(p, q, 32))
    print(f"eval: {min(i + 8, len(tokens))}/{len(tokens)} sequences",
          flush=True)
  out = {"positions": int(sum(d.size for d in dense)),
         "dense": float(np.concatenate(dense).mean()),
         "k32": float(np.concatenate(sparse).mean())}
  print(f"eval: held-out sum min(p, q) per position: dense "
        f"{out['dense']:.3f}, k=32 {out['k32']:.3f} over "
        f"{out['positions']} answer positions")
  if _SHIP.value:         # recorded beside the shipped draft
    checkpoint.write_config(draft_dir / checkpoint.CONFIG_FILE,
                            {**meta, "held_out": out})
  return out


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  output_dir = pathlib.Path(_OUTPUT_DIR.value)
  if _PHASE.value == "sample":
    for split in _SPLITS.value:
      sample(output_dir, split)
  elif _PHASE.value == "train":
    train(output_dir)
  else:
    evaluate(output_dir, pathlib.Path(_SHIP.value) if _SHIP.value
             else output_dir / "draft")


if __name__ == "__main__":
  cli.run(main)
