"""The trained pair: acceptance by q format (the k screen) and speedup.

  python -m experiments.bench_pair [--prompts=64 --new_tokens=128
      --formats=dense,16,32,64,256 --depth=5 --bridge --json_out=F
      --plot_out=F]

On held-out prompts of the standard library's source (experiments/corpus.py)
and the shipped stdlib pair (dyadic_jax/models/checkpoints/stdlib), at
temperature 1:

1. **The k screen.** For dense q and sparse q of each k in --formats, every
   prompt is decoded speculatively in this process (`bridge.generate.Local`:
   the worker's proposer and the verifier's rounds, no wire). Reported per
   format: acceptance by position (of the drafts that reached position i,
   the fraction accepted), mean accepted drafts and tokens per round, and
   beside them the exact expected acceptance of the same rows, sum_x min(p,
   q) (p the target's FP64 softmax, q the dyadic row drawn from; averaged
   over the positions the rounds reached). The measured rate must agree
   with it up to sampling noise: it is the probability the rule accepts.
2. **Speed.** Tokens per second of target-only decoding (the target's
   slab at batch --requests and at batch 1: one fused call per 16 steps,
   `generate.target_only`) and of speculative decoding with each format
   at batch --requests (one draft call and one target call per round), in
   one process; with --bridge also over the bridge on loopback (a worker
   process, `experiments.bridge_worker --model`, authenticated, the q on
   the wire) for the best one-process format, with one round in flight
   and with two (the worker drafts one group while the verifier verifies
   the other: the share of the worker's turn hidden, and the round's wall
   against the busier side's busy time, `in_flight.overlap`). Each run's
   time split (draft steps, verify pass, verification, exchange, host), and the speedup the
   standard cost model predicts from the measured acceptance alpha, the
   draft's cost per drafted token c, the verify pass's r and the rest of a
   round u (verification, host), each over one batched target-only step,
   and the depth D: E / (c D + r + u) with E = (1 - alpha^(D+1)) / (1 -
   alpha) tokens per round (the textbook model is r = 1, u = 0).

3. **The peer.** The same weights in Hugging Face transformers
   (`ArceeForCausalLM`, exported by experiments/export_hf.py) on the same
   prompts and lengths, under --hf_python (experiments/hf_interpreter.py;
   skipped with a note where it has no torch): plain `generate` at batch 1
   and batch 4, and assisted generation with the draft at depth D
   (experiments/hf_decode.py). Every run, ours and the peer's, is reported
   in tokens per wall second and per CPU second (the process's, all its
   threads; over the bridge the worker's CPU too), measured in this run.
4. **The regime.** A speculative round costs one verify pass over D + 1
   rows where target-only decoding pays one step per token; the ratio r
   of the two (measured: the speculative run's target seconds per round
   over batched target-only's per step, both over the whole batch)
   decides whether speculation can pay: the model's speedup is E / (c D +
   r + u), so it breaks even at r = E - c D - u. A weight-bound step (a
   GPU, or weights far beyond the caches) has r near 1; a lean engine on
   a CPU has r well above 1, and the table says so.

Same prompts, same seeds and the same batch (--requests) in every run.
"""

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from experiments import cli
from experiments import hf_interpreter

_MODEL = flags.DEFINE_string(
    "model", "stdlib", "The trained pair: a shipped one's name "
    "(dyadic_jax/models/checkpoints/NAME) or a checkpoint directory "
    "(python -m experiments.train_pair --output_dir).")
_PROMPTS = flags.DEFINE_integer("prompts", 64, "Held-out prompts.",
                                lower_bound=1, upper_bound=4096)
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens of each "
                                      "prompt.", lower_bound=1,
                                      upper_bound=1 << 16)
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "New tokens per "
                                   "prompt.", lower_bound=1,
                                   upper_bound=1 << 16)
_DEPTH = flags.DEFINE_integer("depth", 5, "Drafted tokens per round D.",
                              lower_bound=1, upper_bound=32)
