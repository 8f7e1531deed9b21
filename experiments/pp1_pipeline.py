"""The PP1 pipeline end to end: draft worker -> wire -> sharded verifier.

    python -m experiments.pp1_pipeline

Expected runtime: about 1 minute on a 2-core CPU with the defaults (most of
it JAX start-up and compilation in the two processes); --tokens scales the
rest linearly.

What runs (DESIGN.md section 1, one round per step of the progress bar):

* the draft worker, `experiments.bridge_worker`, as a subprocess on
  loopback: a DSpark-style toy draft (parallel backbone + Markov head,
  experiments/pipeline_models.py) drawing dyadic q rows (sparse top-k or
  dense) with its PROPOSAL keys;
* the host bridge (dyadic_jax.bridge): HELLO negotiation, STEP, REPLY rows,
  COMPLETION, validation before use, COMMIT, fallback on any defect;
* the verifier on a vocabulary mesh: `sharding.verify_chain` and
  `sharding.sample_target` over --verifier_devices devices (emulated CPU
  devices here), with the toy target and its processors (repetition
  penalty, optional grammar mask) applied unchanged.

Modes:

  --multiprocess       the verifier runs as 2 jax.distributed ranks (gloo
                       collectives on 127.0.0.1, one CPU device each) plus
                       the worker: 3 processes. The leader validates and
                       broadcasts the verdict with q; both ranks verify.
  --inject_faults=R    a loopback proxy (dyadic_jax.bridge.proxy) damages a
                       fraction R of the exchanges (drop, delay, duplicate,
                       reorder, truncate, corrupt, reset); the run still
                       finishes, every damaged exchange falls back to the
                       target-only sampler and shows in the counters.
  --check_distribution many short rounds from one prompt (a fresh request
                       each): the first committed token is compared with
                       the target's exact P/T (chi-square goodness of fit)
                       and with as many target-only samples (two-sample
                       chi-square), at --alpha. Uses --check_vocab (16).

Outputs: a summary table on stdout, --json_out (tokens, rounds,
mean_accepted, acceptance_by_position, bytes_per_round, errors, time split,
distribution_check) and a PNG plot at --plot_out.
"""

import json
import os
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags
from absl import logging

_TOKENS = flags.DEFINE_integer(
    "tokens", 48, "New tokens to generate per request.")
_REQUESTS = flags.DEFINE_integer(
    "requests", 4, "Requests verified together in one batch slot.")
_DEPTH = flags.DEFINE_integer("depth", 5, "Fixed draft depth D.")
_Q = flags.DEFINE_enum(
    "q", "sparse", ["sparse", "dense"],
    "Wire representation of q: sparse top-k rows or dense V rows.")
_K = flags.DEFINE_integer(
    "k", 32, "Support of sparse q rows (capped at V / 2 when not given, "
    "e.g. for the check's small vocabulary).")
_VOCAB = flags.DEFINE_integer(
    "vocab", None, "Vocabulary size V (default 129280; --check_distribution: "
    "--check_vocab).")
_CLOSENESS = flags.DEFINE_float(
    "closeness", 0.9, "How closely the toy draft tracks the toy target.")
_PENALTY = flags.DEFINE_float(
    "repetition_penalty", 1.3, "Target processor: repetition penalty >= 1.")
_GRAMMAR = flags.DEFINE_integer(
    "grammar_modulus", 0, "Target processor: forbid b after a when (a + b) "
    "%% m == 0 (0: off).")
_MULTIPROCESS = flags.DEFINE_bool(
    "multiprocess", False, "Verifier as 2 jax.distributed ranks (gloo) plus "
    "the worker: 3 processes.")
_DEVICES = flags.DEFINE_integer(
    "verifier_devices", 2, "Vocabulary mesh size of the single-process "
    "verifier (emulated CPU devices when on CPU).")
_FAULTS = flags.DEFINE_float(
    "inject_faults", 0.0, "Fraction of exchanges a loopback proxy damages.")
_SEED = flags.DEFINE_integer("seed", 0, "Request seeds are seed + request.")
_TIMEOUT = flags.DEFINE_float(
    "timeout", 2.0, "Verifier deadline of one exchange, seconds.")
_TRANSPORT = flags.DEFINE_enum(
    "transport", "tcp", ["tcp", "ipc"], "Loopback TCP or an ipc socket.")