_REQUESTS = flags.DEFINE_integer("requests", 4, "Requests per batch.",
                                 lower_bound=1, upper_bound=64)
_FORMATS = flags.DEFINE_list(
    "formats", ["dense", "16", "32", "64", "256"], "q formats screened: "
    "dense, or a sparse row's k (an integer in [1, V]).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the prompts and the "
                             "requests.", lower_bound=0,
                             upper_bound=(1 << 31) - 1)
_BRIDGE = flags.DEFINE_bool("bridge", True, "Also decode over the bridge "
                            "on loopback (a worker process) with the best "
                            "one-process format.")
_SPLIT_CPUS = flags.DEFINE_bool(
    "split_cpus", True, "Over the bridge, give the worker process half of "
    "this machine's CPUs and the verifier the other half (CPU affinity), "
    "as two hosts would have: else both sides share every core and each "
    "side's work slows the other's.")
_JSON_OUT = flags.DEFINE_string("json_out", "bench_pair.json", "Where the "
                                "record goes ('' for none).")
_PLOT_OUT = flags.DEFINE_string("plot_out", "bench_pair.png", "Where the "
                                "plot goes ('' for none).")
cli.check("formats", lambda formats: bool(formats) and all(
    f == "dense" or (f.isdigit() and int(f) >= 1) for f in formats),
          "--formats: a comma-separated list of dense and sparse k values "
          "(positive integers)")
cli.check_checkpoint("model", "--model is a shipped pair's name (stdlib) "
                     "or a checkpoint directory")
_HF = hf_interpreter.define_flags("hf_decode.py")
cli.check_output_path("json_out")
cli.check_output_path("plot_out")
cli.parse_flags_early(__name__, extra="experiments")

# pylint: disable=g-import-not-at-top
import numpy as np

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.bridge import generate
from dyadic_jax.bridge import keys as keys_lib
from dyadic_jax.models import gguf_model
from dyadic_jax.models import hf_layout
from dyadic_jax.models import pair as pair_lib
from dyadic_jax.wire.layouts import Representation
from experiments import chat_prompts
from experiments import corpus
from experiments import in_flight as in_flight_lib
from experiments import run_folder
# pylint: enable=g-import-not-at-top


def caps_of(name: str, vocab: int) -> bridge.Capabilities:
  """The session of q format `name` ("dense" or a sparse k)."""
  dense = name == "dense"
  return bridge.Capabilities(
      vocab=vocab, max_depth=_DEPTH.value, max_requests=_REQUESTS.value,
      representation=Representation.DENSE if dense else
      Representation.SPARSE, max_support=32 if dense else int(name))


class Screen:
  """Per position: drafts reached, accepted, and the sum of min(p, q)."""

  def __init__(self, depth: int, vocab: int) -> None:
    self.reached = np.zeros(depth, np.int64)
    self.accepted = np.zeros(depth, np.int64)
    self.overlap = np.zeros(depth)
    self.vocab = vocab

  def __call__(self, rids, proposals, logits, outcomes) -> None:
    del rids
    for p, rows, (accepted, _) in zip(proposals, logits, outcomes):
      exact, _ = dj.target_probs(rows[:len(p.tokens)])
      probs = np.asarray(exact, np.float64)
      q = np.zeros_like(probs)
      values = p.values.astype(np.float64)
      if p.ids is None:
        q[:] = values
      else:
        for i in range(len(p.tokens)):
          live = slice(0, int(p.n[i]))
          q[i, p.ids[i, live]] = values[i, live]
      reached = min(accepted + 1, len(p.tokens))
      self.reached[:reached] += 1
      self.accepted[:accepted] += 1
      self.overlap[:reached] += np.minimum(probs, q).sum(-1)[:reached]

  def record(self) -> dict:
    reached = np.maximum(self.reached, 1)
    return {"reached": self.reached.tolist(),
            "acceptance_by_position": (self.accepted / reached).tolist(),
            "expected_by_position": (self.overlap / reached).tolist(),
            "acceptance": float(self.accepted.sum() / reached.sum()),
            "expected": float(self.overlap.sum() / reached.sum())}


def row_agreement(target, prompts, continuations, rows: int = 33) -> dict:
  """How far one-token-at-a-time rows are from one chunked verify pass.

  For each prompt P and its first `rows` - 1 target-only tokens T, the
  target's rows after P + T[:j] (j = 0..len(T)) are computed twice: in one
  pass over P + T (as a verify pass scores a chain) and one token per call
  on the request's cache (as target-only decoding does). Returns the
  largest absolute logit difference and the largest total variation
  distance between the two rows' softmax distributions.
  """
  empty = np.zeros(0, np.int32)
  max_abs = max_tv = 0.0
  for prompt, cont in zip(prompts, continuations):
    cont = [int(t) for t in cont[:rows - 1]]
    chunk, _ = target.logits(target.init_state(), np.asarray(prompt,
                                                             np.int32),
                             np.asarray(cont, np.int32))
    chunk = np.asarray(chunk, np.float64)
    state = target.init_state()
    for j in range(len(cont) + 1):
      row, state = target.logits(state, np.asarray(prompt + cont[:j],
                                                   np.int32), empty)
      row = np.asarray(row[0], np.float64)
      max_abs = max(max_abs, float(np.abs(row - chunk[j]).max()))
      p, q = (np.exp(x - x.max()) for x in (row, chunk[j]))
      max_tv = max(max_tv, 0.5 * float(np.abs(p / p.sum()
                                              - q / q.sum()).sum()))
  return {"prompts": len(prompts), "rows_per_prompt": rows,
          "max_abs_logit_difference": max_abs, "max_tv": max_tv}


def tokens_per_round(alpha: float, depth: int) -> float:
  """E: the expected tokens a round commits at per-position acceptance
  alpha (accepted drafts plus the correction or bonus)."""
  if alpha >= 1.0:
    return depth + 1.0
  return (1 - alpha ** (depth + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, c: float, depth: int,
                      pass_ratio: float = 1.0, rest: float = 0.0) -> float:
  """The cost model's speedup over target-only decoding: E / (c D + r +
  u), r the verify pass's cost over one target step (1: the textbook
  model) and u the rest of a round (verification, host; 0: the textbook
  model), both in target-only steps."""
  return tokens_per_round(alpha, depth) / (c * depth + pass_ratio + rest)


def weight_floor(target) -> dict:
  """The floor of a weight-bound step, measured now: a memcpy of as many
  bytes as the target's weights (median of 5), and one target-only step
  at batch 1 over it."""
  import jax  # pylint: disable=g-import-not-at-top
  nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(target.params))
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  times = []
  for _ in range(5):
    start = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - start)
  return {"weight_bytes": nbytes, "memcpy_s": float(np.median(times))}


def run_record(out: generate.Result, cpu_s: float) -> dict:
  return {"tokens": out.new_tokens, "rounds": out.rounds,
          "tokens_per_second": out.tokens_per_second,
          "cpu_s": cpu_s, "tokens_per_cpu_second": out.new_tokens / cpu_s,
          "mean_accepted": float(out.accepted.mean()) if out.accepted.size
          else 0.0, "seconds": out.seconds}


def timed(fn, *args, **kwargs) -> tuple[generate.Result, float]:
  """fn's result and the CPU seconds this process spent in it."""
  start = time.process_time()
  out = fn(*args, **kwargs)
  return out, time.process_time() - start