_CHECK = flags.DEFINE_bool(
    "check_distribution", False, "Run the distribution check instead of "
    "open-ended generation.")
_CHECK_SAMPLES = flags.DEFINE_integer(
    "check_samples", 2000, "Independent first tokens in the check.")
_CHECK_VOCAB = flags.DEFINE_integer(
    "check_vocab", 16, "Vocabulary of the check (small, for power).")
_ALPHA = flags.DEFINE_float(
    "alpha", 1e-3, "Significance level of the check (its false-failure "
    "rate for a correct pipeline).")
_MUTANT = flags.DEFINE_enum(
    "mutant", "none", ["none", "uniform_q"], "Deliberately wrong verifier "
    "for the check's power test: uniform_q verifies against a uniform q "
    "instead of the q the draft sampled from.")
_JSON_OUT = flags.DEFINE_string(
    "json_out", "pp1_pipeline.json", "Where to write the JSON record ('' "
    "for none).")
_PLOT_OUT = flags.DEFINE_string(
    "plot_out", "pp1_pipeline.png", "Where to write the PNG plot ('' for "
    "none).")
_KILL_AT = flags.DEFINE_integer(
    "kill_worker_at", 0, "Fault drill: kill the worker process after this "
    "many rounds and start a new one on the same address, as a supervisor "
    "would (0: never). The verifier falls back while it is gone and "
    "negotiates a new session with the new process.")
_KEYS_DIR = flags.DEFINE_string(
    "keys_dir", None, "Directory of the bridge keys (python -m "
    "dyadic_jax.bridge.keys DIR). Default: a throwaway key set made for "
    "this run (and removed at its end).")
_INSECURE = flags.DEFINE_bool(
    "insecure", False, "No authentication on the bridge (CRC32C tags "
    "only); said loudly at start and in the summary. Benchmarks only.")
_ENCRYPT = flags.DEFINE_bool(
    "encrypt", False, "Encrypt the bridge link with ZeroMQ CURVE.")
_WORKER_BUG = flags.DEFINE_enum(
    "worker_bug", "none", ["none", "token_not_from_q"], "Fault drill: the "
    "worker sends its q but each drafted token is the entry after the one "
    "its draw picked. The sampling audit refuses every such proposal and "
    "--check_distribution still passes; with --no_sampling_audit it fails.")
_NO_AUDIT = flags.DEFINE_bool(
    "no_sampling_audit", False, "Turn the sampling audit off (the verifier "
    "then no longer recomputes each drafted token from its q and the "
    "PROPOSAL key; for the --worker_bug drill).")
flags.register_multi_flags_validator(
    ["insecure", "keys_dir", "encrypt"],
    lambda f: not (f["insecure"] and (f["keys_dir"] or f["encrypt"])),
    "--insecure excludes --keys_dir and --encrypt")
# Internal: the follower rank of --multiprocess.
_RANK = flags.DEFINE_integer("rank", 0, "Internal: jax.distributed rank.")
_COORDINATOR = flags.DEFINE_string("coordinator", "",
                                   "Internal: host:port of rank 0.")
_WORKER_ADDRESS = flags.DEFINE_string("worker_address", "",
                                      "Internal: the worker's address.")
_INSECURE_WARNING = ("WARNING: --insecure: the bridge link is NOT "
                     "authenticated; any process that reaches the socket "
                     "can talk to either side")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The seed's size table: q bytes per request and round (exact arithmetic).
_SEED_BYTES = {"dense": lambda v, d, k: 4 * v * d,
               "sparse": lambda v, d, k: 8 * k * d}


def _vocab():
  if _VOCAB.value is not None:
    return _VOCAB.value
  from dyadic_jax import DEFAULT_VOCAB  # pylint: disable=g-import-not-at-top
  return _CHECK_VOCAB.value if _CHECK.value else DEFAULT_VOCAB


def _k(vocab):
  if flags.FLAGS["k"].present:
    return _K.value
  return min(_K.value, max(1, vocab // 2))


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(devices=None):
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get(
      "PYTHONPATH", ""))
  env["XLA_FLAGS"] = " ".join(
      f for f in env.get("XLA_FLAGS", "").split()
      if "force_host_platform_device_count" not in f)
  if devices:
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
  return env


def _key_flags(keys_dir):
  if _INSECURE.value:
    return ["--insecure"]
  return [f"--keys_dir={keys_dir}"] + (["--encrypt"] if _ENCRYPT.value
                                       else [])


def _start_worker(vocab, tmp, keys_dir, address=None):
  address = address or ("tcp://127.0.0.1:0" if _TRANSPORT.value == "tcp"
                        else f"ipc://{tmp}/pp1-worker-{os.getpid()}.sock")
  cmd = [sys.executable, "-m", "experiments.bridge_worker",
         f"--address={address}", f"--vocab={vocab}",
         f"--depth={_DEPTH.value}", f"--requests={_REQUESTS.value}",
         f"--q={_Q.value}", f"--k={_k(vocab)}",
         f"--closeness={_CLOSENESS.value}",
         f"--worker_bug={_WORKER_BUG.value}"] + _key_flags(keys_dir)
  env = _child_env()
  env["JAX_PLATFORMS"] = "cpu"   # the worker's draft runs on the host CPU
  proc = subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  line = proc.stdout.readline()
  if not line.startswith("READY "):
    proc.kill()
    raise RuntimeError(f"the worker did not start: {line!r}")
  return proc, line.split()[1]


def _stop_worker(proc):
  proc.terminate()
  try:
    out, _ = proc.communicate(timeout=20)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
  for line in (out or "").splitlines():
    if line.startswith("STATS "):
      return json.loads(line[6:])
  return {}


def _setup_jax(multiprocess, rank, coordinator):
  import jax  # pylint: disable=g-import-not-at-top
  if multiprocess:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(coordinator, num_processes=2,
                               process_id=rank, initialization_timeout=120)
  elif jax.default_backend() == "cpu" and jax.device_count() < (
      _DEVICES.value):
    raise app.UsageError(
        f"--verifier_devices={_DEVICES.value} needs that many devices; run "
        "with XLA_FLAGS=--xla_force_host_platform_device_count=N (the "
        "pipeline sets it itself when XLA_FLAGS does not name a count)")
  return jax


def _capabilities(vocab):
  from dyadic_jax import bridge  # pylint: disable=g-import-not-at-top
  from dyadic_jax.wire import layouts  # pylint: disable=g-import-not-at-top
  rep = (layouts.Representation.SPARSE if _Q.value == "sparse"
         else layouts.Representation.DENSE)
  return bridge.Capabilities(vocab=vocab, max_depth=_DEPTH.value,
                             max_requests=_REQUESTS.value,
                             representation=rep, max_support=_k(vocab))


def _request_spec(rid, vocab):
  """(prompt, seed) of request rid: the same on every rank."""
  return [(7 * rid + 1) % vocab], _SEED.value * 1_000_003 + rid


def _build_verifier(jax, caps, address, share_fn, timer, keys_dir):
  """A Verifier over a vocabulary mesh with the toy target."""
  import functools  # pylint: disable=g-import-not-at-top
  from dyadic_jax import bridge  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from experiments import pipeline_models  # pylint: disable=g-import-not-at-top

  devices = jax.devices() if _MULTIPROCESS.value else jax.devices()[
      :_DEVICES.value]
  mesh = sharding.vocab_mesh(len(devices), devices)
  target, _ = pipeline_models.make_models(pipeline_models.ModelConfig(
      vocab=caps.vocab, closeness=_CLOSENESS.value,
      repetition_penalty=_PENALTY.value, grammar_modulus=_GRAMMAR.value,
      max_depth=caps.max_depth))
  verify = functools.partial(sharding.verify_chain, mesh=mesh)
  sample = functools.partial(sharding.sample_target, mesh=mesh)
  if _MUTANT.value == "uniform_q":
    verify = functools.partial(_uniform_q_verify, verify, caps)

  def timed(name, fn):
    def call(*args, **kwargs):
      start = time.perf_counter()
      out = fn(*args, **kwargs)
      jax.block_until_ready(out)
      timer[name] = timer.get(name, 0.0) + time.perf_counter() - start
      return out
    return call

  from dyadic_jax.bridge import keys as keys_lib  # pylint: disable=g-import-not-at-top
  secret = curve = None
  if not _INSECURE.value and keys_dir is not None:
    secret, curve = keys_lib.load(keys_dir, "verifier",
                                  encrypt=_ENCRYPT.value)
  verifier = bridge.Verifier(
      caps, address, target_fn=timed("verify", target.logits),
      verify_fn=timed("verify", verify), sample_fn=timed("verify", sample),
      timeout_s=_TIMEOUT.value, share_fn=share_fn, secret=secret,
      curve=curve, sampling_audit=not _NO_AUDIT.value,
      request_factory=lambda rid: _request_spec(rid, caps.vocab))
  return verifier


def _uniform_q_verify(verify, caps, logits, q, draft, key, *, anchor):
  """The mutant: verifies against a uniform q, not the sampled one."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dyadic_jax as dj  # pylint: disable=g-import-not-at-top
  v, depth = caps.vocab, len(draft)
  counts = np.full((depth, v), dj.M // v, np.int32)
  counts[:, :dj.M - (dj.M // v) * v] += 1
  return verify(logits, dj.DenseQ(counts), draft, key, anchor=anchor)


class _Progress:
  """A one-line progress bar on stderr."""

  def __init__(self, total, label):
    self.total, self.label, self.start = max(total, 1), label, time.time()

  def update(self, done, extra=""):
    frac = min(done / self.total, 1.0)
    bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
    sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total} "
                     f"{time.time() - self.start:5.1f}s {extra}   ")
    sys.stderr.flush()

  def close(self):
    sys.stderr.write("\n")


def _generate(verifier, caps, progress, on_round=None):
  """Rounds over all requests until each has --tokens new tokens."""
  rids = list(range(caps.max_requests))
  for rid in rids:
    verifier.add_request(rid, *_request_spec(rid, caps.vocab))
  results = []
  goal = {rid: len(verifier.requests[rid].tokens) + _TOKENS.value
          for rid in rids}
  done = lambda: sum(min(len(verifier.requests[r].tokens), goal[r]) -
                     goal[r] + _TOKENS.value for r in rids)
  while any(len(verifier.requests[r].tokens) < goal[r] for r in rids):
    results += verifier.round(rids)
    if on_round:   # a fault drill may run rounds of its own
      results += on_round(len(results) // len(rids))
    progress.update(done(), f"fallbacks {verifier.counters.events('fallbacks')}")
  progress.close()
  return results


def _check(verifier, caps, progress):
  """First committed token of many fresh requests, one round each."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  r = caps.max_requests
  n = _CHECK_SAMPLES.value - _CHECK_SAMPLES.value % r
  first, results = [], []
  for start in range(0, n, r):
    rids = list(range(1000 + start, 1000 + start + r))
    for rid in rids:     # one fixed prompt, a fresh seed per request
      verifier.add_request(rid, [1], _SEED.value * 1_000_003 + rid)
    out = verifier.round(rids)
    results += out
    first += [res.committed[0] for res in out]
    progress.update(start + r)
  progress.close()
  return np.asarray(first), results


def _distribution_check(first, caps, rids_seed):
  """Goodness of fit to the exact P/T and a two-sample test vs target-only."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dyadic_jax as dj  # pylint: disable=g-import-not-at-top
  from experiments import chi2  # pylint: disable=g-import-not-at-top
  from experiments import pipeline_models  # pylint: disable=g-import-not-at-top

  target, _ = pipeline_models.make_models(pipeline_models.ModelConfig(
      vocab=caps.vocab, closeness=_CLOSENESS.value,
      repetition_penalty=_PENALTY.value, grammar_modulus=_GRAMMAR.value,
      max_depth=caps.max_depth))
  row = target.row(np.array([1], np.int32))
  probs, _ = dj.target_probs(row)
  p_fixed, total = dj.quantize_target(probs)
  expected = np.asarray(p_fixed, np.float64) / int(total)
  # Target-only samples with keys of their own (a domain of the check).
  keys = jax.vmap(lambda i: dj.draw_key(dj.round_key(rids_seed, 1 << 20, i),
                                        0, dj.Domain.TARGET_ONLY))(
                                            np.arange(len(first)))
  target_only, _ = jax.vmap(dj.sample_target, in_axes=(None, 0))(row, keys)
  target_only = np.asarray(target_only)
  v = caps.vocab
  spec = np.bincount(first, minlength=v)
  ref = np.bincount(target_only, minlength=v)
  # Bins with expected count < 5 pooled into one, for both samples alike.
  e, s_obs, r_obs = chi2.pool_small(expected * len(first), spec, ref)
  gof, _, gof_p = chi2.goodness_of_fit(s_obs, e / e.sum())
  two, _, two_p = chi2.two_sample(s_obs, r_obs)
  passed = gof_p >= _ALPHA.value and two_p >= _ALPHA.value
  return {"samples": int(len(first)), "alpha": _ALPHA.value,
          "bins": int(len(e)), "statistic": gof, "p_value": gof_p,
          "two_sample_statistic": two, "two_sample_p_value": two_p,
          "verdict": "pass" if passed else "fail",
          "expected": expected.tolist(), "speculative": spec.tolist(),
          "target_only": ref.tolist()}


def _summarize(results, verifier, caps, worker_stats, proxy, timer, wall,
               check):
  import numpy as np  # pylint: disable=g-import-not-at-top
  verified = [r for r in results if not r.fallback]
  depth = caps.max_depth
  acc = np.array([r.accepted for r in verified], np.int64)
  by_pos = [float(np.mean(acc[acc >= i] > i)) if np.any(acc >= i)
            else None for i in range(depth)]
  exchanges = len({(r.generation, r.round, r.rid) for r in results})
  batches = max(1, exchanges // max(1, caps.max_requests))
  counters = verifier.counters.snapshot()
  bytes_in = verifier.counters.events("bytes_in")
  bytes_out = verifier.counters.events("bytes_out")
  seed_q = caps.max_requests * _SEED_BYTES[_Q.value](caps.vocab, depth,
                                                     caps.max_support)
  draft_s = worker_stats.get("events", {}).get("propose_us", 0) / 1e6
  exchange_s = timer.get("exchange", 0.0)
  record = {
      "config": {"vocab": caps.vocab, "requests": caps.max_requests,
                 "depth": depth, "q": _Q.value, "k": caps.max_support,
                 "multiprocess": _MULTIPROCESS.value,
                 "inject_faults": _FAULTS.value, "seed": _SEED.value,
                 "mutant": _MUTANT.value,
                 "authentication": ("none (--insecure)" if _INSECURE.value
                                    else "keyed BLAKE3"),
                 "encrypt": _ENCRYPT.value,
                 "sampling_audit": not _NO_AUDIT.value,
                 "worker_bug": _WORKER_BUG.value},
      "tokens": int(sum(len(r.committed) for r in results)),
      "rounds": batches,
      "request_rounds": len(results),
      "fallback_rounds": len(results) - len(verified),
      "mean_accepted": float(acc.mean()) if acc.size else 0.0,
      "tokens_per_round": (float(np.mean([len(r.committed) for r in results]))
                           if results else 0.0),
      "acceptance_by_position": by_pos,
      "bytes_per_round": {"measured_in": bytes_in / batches,
                          "measured_out": bytes_out / batches,
                          "seed_estimate_q": seed_q},
      "errors": counters["errors"],
      "events": counters["events"],
      "worker": worker_stats,
      "faults": ({f"{d}/{k}": n for (d, k), n in proxy.counts().items()}
                 if proxy else {}),
      "time_s": {"wall": wall, "draft": draft_s,
                 "bridge": max(exchange_s - draft_s
                               - timer.get("verify", 0.0), 0.0),
                 "verification": timer.get("verify", 0.0)},
  }
  if check is not None:
    record["distribution_check"] = check
  return record


def _print_summary(record):
  c = record["config"]
  print(f"\nPP1 pipeline: V={c['vocab']} requests={c['requests']} "
        f"depth={c['depth']} q={c['q']}"
        + (f" k={c['k']}" if c["q"] == "sparse" else "")
        + (" multiprocess" if c["multiprocess"] else "")
        + (f" faults={c['inject_faults']}" if c["inject_faults"] else ""))
  rows = [("tokens committed", record["tokens"]),
          ("rounds (batches)", record["rounds"]),
          ("request-rounds / fallbacks",
           f"{record['request_rounds']} / {record['fallback_rounds']}"),
          ("mean accepted drafts", f"{record['mean_accepted']:.3f}"),
          ("tokens per request-round", f"{record['tokens_per_round']:.3f}")]
  for name, value in rows:
    print(f"  {name:<28} {value}")
  print("  acceptance by position       " + "  ".join(
      "-" if a is None else f"{a:.3f}"
      for a in record["acceptance_by_position"]))
  b = record["bytes_per_round"]
  print(f"  bytes per round              in {b['measured_in']:,.0f}  out "
        f"{b['measured_out']:,.0f}  (seed estimate of q alone: "
        f"{b['seed_estimate_q']:,})")
  t = record["time_s"]
  print(f"  time split (s)               draft {t['draft']:.2f}  bridge "
        f"{t['bridge']:.2f}  verification {t['verification']:.2f}  wall "
        f"{t['wall']:.2f}")
  print(f"  bridge link                  {c['authentication']}"
        + (", CURVE encrypted" if c["encrypt"] else "")
        + ("" if c["sampling_audit"] else ", sampling audit OFF")
        + (f", worker bug {c['worker_bug']}" if c["worker_bug"] != "none"
           else ""))
  if c["authentication"].startswith("none"):
    print("  " + _INSECURE_WARNING)
  print(f"  errors                       {record['errors'] or 'none'}")
  if record["faults"]:
    print(f"  injected faults              {record['faults']}")
  check = record.get("distribution_check")
  if check:
    print(f"\nDistribution check: first committed token of "
          f"{check['samples']} fresh requests vs the target's exact P/T")
    print(f"  {'token':>6} {'P/T':>8} {'spec':>6} {'target-only':>11}")
    for v, (e, s, r) in enumerate(zip(check["expected"], check["speculative"],
                                      check["target_only"])):
      if e * check["samples"] >= 1 or s or r:
        print(f"  {v:>6} {e:8.4f} {s:6d} {r:11d}")
    print(f"  goodness of fit: chi2={check['statistic']:.2f} "
          f"bins={check['bins']} p={check['p_value']:.4f}; two-sample: "
          f"chi2={check['two_sample_statistic']:.2f} "
          f"p={check['two_sample_p_value']:.4f} -> {check['verdict'].upper()}"
          f" at alpha={check['alpha']:g}")


def _plot(record, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  check = record.get("distribution_check")
  fig, axes = plt.subplots(1, 3 if check else 2, figsize=(
      15 if check else 10, 4))
  acc = [a or 0.0 for a in record["acceptance_by_position"]]
  axes[0].bar(range(1, len(acc) + 1), acc, color="tab:blue")
  axes[0].set(title="acceptance by draft position", xlabel="position i",
              ylabel="P(accept x_i | x_1..x_{i-1} accepted)", ylim=(0, 1))
  t = record["time_s"]
  names = ["draft", "bridge", "verification"]
  axes[1].bar(names, [t[n] for n in names], color="tab:orange")
  axes[1].set(title=f"time split (wall {t['wall']:.1f} s)", ylabel="s")
  if check:
    v = range(len(check["expected"]))
    n = check["samples"]
    axes[2].bar([x - 0.2 for x in v], [s / n for s in check["speculative"]],
                0.4, label="speculative")
    axes[2].bar([x + 0.2 for x in v], [s / n for s in check["target_only"]],
                0.4, label="target-only")
    axes[2].plot(list(v), check["expected"], "k.", label="exact P/T")
    axes[2].set(title=f"first token, p={check['p_value']:.3f} "
                f"({check['verdict']})", xlabel="token")
    axes[2].legend()
  c = record["config"]
  fig.suptitle(f"PP1 pipeline: V={c['vocab']}, {c['requests']} requests, "
               f"D={c['depth']}, q={c['q']}, mean accepted "
               f"{record['mean_accepted']:.2f}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _follower(argv):
  del argv
  jax = _setup_jax(True, _RANK.value, _COORDINATOR.value)
  caps = _capabilities(_vocab())
  from dyadic_jax.bridge import ranks  # pylint: disable=g-import-not-at-top
  share = ranks.plan_broadcast(caps)
  verifier = _build_verifier(jax, caps, _WORKER_ADDRESS.value, share, {},
                             None)
  rounds = verifier.follow()
  logging.info("follower rank %d ran %d rounds", _RANK.value, rounds)
  jax.distributed.shutdown()


def main(argv):
  # absl shows INFO records; JAX's backend probe logs "Unable to initialize
  # backend 'tpu'" at INFO on every machine without a TPU.
  import logging as std_logging  # pylint: disable=g-import-not-at-top
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
  if _RANK.value:
    return _follower(argv)
  if not _MULTIPROCESS.value and "force_host_platform_device_count" not in (
      os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count="
                               f"{_DEVICES.value}").strip()
  vocab = _vocab()
  if _Q.value == "sparse" and not 1 <= _k(vocab) <= vocab:
    raise app.UsageError(f"--k must be in [1, {vocab}]")
  import tempfile  # pylint: disable=g-import-not-at-top
  tmp = tempfile.mkdtemp(prefix="pp1-")
  start = time.time()
  keys_dir, temp_keys = _KEYS_DIR.value, None
  if _INSECURE.value:
    print(_INSECURE_WARNING, file=sys.stderr, flush=True)
  elif keys_dir is None:   # one command stays one command: throwaway keys
    from dyadic_jax.bridge import keys as keys_lib  # pylint: disable=g-import-not-at-top
    temp_keys = keys_lib.temporary()
    keys_dir = str(temp_keys.path)
  worker, worker_address = _start_worker(vocab, tmp, keys_dir)
  follower = proxy = jax = None
  coordinator = f"127.0.0.1:{_free_port()}"
  try:
    if _MULTIPROCESS.value:
      follower = subprocess.Popen(
          [sys.executable, "-m", "experiments.pp1_pipeline", "--rank=1",
           f"--coordinator={coordinator}",
           f"--worker_address={worker_address}"] + [
               a for a in sys.argv[1:] if not a.startswith("--rank")],
          cwd=_ROOT, env=_child_env(), stdout=subprocess.DEVNULL)
    jax = _setup_jax(_MULTIPROCESS.value, 0, coordinator)
    caps = _capabilities(vocab)
    address = worker_address
    if _FAULTS.value > 0:
      from dyadic_jax.testing import proxy as proxy_lib  # pylint: disable=g-import-not-at-top
      proxy = proxy_lib.Proxy("tcp://127.0.0.1:0", worker_address,
                              rate=_FAULTS.value, seed=_SEED.value,
                              deadline_s=_TIMEOUT.value).start()
      address = proxy.address
    share = None
    if _MULTIPROCESS.value:
      from dyadic_jax.bridge import ranks  # pylint: disable=g-import-not-at-top
      share = ranks.plan_broadcast(caps)
    timer = {}
    verifier = _build_verifier(jax, caps, address, share, timer, keys_dir)
    verifier.open()
    # Every round: STEP out to COMMIT (draft + bridge + verification).
    real_round = verifier.round

    def timed_round(*args):
      t0 = time.perf_counter()
      out = real_round(*args)
      timer["exchange"] = timer.get("exchange", 0.0) + (
          time.perf_counter() - t0)
      return out
    verifier.round = timed_round
    check = None
    if _CHECK.value:
      first, results = _check(verifier, caps, _Progress(
          _CHECK_SAMPLES.value, "check"))
      check = _distribution_check(first, caps, _SEED.value)
    else:
      workers = [worker]

      def drill(rounds):
        if rounds != _KILL_AT.value:
          return []
        workers[0].kill()
        workers[0].wait()
        # One round runs against nobody, then the supervisor restarts it.
        lost = verifier.round(list(range(caps.max_requests)))
        workers[0], _ = _start_worker(vocab, tmp, keys_dir, worker_address)
        logging.info("fault drill: worker killed and restarted")
        return lost

      results = _generate(verifier, caps, _Progress(
          _TOKENS.value * caps.max_requests, "tokens"),
                          on_round=drill if _KILL_AT.value else None)
      worker = workers[0]
    verifier.stop_followers()
    verifier.close()
  finally:
    worker_stats = _stop_worker(worker)
    if temp_keys is not None:
      temp_keys.cleanup()
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(tmp, ignore_errors=True)
    if proxy:
      proxy.stop()
    if follower:
      # The shutdown is a barrier with the follower's own: before the wait.
      jax.distributed.shutdown()
      follower.wait(timeout=120)
  record = _summarize(results, verifier, caps, worker_stats, proxy, timer,
                      time.time() - start, check)
  _print_summary(record)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=1)
    print(f"\nwrote {_JSON_OUT.value}")
  if _PLOT_OUT.value:
    _plot(record, _PLOT_OUT.value)
    print(f"wrote {_PLOT_OUT.value}")
  if check is not None and check["verdict"] != "pass":
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