def child_cpu_s(pid: int) -> float:
  """CPU seconds (user + system) process `pid` has used so far (Linux)."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def warm(link, prompts) -> None:
  """Compiles a link's programs (not timed): one batch of the prompts at
  full length, so every batch size, attention span and chunk shape the
  timed run meets is compiled."""
  generate.generate(link, prompts[:_REQUESTS.value],
                    max_new_tokens=_NEW_TOKENS.value, seed=_SEED.value + 1)


def cpu_halves() -> tuple[set[int], set[int]] | None:
  """(the worker's CPUs, the verifier's) under --split_cpus: this
  process's CPUs in two halves; None without the flag or with one CPU."""
  cpus = sorted(os.sched_getaffinity(0))
  if not _SPLIT_CPUS.value or len(cpus) < 2:
    return None
  half = len(cpus) // 2
  return set(cpus[:half]), set(cpus[half:])


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
  """Every thread of this process (XLA's pools included) on `cpus` for
  the block (None: unchanged)."""
  if cpus is None:
    yield
    return
  tasks = [int(t) for t in os.listdir("/proc/self/task")]
  before = {t: os.sched_getaffinity(t) for t in tasks}
  for t in tasks:
    os.sched_setaffinity(t, cpus)
  try:
    yield
  finally:
    for t, mask in before.items():
      try:
        os.sched_setaffinity(t, mask)
      except OSError:       # the thread has ended
        pass


def start_worker(name: str, tmp: str, cpus: set[int] | None = None):
  """A worker process serving the pair with format `name` (on `cpus`
  where given); (process, address, keys dir)."""
  keys_dir = str(keys_lib.make(os.path.join(tmp, "keys")))
  q = ["--q=dense"] if name == "dense" else ["--q=sparse", f"--k={name}"]
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.bridge_worker",
       f"--model={cli.model_name(_MODEL.value)}", f"--depth={_DEPTH.value}",
       f"--requests={_REQUESTS.value}", f"--keys_dir={keys_dir}", *q],
      stdout=subprocess.PIPE, text=True,
      preexec_fn=None if cpus is None else (
          lambda: os.sched_setaffinity(0, cpus)))
  assert proc.stdout is not None
  line = proc.stdout.readline().split()
  if line[:1] != ["READY"]:
    proc.kill()
    cli.fail(f"the worker did not start: {line}")
  return proc, line[1], keys_dir


def over_bridge(name: str, pair: pair_lib.Pair, prompts) -> dict:
  """The prompts decoded over the bridge on loopback with format `name`,
  with one round in flight and with two (the worker drafts one group
  while this side verifies the other): each leg's record, the verifier's
  wait for answers per round, and the overlap (`overlap`)."""
  caps = caps_of(name, pair.target.vocab)
  legs = {}
  halves = cpu_halves()
  with run_folder.folder("bench_pair-") as tmp, pinned(   # keys: reaped
      None if halves is None else halves[1]):
    proc, address, keys_dir = start_worker(
        name, tmp, None if halves is None else halves[0])
    loaded = keys_lib.load(keys_dir, "verifier")
    verifier = bridge.Verifier(caps, address, target=pair.target,
                               secret=loaded.secret, curve=loaded.curve,
                               timeout_s=30.0)
    try:
      verifier.open()
      link = generate.Bridged(verifier)
      warm(link, prompts)
      for in_flight in (1, 2):
        worker_cpu = child_cpu_s(proc.pid)
        waited = verifier.waited_s
        fallbacks = verifier.counters.events("fallbacks")
        out, cpu_s = timed(generate.generate, link, prompts,
                           max_new_tokens=_NEW_TOKENS.value,
                           seed=_SEED.value, in_flight=in_flight)
        worker_cpu = child_cpu_s(proc.pid) - worker_cpu
        # Both processes' CPU: the verifier's (this one) and the worker's.
        legs[in_flight] = dict(
            run_record(out, cpu_s + worker_cpu), format=name,
            in_flight=in_flight, worker_cpu_s=worker_cpu,
            waited_s=verifier.waited_s - waited,
            fallbacks=verifier.counters.events("fallbacks") - fallbacks)
    finally:
      verifier.close()
      proc.terminate()
      proc.wait(30)
  one, two = legs[1], legs[2]
  two["cpus"] = (None if halves is None else
                 {"worker": sorted(halves[0]), "verifier": sorted(halves[1])})
  two["one_in_flight"] = one
  two["overlap"] = in_flight_lib.overlap(*(
      {"units": leg["tokens"], "wall_s": leg["seconds"]["wall"],
       "waited_s": leg["waited_s"]} for leg in (one, two)))
  return two


def peer(pair_dir, pair: pair_lib.Pair, prompts) -> dict:
  """The transformers peer's legs on the same prompts (hf_decode.py), or
  {"note": why not}. A GGUF target is loaded from its own file by
  transformers (the same float32 weights); its draft is exported over the
  full vocabulary (`hf_layout.save_full_vocab`)."""
  with tempfile.TemporaryDirectory(prefix="bench_pair-hf-") as tmp:
    if "gguf" in pair.meta.get("target", {}):
      spec = gguf_model.SHIPPED[pair.meta["target"]["gguf"]]
      draft = pair.draft
      folders = {"target": gguf_model.locate(spec, check=False),
                 "draft": hf_layout.save_full_vocab(
                     os.path.join(tmp, "draft"), draft.params, draft.config,
                     pair.meta["kept"], pair.target.vocab)}
    else:
      folders = hf_layout.export_pair(pair_dir, tmp)
    job = os.path.join(tmp, "job.json")
    with open(job, "w") as f:
      json.dump({"target": str(folders["target"]),
                 "draft": str(folders["draft"]),
                 "prompts": [[int(t) for t in p] for p in prompts],
                 "new_tokens": _NEW_TOKENS.value, "depth": _DEPTH.value,
                 "threads": _HF.threads.value, "seed": _SEED.value}, f)
    record, note = hf_interpreter.run(_HF.python.value, "hf_decode.py", job)
  return {"note": note, **(record or {})}


def main(argv):
  del argv
  # JAX's backend probe logs "Unable to initialize backend 'tpu'" at INFO.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  hf_interpreter.check_named(_HF)
  cli.progress(f"loading the {_MODEL.value} pair and {_PROMPTS.value} "
               "held-out prompts")
  pair_dir = cli.model_dir(_MODEL.value)
  pair = pair_lib.load_dir(pair_dir, max_depth=_DEPTH.value)
  vocab, depth = pair.target.vocab, _DEPTH.value
  need = _PROMPT_TOKENS.value + _NEW_TOKENS.value + depth + 1
  if need > pair.target.max_len:
    cli.usage_error(f"--prompt_tokens + --new_tokens + --depth + 1 = {need} "
                    f"exceeds the model's context ({pair.target.max_len})")
  for f in _FORMATS.value:
    if f != "dense" and int(f) > vocab:
      cli.usage_error(f"--formats: k={f} exceeds V={vocab}")
  if pair.meta.get("chat"):
    # A chat model: the held-out chat prompts in its template.
    prompts = [list(p) for p in chat_prompts.held_out_prompts(
        pair.tokenizer, _PROMPTS.value, _PROMPT_TOKENS.value, _SEED.value,
        gguf_model.chat)]
  else:
    prompts = [list(p) for p in corpus.held_out_prompts(
        pair.tokenizer, _PROMPTS.value, _PROMPT_TOKENS.value, _SEED.value)]
  kw = dict(max_new_tokens=_NEW_TOKENS.value, seed=_SEED.value)

  # The baselines: the same batch as the speculative runs (the best plain
  # decoding this engine does; the speedups are against it) and batch 1.
  baselines = {}
  for batch in sorted({_REQUESTS.value, 1}, reverse=True):
    cli.progress(f"target-only decoding, batch {batch} (a baseline)")
    generate.target_only(pair.target, prompts[:batch], batch=batch,
                         max_new_tokens=_NEW_TOKENS.value,
                         seed=_SEED.value + 1)            # warm, as `warm`
    out, cpu_s = timed(generate.target_only, pair.target, prompts,
                       batch=batch, **kw)
    baselines[batch] = (out, cpu_s)
  base, base_cpu = baselines[_REQUESTS.value]
  # One batched target-only step (its pass over one row per request and
  # its draw): the cost model's unit.
  step_s = base.seconds["target"] / base.rounds
  floor = weight_floor(pair.target)
  b1_out = baselines[1][0]
  floor["step_b1_s"] = b1_out.seconds["target"] / b1_out.rounds
  floor["step_over_memcpy"] = floor["step_b1_s"] / floor["memcpy_s"]
  cli.progress("rows: one chunked verify pass vs one token per call")
  rows = row_agreement(pair.target, prompts[:8], base.tokens[:8])
  record = {"model": _MODEL.value, "meta": {k: pair.meta.get(k) for k in (
      "target", "draft", "corpus_fingerprint", "python")},
            "prompts": _PROMPTS.value, "prompt_tokens": _PROMPT_TOKENS.value,
            "new_tokens": _NEW_TOKENS.value, "depth": depth,
            "requests": _REQUESTS.value, "seed": _SEED.value,
            "date": time.strftime("%Y-%m-%d"), "nproc": os.cpu_count(),
            "target_only": run_record(base, base_cpu),
            "target_only_b1": run_record(*baselines[1]), "rows": rows,
            "weight_floor": floor,
            "formats": {}}
  for name in _FORMATS.value:
    cli.progress(f"speculative decoding, q {name} (one process)")
    caps = caps_of(name, vocab)
    link = generate.Local(pair.draft, pair.target, caps)
    warm(link, prompts)          # the same link: its programs compiled
    screen = link.observe = Screen(depth, vocab)
    out, cpu_s = timed(generate.generate, link, prompts, **kw)
    # Per round of the batch, in batched target-only steps: the draft's
    # cost per drafted position c, the verify pass's r and the rest u.
    per_round = max(out.rounds, 1) * step_s
    c = out.seconds["draft"] / depth / per_round
    r = out.seconds["target"] / per_round
    u = (out.seconds["verify"] + out.seconds["host"]) / per_round
    entry = dict(run_record(out, cpu_s), **screen.record(),
                 draft_cost_ratio=c, pass_ratio=r, rest_ratio=u)
    entry["speedup"] = out.tokens_per_second / base.tokens_per_second
    entry["predicted_speedup"] = predicted_speedup(entry["expected"], c,
                                                   depth, r, u)
    entry["break_even_pass_ratio"] = (
        tokens_per_round(entry["expected"], depth) - c * depth - u)
    record["formats"][name] = entry
    print(f"  q {name:>6}: acceptance {entry['acceptance']:.3f} (exact "
          f"{entry['expected']:.3f}), accepted/round "
          f"{entry['mean_accepted']:.2f}, {entry['tokens_per_second']:.1f} "
          f"tok/s = {entry['speedup']:.2f}x target-only (model "
          f"{entry['predicted_speedup']:.2f}x at pass/step {r:.2f})",
          flush=True)
  best = max(record["formats"],
             key=lambda n: record["formats"][n]["tokens_per_second"])
  record["best_format"] = best
  if _BRIDGE.value:
    cli.progress(f"speculative decoding over the bridge, q {best}")
    bridged = over_bridge(best, pair, prompts)
    for leg in (bridged, bridged["one_in_flight"]):
      leg["speedup"] = leg["tokens_per_second"] / base.tokens_per_second
    record["bridge"] = bridged
  if _HF.hf.value:
    cli.progress("the transformers peer on the same weights and prompts")
    record["peer"] = peer(pair_dir, pair, prompts)
  print_tables(record)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=1)
    print(f"wrote {_JSON_OUT.value}")
  if _PLOT_OUT.value:
    plot(record, _PLOT_OUT.value)
    print(f"wrote {_PLOT_OUT.value}")


_PEER_LEGS = (("target_b1", "target-only, batch 1"),
              ("target_b4", "target-only, batched generate, batch 4"),
              ("assisted_b1", "assisted generation, batch 1"))


def regime(entry: dict) -> str:
  """In words: whether a verify pass costs about one step, and so whether
  speculation can pay at this acceptance."""
  r, even = entry["pass_ratio"], entry["break_even_pass_ratio"]
  kind = ("close to one step, as a weight-bound step is" if r < 1.5 else
          "well above one step, as a lean engine's on a CPU")
  if even <= 0:
    verdict = (f"cannot pay even with a free verify pass: the draft and "
               f"the rest of a round cost {-even:.2f} steps more than the "
               "tokens a round commits")
  elif r < even:
    verdict = f"pays: r is below the break-even {even:.2f}"
  else:
    verdict = f"cannot pay: r is not below the break-even {even:.2f}"
  return (f"a pass over D+1 rows costs r = {r:.2f} steps, {kind}; at this "
          f"acceptance speculation {verdict}")


def versus_peer(record: dict) -> list[str]:
  """The issue's targets as ratios to the transformers peer, wall and CPU:
  target-only at batch 1 and at --requests, and each side's fastest exact
  mode. Empty without the peer's legs."""
  p = record.get("peer", {})
  if "target_b1" not in p:
    return []
  ours = {"target-only, batch 1": record["target_only_b1"],
          f"target-only, batch {record['requests']}": record["target_only"]}
  ours.update({f"speculative q {n}": e
               for n, e in record["formats"].items()})
  theirs = {label: p[key] for key, label in _PEER_LEGS if key in p}

  def ratio(a, b):
    return (f"{a['tokens_per_second'] / b['tokens_per_second']:.2f}x wall, "
            f"{a['tokens_per_cpu_second'] / b['tokens_per_cpu_second']:.2f}x"
            " per CPU-s")

  lines = ["\nagainst the transformers peer (ours / theirs):"]
  lines.append("  target-only, batch 1: "
               + ratio(record["target_only_b1"], p["target_b1"]))
  if "target_b4" in p and record["requests"] == 4:
    lines.append(f"  target-only, batch 4: "
                 f"{ratio(record['target_only'], p['target_b4'])}")
  fast = max(ours, key=lambda n: ours[n]["tokens_per_second"])
  peer_fast = max(theirs, key=lambda n: theirs[n]["tokens_per_second"])
  lines.append(f"  fastest exact mode: ours ({fast}) / theirs ({peer_fast}): "
               f"{ratio(ours[fast], theirs[peer_fast])}")
  return lines


def print_tables(record: dict) -> None:
  d = record["depth"]
  print(f"\nk screen: {record['prompts']} held-out prompts x "
        f"{record['new_tokens']} new tokens, D={d}, temperature 1")
  print("| q | acceptance by position (exact sum min(p,q)) | accepted / "
        "round | tokens / round |")
  print("|---|---|---:|---:|")
  for name, e in record["formats"].items():
    pos = " ".join(f"{a:.2f} ({x:.2f})" for a, x in zip(
        e["acceptance_by_position"], e["expected_by_position"]))
    print(f"| {name} | {pos} | {e['mean_accepted']:.2f} | "
          f"{e['mean_accepted'] + 1:.2f} |")
  r = record["rows"]
  print(f"\nrows of one chunked verify pass vs one token per call "
        f"({r['prompts']} prompts x {r['rows_per_prompt']} rows): max |logit "
        f"difference| {r['max_abs_logit_difference']:.2e}, max TV "
        f"{r['max_tv']:.2e}")
  base = record["target_only"]
  print(f"\nspeed, {record['requests']} requests per batch (tokens per "
        "second of wall and of CPU; seconds split draft / target / verify "
        "/ exchange / host)")
  print("| run | tokens/s | tokens/CPU-s | speedup | model | split (s) |")
  print("|---|---:|---:|---:|---:|---|")

  def split(s):
    return " / ".join(f"{s[p]:.1f}" for p in generate.PARTS)

  b1 = record["target_only_b1"]
  print(f"| dyadic-jax target-only, batch {record['requests']} | "
        f"{base['tokens_per_second']:.1f} | "
        f"{base['tokens_per_cpu_second']:.1f} | 1.00 | | "
        f"{split(base['seconds'])} |")
  if record["requests"] != 1:         # else the row above is batch 1
    print(f"| dyadic-jax target-only, batch 1 | "
          f"{b1['tokens_per_second']:.1f} | "
          f"{b1['tokens_per_cpu_second']:.1f} | "
          f"{b1['tokens_per_second'] / base['tokens_per_second']:.2f} | | "
          f"{split(b1['seconds'])} |")
  for name, e in record["formats"].items():
    print(f"| dyadic-jax one process, q {name} | "
          f"{e['tokens_per_second']:.1f} | {e['tokens_per_cpu_second']:.1f} "
          f"| {e['speedup']:.2f} | {e['predicted_speedup']:.2f} "
          f"(alpha {e['expected']:.2f}, c {e['draft_cost_ratio']:.3f}, r "
          f"{e['pass_ratio']:.2f}, u {e['rest_ratio']:.2f}) | "
          f"{split(e['seconds'])} |")
  if "bridge" in record:
    two = record["bridge"]
    for b in (two["one_in_flight"], two):
      print(f"| dyadic-jax bridge, q {b['format']}, {b['in_flight']} in "
            f"flight | {b['tokens_per_second']:.1f} | "
            f"{b['tokens_per_cpu_second']:.1f} | "
            f"{b['tokens_per_second'] / base['tokens_per_second']:.2f} | | "
            f"{split(b['seconds'])} |")
  p = record.get("peer", {})
  for key, label in _PEER_LEGS:
    if key in p:
      leg = p[key]
      print(f"| transformers {label} | {leg['tokens_per_second']:.1f} | "
            f"{leg['tokens_per_cpu_second']:.1f} | "
            f"{leg['tokens_per_second'] / base['tokens_per_second']:.2f} | "
            "| |")
  if p:
    print(p["note"])
  for line in versus_peer(record):
    print(line)
  best = record["formats"][record["best_format"]]
  print(f"regime (q {record['best_format']}): {regime(best)}")
  f = record.get("weight_floor")
  if f:
    print(f"weight floor: a batch-1 target-only step takes "
          f"{f['step_b1_s'] * 1e3:.1f} ms = {f['step_over_memcpy']:.2f}x a "
          f"memcpy of its {f['weight_bytes'] / 1e6:.0f} MB of weights "
          f"({f['memcpy_s'] * 1e3:.1f} ms, this run)")
  if "bridge" in record:
    for line in bridge_lines(record):
      print(line)


def bridge_lines(record: dict) -> list[str]:
  """The bridge legs against the one-process rate of the same format, and
  what two in flight hid."""
  two = record["bridge"]
  one, o = two["one_in_flight"], two["overlap"]
  local = record["formats"][two["format"]]["tokens_per_second"]
  return [
      f"bridge, q {two['format']}: {one['tokens_per_second'] / local:.2f}x "
      f"the one-process rate with one round in flight, "
      f"{two['tokens_per_second'] / local:.2f}x with two "
      f"({two['fallbacks'] + one['fallbacks']} fallbacks; "
      + (f"worker on CPUs {two['cpus']['worker']}, verifier on "
         f"{two['cpus']['verifier']})" if two["cpus"] else
         "both sides on every CPU)"),
      in_flight_lib.line(o, "token")]


def plot(record: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  positions = np.arange(1, record["depth"] + 1)
  for name, e in record["formats"].items():
    line, = left.plot(positions, e["acceptance_by_position"], "o-",
                      label=f"q {name}")
    left.plot(positions, e["expected_by_position"], "x--",
              color=line.get_color())
  left.set(xlabel="drafted position", ylabel="acceptance",
           title="measured (o) and exact sum min(p, q) (x)", ylim=(0, 1),
           xticks=positions)
  left.legend(fontsize=8)
  runs = [("target-only", record["target_only"])] + [
      (f"q {n}", e) for n, e in record["formats"].items()]
  if "bridge" in record:
    runs.append((f"bridge q {record['bridge']['format']}", record["bridge"]))
  bottom = np.zeros(len(runs))
  for part in generate.PARTS:
    ms = np.array([1e3 * r["seconds"][part] / r["tokens"] for _, r in runs])
    right.bar([n for n, _ in runs], ms, bottom=bottom, label=part)
    bottom += ms
  right.set(ylabel="ms per new token", title="cost per token, split")
  right.tick_params(axis="x", rotation=45, labelsize=8)
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  cli.run(main)
