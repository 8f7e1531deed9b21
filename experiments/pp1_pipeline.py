"""The PP1 pipeline end to end: draft worker -> wire -> sharded verifier.

    python -m experiments.pp1_pipeline

Runtime with the defaults: 84 s, measured 2026-12-03 on 2 cores with load
average 11.3 before and 14.0 after (memcpy of 10 MB: 1.02 ms before, 0.88 ms
after); docs/figures.json, recorded by `python -m experiments.record_figures`.
Of the 78.1 s its summary counts, start-up, compile and worker start-up took
67.2 s and the 23 rounds 9.0 s; --tokens scales only the rounds.

The summary's time split says where a run's time went.

What runs (docs/architecture.md, "One round"; one round per step of the
progress bar):

* the draft worker, `experiments.bridge_worker`, as a subprocess on
  loopback: the DSpark-style toy draft of dyadic_jax/testing/toy_models.py
  (parallel backbone + Markov head) drawing dyadic q rows (sparse top-k or
  dense) with its PROPOSAL keys;
* the host bridge (dyadic_jax.bridge): HELLO negotiation, STEP, REPLY rows,
  COMPLETION, validation before use, COMMIT, fallback on any defect;
* the verifier on a requests x vocab mesh (`--verifier_requests` groups of
  the vocabulary split; 1 by default): `sharding.verify_batch`, one call
  per round, and `sharding.sample_target` over --verifier_devices devices
  (emulated CPU devices here), with the toy target and its processors (repetition
  penalty, optional grammar mask) applied unchanged.

Every request runs until it has --tokens new tokens and then leaves the
batch. Its last round may verify more tokens than it still needs (a round
commits accepted drafts + 1): those are dropped, so "new tokens" is exactly
--requests x --tokens, and the dropped tail is reported beside it. Every
round of the run, the last ones included, counts in the acceptance and
per-round figures.

Modes:

  --verifier_ranks=N   the verifier runs as N jax.distributed ranks (gloo
                       collectives on 127.0.0.1, one CPU device each) plus
                       the worker. The leader validates and broadcasts the
                       verdict with q; every rank verifies. --multiprocess
                       is --verifier_ranks=2.
  --worker_ranks=N     the worker runs as N jax.distributed ranks (a TP-N
                       draft: each rank one vocabulary block; the draws are
                       shard-then-token collectives, the leader owns the
                       keys). With --q=dense and --verifier_ranks=N each
                       worker rank sends only its block to the verifier
                       rank of the same index on its own link; the verifier
                       ranks agree on every row (global mass, audit) before
                       use and the plan travels without q
                       (dyadic_jax/bridge/rank_links.py). The summary and
                       the JSON's "links" give each link's bytes and time
                       per round; "committed" (every mode) each request's
                       committed tokens, the same as one process's.
                       Drills: --kill_worker_at (its last rank dies, the
                       worker restarts), --inject_faults with --fault_link=S
                       (the proxy on rank S's link; --fault_kinds=drop,...)
                       and --worker_bug=shard_mass (rank N-1's shard is
                       authentic but its row's mass is M + 1): each
                       proposal they touch is discarded on every rank.
  --inject_faults=R    a loopback proxy (dyadic_jax.testing.proxy) damages a
                       fraction R of the exchanges (drop, delay, duplicate,
                       reorder, truncate, corrupt, reset); the run still
                       finishes, every damaged exchange falls back to the
                       target-only sampler and shows in the counters.
  --check_distribution many short rounds from one prompt (a fresh request
                       each): the first committed token is compared with
                       the target's exact P/T (chi-square goodness of fit)
                       and with as many target-only samples (two-sample
                       chi-square), at --alpha. Uses --check_vocab (16).
  --worker_bug=token_not_from_q
                       a drill: the worker sends its q but draws its tokens
                       elsewhere (the entry after the drawn one). The
                       verifier's sampling audit refuses every such
                       proposal (SAMPLING_MISMATCH), so --check_distribution
                       still passes; with --no_sampling_audit it fails.

The bridge link is authenticated (docs/security.md): by default with a
throwaway key set made for the run (--keys_dir=DIR uses the keys of
`python -m dyadic_jax.bridge.keys DIR`); --encrypt adds ZeroMQ CURVE;
--insecure turns authentication off and says so at start and in the
summary.

Outputs: a summary table on stdout, --json_out (tokens, rounds,
mean_accepted, acceptance_by_position, bytes_per_round, errors, the time
split, distribution_check) and a PNG plot at --plot_out; a file left by an
earlier run is replaced, and the "wrote" line says so. Start-up, compile
and the wait for the worker print a progress line each on stderr, before
the progress bar of the rounds. Each exchange's deadline follows the
measured round time (4x the median of the last 32 answered exchanges, a
session's first at least 4x --timeout, within [--timeout, --timeout_max]);
the summary says how many fallbacks were timeouts rather than refused q.
The time split
adds up to the wall time: start-up (the key set, worker spawn, JAX start,
building the verifier), compile (the verifier's warm-up), worker start-up (waiting for
the worker's READY and HELLO beyond that), then per round draft (the
worker's proposal time), bridge (the rest of each exchange: encode,
transport, decode, validation), verification (target rows, verify_batch,
fallback samples), host (everything else in the loop: STEP/COMMIT,
bookkeeping, the plan broadcast with --multiprocess), shutdown, and other
(what no phase claims: the gaps between phases). The wall
time runs from the program's start to the end of the shutdown; the Python
interpreter's own start before it and writing the JSON and the plot after
it are not in it.

Every flag is checked when the command line is parsed (bad values exit at
once with a one-line error). The worker's session flags (--vocab, --depth,
--requests, --q, --k, --closeness, --model_seed, --backbone, and the
link's --keys_dir, --insecure, --encrypt, --worker_bug) are shared with
it: experiments/pipeline_config.py.
"""

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing

from absl import flags

from experiments import cli
from experiments import pipeline_config

_START = time.perf_counter()   # the wall clock starts with the program

# --help lists the session flags (--q, --k, --depth, --keys_dir ...) too.
flags.adopt_module_key_flags(pipeline_config)

_CHECK_RID0 = 1000             # request ids of the distribution check
_MAX_RID = 0xFFFE              # wire: 0xFFFF means "every request"
# A request's seed, seed * 1000003 + rid, must fit the keys' int64.
_MAX_SEED = ((1 << 63) - 1 - _MAX_RID) // 1_000_003

_TOKENS = flags.DEFINE_integer(
    "tokens", 48, "New tokens to generate per request (>= 1).",
    lower_bound=1, upper_bound=1_000_000)
_PENALTY = flags.DEFINE_float(
    "repetition_penalty", 1.3, "Target processor: repetition penalty in "
    "[1, 100] (1: off).")
_GRAMMAR = flags.DEFINE_integer(
    "grammar_modulus", 0, "Target processor: forbid b after a when (a + b) "
    "% m == 0 (0: off; else m >= 2).", lower_bound=0,
    upper_bound=(1 << 31) - 1)
_MULTIPROCESS = flags.DEFINE_bool(
    "multiprocess", False, "Verifier as 2 jax.distributed ranks (gloo, one "
    "CPU device each) plus the worker: 3 processes.")
_VERIFIER_RANKS = flags.DEFINE_integer(
    "verifier_ranks", 1, f"Verifier as this many jax.distributed ranks "
    f"(1..{pipeline_config.MAX_RANKS}; gloo, one CPU device each, a "
    "vocabulary mesh over them). With --q=dense and --worker_ranks equal to "
    "it, rank s receives block s of q on its own link from worker rank s "
    "(rank-to-rank links); otherwise rank 0 receives q and broadcasts the "
    "round's plan.", lower_bound=1, upper_bound=pipeline_config.MAX_RANKS)
_DEVICES = flags.DEFINE_integer(
    "verifier_devices", 2, "Devices of the single-process verifier's mesh, "
    "1..64 (emulated CPU devices when on CPU).", lower_bound=1,
    upper_bound=64)
_REQUEST_GROUPS = flags.DEFINE_integer(
    "verifier_requests", 1, "Size of the verifier mesh's \"requests\" axis: "
    "a round's requests split over this many device groups, each group's "
    "vocabulary over --verifier_devices / this many devices; must divide "
    "--verifier_devices.", lower_bound=1, upper_bound=64)
_FAULTS = flags.DEFINE_float(
    "inject_faults", 0.0, "Fraction of exchanges a loopback proxy damages, "
    "in [0, 1].")
_FAULT_LINK = flags.DEFINE_integer(
    "fault_link", 0, "With rank links: the rank whose link the "
    "--inject_faults proxy sits on (0: the leader's session link).",
    lower_bound=0, upper_bound=pipeline_config.MAX_RANKS - 1)
_FAULT_KINDS = flags.DEFINE_list(
    "fault_kinds", [], "The faults --inject_faults draws from (default: "
    "all of drop, delay, duplicate, reorder, truncate, corrupt, reset).")
_SEED = flags.DEFINE_integer(
    "seed", 0, f"Request seeds are seed * 1000003 + request id; seed in [0, "
    f"{_MAX_SEED}].", lower_bound=0, upper_bound=_MAX_SEED)
_TIMEOUT = flags.DEFINE_float(
    "timeout", 2.0, "Floor of the verifier's deadline of one exchange, "
    "seconds, in (0, 3600]: each exchange gets 4x the median time of the "
    "last 32 answered ones (a session's first: at least 4x --timeout), "
    "within [--timeout, --timeout_max], so that a loaded machine does not "
    "time out a healthy run (a fixed deadline: --timeout_max equal to it).")
_TIMEOUT_MAX = flags.DEFINE_float(
    "timeout_max", 30.0, "Ceiling of the verifier's deadline of one "
    "exchange, seconds, in (0, 3600] (at least --timeout: the larger of the "
    "two is used): the longest a lost exchange can cost.")
_TRANSPORT = flags.DEFINE_enum(
    "transport", "tcp", ["tcp", "ipc"], "Loopback TCP or an ipc socket.")
_CHECK = flags.DEFINE_bool(
    "check_distribution", False, "Run the distribution check instead of "
    "open-ended generation.")
_CHECK_SAMPLES = flags.DEFINE_integer(
    "check_samples", 2000, "Independent first tokens in the check (at "
    "least --requests; rounded down to a multiple of it).", lower_bound=1,
    upper_bound=_MAX_RID - _CHECK_RID0 - pipeline_config.MAX_REQUESTS)
_CHECK_VOCAB = flags.DEFINE_integer(
    "check_vocab", 16, "Vocabulary of the check when --vocab is not given "
    "(small, for power).", lower_bound=2, upper_bound=cli.MAX_VOCAB)
_ALPHA = flags.DEFINE_float(
    "alpha", 1e-3, "Significance level of the check, in (0, 1): its "
    "false-failure rate for a correct pipeline.")
_MUTANT = flags.DEFINE_enum(
    "mutant", "none", ["none", "uniform_q"], "Deliberately wrong verifier "
    "for the check's power test (needs --check_distribution): uniform_q "
    "verifies against a uniform q instead of the q the draft sampled from.")
_NO_AUDIT = flags.DEFINE_bool(
    "no_sampling_audit", False, "Turn the sampling audit off: the verifier "
    "then no longer recomputes each drafted token from its q and the "
    "PROPOSAL key (for the --worker_bug drill).")
_JSON_OUT = flags.DEFINE_string(
    "json_out", "pp1_pipeline.json", "Where to write the JSON record ('' "
    "for none); an existing file is replaced, and the run says so.")
_PLOT_OUT = flags.DEFINE_string(
    "plot_out", "pp1_pipeline.png", "Where to write the PNG plot ('' for "
    "none); an existing file is replaced, and the run says so.")
_KILL_AT = flags.DEFINE_integer(
    "kill_worker_at", 0, "Fault drill: after this many rounds, kill the "
    "worker process (with --worker_ranks, its last rank) in the middle of "
    "the next round (once its STEP is made), then start the worker again "
    "on the same address(es), as a supervisor would (0: never). The "
    "verifier falls back while it is gone and negotiates a new session "
    "with the new process.", lower_bound=0)
# Internal: the follower ranks of --verifier_ranks.
_RANK = flags.DEFINE_integer("rank", 0, "Internal: jax.distributed rank.",
                             lower_bound=0,
                             upper_bound=pipeline_config.MAX_RANKS - 1)
_SHARD_ADDRESS = flags.DEFINE_string(
    "shard_address", "", "Internal: the rank link a follower rank connects.")
_STATS_OUT = flags.DEFINE_string(
    "stats_out", "", "Internal: where a follower rank writes its link's "
    "figures.")
_COORDINATOR = flags.DEFINE_string("coordinator", "",
                                   "Internal: host:port of rank 0.")


def _finite_in(lo, hi, *, open_lo=False):
  def ok(x):
    return math.isfinite(x) and (lo < x if open_lo else lo <= x) and x <= hi
  return ok


cli.check("repetition_penalty", _finite_in(1.0, 100.0),
          "--repetition_penalty must be a number in [1, 100]")
cli.check("grammar_modulus", lambda m: m != 1,
          "--grammar_modulus must be 0 (off) or >= 2")
cli.check("inject_faults", _finite_in(0.0, 1.0),
          "--inject_faults must be a fraction in [0, 1]")
cli.check("timeout", _finite_in(0.0, 3600.0, open_lo=True),
          "--timeout must be a number of seconds in (0, 3600]")
cli.check("timeout_max", _finite_in(0.0, 3600.0, open_lo=True),
          "--timeout_max must be a number of seconds in (0, 3600]")
cli.check("alpha", lambda a: math.isfinite(a) and 0.0 < a < 1.0,
          "--alpha must be in (0, 1)")
_Q = pipeline_config.Q_FORMATS
cli.check("q", lambda q: _Q[q].sampled, "--q=greedy is the worker's v1 "
          "mode (no q on the wire); the pipeline verifies q rows (--q="
          + " or --q=".join(n for n, f in _Q.items() if f.sampled) + ")")
cli.check(["check_samples", "requests"], lambda check_samples, requests:
          check_samples >= requests, "--check_samples must be >= --requests")
cli.check(["k", "vocab", "check_distribution", "check_vocab", "q"],
          lambda k, vocab, check_distribution, check_vocab, q: (
              not _Q[q].uses_support or vocab is not None
              or not flags.FLAGS["k"].present
              or k <= (check_vocab if check_distribution
                       else cli.DEFAULT_VOCAB)),
          "--k must be <= the vocabulary (--vocab, or --check_vocab with "
          "--check_distribution)")
cli.check(["mutant", "check_distribution"], lambda mutant, check_distribution:
          mutant == "none" or check_distribution,
          "--mutant needs --check_distribution (it is the check's power test)")
cli.check(["kill_worker_at", "check_distribution"],
          lambda kill_worker_at, check_distribution:
          not (kill_worker_at and check_distribution),
          "--kill_worker_at is a drill of the generation run, not of "
          "--check_distribution")
cli.check(["multiprocess", "verifier_ranks"],
          lambda multiprocess, verifier_ranks: not (
              multiprocess and flags.FLAGS["verifier_ranks"].present),
          "--multiprocess is --verifier_ranks=2: give one of them")
cli.check(["multiprocess", "verifier_ranks", "verifier_devices"],
          lambda multiprocess, verifier_ranks, verifier_devices: not (
              (multiprocess or verifier_ranks > 1)
              and flags.FLAGS["verifier_devices"].present),
          "--verifier_devices is the single-process mesh; --verifier_ranks "
          "(and --multiprocess) run ranks of one device each")
cli.check(["q", "worker_ranks", "verifier_ranks", "multiprocess"],
          lambda q, worker_ranks, verifier_ranks, multiprocess: (
              not _Q[q].shardable or worker_ranks == 1
              or worker_ranks == (2 if multiprocess else verifier_ranks)),
          "--q=dense with --worker_ranks > 1 pairs each worker rank with a "
          "verifier rank: --verifier_ranks must equal --worker_ranks")
cli.check(["verifier_requests", "verifier_devices", "multiprocess",
           "verifier_ranks"],
          lambda verifier_requests, verifier_devices, multiprocess,
          verifier_ranks: (
              verifier_devices % verifier_requests == 0
              and not ((multiprocess or verifier_ranks > 1)
                       and verifier_requests > 1)),
          "--verifier_requests must divide --verifier_devices (and is for "
          "the single-process verifier: --multiprocess splits the "
          "vocabulary only)")
cli.check(["fault_link", "q", "worker_ranks"],
          lambda fault_link, q, worker_ranks: fault_link == 0 or (
              _Q[q].shardable and fault_link < worker_ranks),
          "--fault_link names a rank link: it needs --q=dense and "
          "--worker_ranks > it")
cli.check("fault_kinds", lambda kinds: set(kinds) <= {
    "drop", "delay", "duplicate", "reorder", "truncate", "corrupt", "reset"},
          "--fault_kinds: a comma-separated subset of drop, delay, "
          "duplicate, reorder, truncate, corrupt, reset")
cli.check(["rank", "coordinator"],
          lambda rank, coordinator: rank == 0 or bool(coordinator),
          "--rank is internal: it needs --coordinator")
cli.check_output_path("json_out")
cli.check_output_path("plot_out")
# The leader loads the verifier's keys and starts the worker on the same
# folder: both roles' files.
pipeline_config.check_keys_dir(["verifier", "worker"])
cli.parse_flags_early(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_READY_TIMEOUT_S = 600   # worker start-up: JAX import and one compile


def _deadline():
  """Each exchange's deadline (bridge.AdaptiveDeadline): --timeout to
  --timeout_max, following the measured round time."""
  from dyadic_jax import bridge  # pylint: disable=g-import-not-at-top
  return bridge.AdaptiveDeadline(
      _TIMEOUT.value, max(_TIMEOUT.value, _TIMEOUT_MAX.value))


def _say(text):
  """A progress line of the leader's start-up (stderr, with the progress
  bar): the run is never silent while it starts, compiles or waits."""
  if not _RANK.value:
    cli.progress(f"{text} [{time.perf_counter() - _START:.1f} s]")


def _config():
  return pipeline_config.from_flags(
      default_vocab=_CHECK_VOCAB.value if _CHECK.value else cli.DEFAULT_VOCAB)


def _request_spec(rid, vocab):
  """(prompt, seed) of request rid: the same on every rank."""
  prompt = [1] if rid >= _CHECK_RID0 else [(7 * rid + 1) % vocab]
  return prompt, _SEED.value * 1_000_003 + rid


# -- time --------------------------------------------------------------------


class _Stopwatch:
  """Named phases of the wall time; a phase nested in another is not
  counted twice (the outer one gets only its own, exclusive time)."""

  def __init__(self, start):
    self.start = start
    self.end = None
    self.seconds = {}
    self._open = []      # [name, start, seconds of nested phases]

  @contextlib.contextmanager
  def phase(self, name):
    frame = [name, time.perf_counter(), 0.0]
    self._open.append(frame)
    try:
      yield
    finally:
      self._open.pop()
      elapsed = time.perf_counter() - frame[1]
      self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - frame[2]
      if self._open:
        self._open[-1][2] += elapsed

  def timed(self, name, fn, block=lambda out: out):
    """fn, with its calls (until `block` returns) counted in phase `name`."""
    def call(*args, **kwargs):
      with self.phase(name):
        return block(fn(*args, **kwargs))
    return call

  def stop(self):
    self.end = time.perf_counter()

  @property
  def wall(self):
    return (self.end or time.perf_counter()) - self.start


# -- child processes ---------------------------------------------------------


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
  # The child asks to die with this process (`cli.exit_with_parent`): no
  # preexec_fn, which would fork this multi-threaded process.
  env[cli.PARENT_ENV] = str(os.getpid())
  return env


def _tail(path, lines=6):
  """The last lines of a child's log, for an error message."""
  try:
    with open(path, errors="replace") as f:
      text = f.read().strip().splitlines()
  except OSError:
    return "(no output)"
  return "\n".join(text[-lines:]) or "(no output)"


class _ChildFailed(Exception):
  """A child process failed; the message carries its own error text."""


def _verifier_ranks():
  return 2 if _MULTIPROCESS.value else _VERIFIER_RANKS.value


def _link_address(tmp, rank):
  """Where worker rank `rank` binds: a free port (rank 0: any) or a path."""
  if _TRANSPORT.value == "ipc":
    return f"ipc://{tmp}/pp1-worker{rank or ''}.sock"
  return f"tcp://127.0.0.1:{_free_port() if rank else 0}"


class _Worker:
  """One worker process: started, awaited, stopped; its stderr in a log."""

  def __init__(self, config, tmp, on_death, address=None, rank=0,
               coordinator=""):
    self.log = os.path.join(tmp, f"worker{rank or ''}.log")
    address = address or _link_address(tmp, 0)
    env = _child_env()
    env["JAX_PLATFORMS"] = "cpu"   # the worker's draft runs on the host CPU
    ranked = ([f"--rank={rank}", f"--coordinator={coordinator}"]
              if config.worker_ranks > 1 else [])
    with open(self.log, "a") as log:
      self.proc = subprocess.Popen(
          [sys.executable, "-m", "experiments.bridge_worker",
           f"--address={address}", *ranked, *config.to_flags()], cwd=_ROOT,
          env=env,
          stdout=subprocess.PIPE, stderr=log, text=True)
    self.address = None
    # A worker that dies while this process compiles ends the run at once.
    _watch(self.proc, self.log, f"worker rank {rank}" if ranked else
           "worker", on_death)

  def wait_ready(self, timeout_s=_READY_TIMEOUT_S):
    """Blocks until the worker prints READY; _ChildFailed if it dies."""
    self.proc.watched = False       # from here on, this wait sees it
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
      ready, _, _ = select.select([self.proc.stdout], [], [], left)
      if not ready:
        break
      line = self.proc.stdout.readline()
      if line.startswith("READY "):
        self.address = line.split()[1]
        return self.address
      if not line:         # end of output: the worker exited
        self.proc.wait()
        raise _ChildFailed(f"the worker exited with status "
                           f"{self.proc.returncode} before it was ready:\n"
                           f"{_tail(self.log)}")
    self.proc.kill()
    raise _ChildFailed(f"the worker was not ready after {timeout_s} s:\n"
                       f"{_tail(self.log)}")

  def kill(self):
    self.proc.kill()
    self.proc.wait()

  def stop(self):
    """Stops the worker; returns its STATS counters ({} if none)."""
    self.proc.terminate()
    try:
      out, _ = self.proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      out, _ = self.proc.communicate()
    for line in (out or "").splitlines():
      if line.startswith("STATS "):
        return json.loads(line[6:])
    return {}


class _WorkerGroup:
  """The worker's ranks (one process, or --worker_ranks of them with a
  jax.distributed coordinator of their own), started and stopped together;
  `addresses[s]` is where rank s binds (rank 0: the session's link)."""

  def __init__(self, config, tmp, on_death, addresses):
    coordinator = (f"127.0.0.1:{_free_port()}" if config.worker_ranks > 1
                   else "")
    self.addresses = list(addresses)
    self.ranks = [_Worker(config, tmp, on_death, a, s, coordinator)
                  for s, a in enumerate(self.addresses)]
    self.stats = []

  def wait_ready(self):
    """The leader's address, once every rank printed READY."""
    ready = [w.wait_ready() for w in self.ranks]
    self.addresses = ready[:1] + self.addresses[1:]
    return ready[0]

  def kill(self, rank=None):
    for w in self.ranks if rank is None else [self.ranks[rank]]:
      if w.proc.poll() is None:
        w.kill()

  def stop(self):
    """Stops every rank (the leader first: it tells the others); returns
    the leader's STATS counters and keeps every rank's in `stats`."""
    self.stats = [w.stop() for w in self.ranks]
    return self.stats[0]


def _watch(proc, log, name, on_death):
  """Ends this program with the child's error if it dies during start-up.

  Start-up waits (the collective rendezvous of --multiprocess) cannot see
  a dead peer and cannot be interrupted; this thread can see it, and then
  runs `on_death` and exits. It stops watching once `proc.watched` is set
  to False.
  """
  proc.watched = True

  def watch():
    while proc.watched and proc.poll() is None:
      time.sleep(0.2)
    if proc.watched and proc.returncode:
      sys.stderr.write(f"\n{cli.program()}: the {name} exited with status "
                       f"{proc.returncode}:\n{_tail(log)}\n")
      sys.stderr.flush()
      on_death()
      os._exit(1)   # pylint: disable=protected-access
  threading.Thread(target=watch, daemon=True).start()


@contextlib.contextmanager
def _stdout_to_devnull():
  """Silences native code that prints to stdout (gloo's "[Gloo] Rank 0 is
  connected to 1 peer ranks" when the collective group forms)."""
  sys.stdout.flush()
  saved = os.dup(1)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  try:
    yield
  finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)
    os.close(devnull)


# -- JAX and the verifier ----------------------------------------------------


def _setup_jax(ranks, rank, coordinator):
  import jax  # pylint: disable=g-import-not-at-top
  if ranks > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(coordinator, num_processes=ranks,
                               process_id=rank, initialization_timeout=120)
  elif jax.device_count() < _DEVICES.value:
    backend = jax.default_backend()
    cli.usage_error(
        f"--verifier_devices={_DEVICES.value} needs that many devices; "
        f"{backend} has {jax.device_count()}. "
        + ("Give XLA_FLAGS=--xla_force_host_platform_device_count=N a "
           "count >= the flag, or leave XLA_FLAGS without one (the pipeline "
           "then sets it)" if backend == "cpu" else
           f"Pass --verifier_devices={jax.device_count()}, or run the "
           "verifier on emulated CPU devices with JAX_PLATFORMS=cpu"))
  return jax


def _build_verifier(jax: typing.Any, config: pipeline_config.PipelineConfig,
                    address: str | None,
                    sharer: typing.Any,
                    watch: _Stopwatch) -> typing.Any:
  """A Verifier over a vocabulary mesh with the toy target, compiled.

  Every function the rounds call is traced and compiled here, before the
  first round (and on every rank, in the same order: the sharded ones are
  collectives), so that compilation is a phase of its own.
  """
  # pylint: disable=g-import-not-at-top
  import functools
  import jax.numpy as jnp
  import numpy as np
  import dyadic_jax as dj
  from dyadic_jax import bridge
  from dyadic_jax import models
  from dyadic_jax.testing import toy_models
  import sharding
  from dyadic_jax.bridge import rank_links
  # pylint: enable=g-import-not-at-top

  caps = config.capabilities()
  ranked = _verifier_ranks() > 1
  devices = jax.devices() if ranked else jax.devices()[:_DEVICES.value]
  groups = _REQUEST_GROUPS.value
  mesh = sharding.make_mesh(requests=groups, vocab=len(devices) // groups,
                            devices=devices)
  target: models.TargetModel
  target, _ = toy_models.make_models(_model_config(config))
  verify = functools.partial(sharding.verify_batch, mesh=mesh)
  sample = functools.partial(sharding.sample_target, mesh=mesh)
  if _MUTANT.value == "uniform_q":
    verify = functools.partial(_uniform_q_verify, verify, caps)
  block = jax.block_until_ready

  executor = sharding.executor(mesh)
  assemble = functools.partial(sharding.from_blocks, mesh=mesh)

  _say("compile: the verifier's programs (target rows, verification, "
       "the target-only fallback)")
  with watch.phase("compile"):
    d = config.depth
    prefix = np.asarray(_request_spec(0, config.vocab)[0], np.int32)
    draft = np.zeros(d, np.int32)
    logits = target.logits(prefix, draft)
    target.logits(prefix, draft[:0])           # the fallback's single row
    # A valid q of the run's shapes, from the session's q format.
    q = caps.format.example_q(d, config.vocab, config.k)
    if config.rank_links:
      # As the rounds hold q: each rank's block of every request's rows.
      lo, hi = caps.link(_RANK.value).shard_range
      blocks = np.zeros((caps.max_requests, d, caps.width), np.int32)
      blocks[..., :hi - lo] = q.counts[:, lo:hi]
      q = dj.DenseQ(assemble(blocks))
      r = caps.max_requests
      block(dj.qcheck.check_dense(
          assemble(np.zeros((r, d, caps.width), np.float32)),
          np.zeros((r, d), np.int32), np.zeros((r, d), np.uint32),
          vocab=config.vocab, executor=executor))
    key = dj.round_key(0, 0, 0)
    batch = lambda x: jnp.stack([x] * caps.max_requests)
    block(verify(batch(logits), q if config.rank_links else jax.tree.map(
        batch, q), batch(draft), batch(key),
                 np.full(caps.max_requests, len(prefix))))
    block(sample(logits[0], key))

  _say("compile: done")
  # A follower rank never talks to the worker's session: it holds no
  # session keys (its rank link is opened with its own, `_follower`).
  secret, curve = ((None, None) if _RANK.value else
                   config.link_keys("verifier"))
  validator = None
  hooks: list[typing.Any] = [_RoundHook(watch)]
  if config.rank_links and not _RANK.value:
    # The leader's agreement with the other ranks: validator, plan sharer
    # and the first round hook.
    validator = sharer = rank_links.RankRound(
        caps, executor=executor, assemble=assemble, broadcast=sharer)
    hooks.insert(0, validator)     # the other ranks learn the round first
  return bridge.Verifier(
      caps, address, validator=validator, hooks=hooks,
      target_fn=watch.timed("verification", target.logits, block),
      verify_fn=watch.timed("verification", verify, block),
      sample_fn=watch.timed("verification", sample, block),
      timeout_s=_TIMEOUT.value, deadline=_deadline(), sharer=sharer,
      secret=secret,
      curve=curve, sampling_audit=not _NO_AUDIT.value,
      request_factory=lambda rid: _request_spec(rid, caps.vocab))


class _RoundHook:
  """The run's round hook (`bridge.RoundHook`): every exchange (STEP out
  to replies validated: the draft + the bridge) is timed as "exchange";
  `on_begin(exchange)`, when set, runs once a round's STEP is made (the
  --kill_worker_at drill)."""

  def __init__(self, watch):
    self.watch = watch
    self.on_begin = None

  def begin(self, exchange):
    if exchange is not None and self.on_begin is not None:
      self.on_begin(exchange)

  def exchange(self):
    return self.watch.phase("exchange")


def _model_config(config):
  return config.model_config(repetition_penalty=_PENALTY.value,
                             grammar_modulus=_GRAMMAR.value)


def _uniform_q_verify(verify, caps, logits, q, draft, keys, anchors):
  """The mutant: verifies against a uniform q, not the sampled one."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dyadic_jax as dj  # pylint: disable=g-import-not-at-top
  del q
  v, (requests, depth) = caps.vocab, np.shape(draft)
  counts = np.full((requests, depth, v), dj.M // v, np.int32)
  counts[..., :dj.M - (dj.M // v) * v] += 1
  return verify(logits, dj.DenseQ(counts), draft, keys, anchors)


# -- rounds ------------------------------------------------------------------


class _Progress:
  """A progress bar on stderr that log records do not break.

  On a terminal it redraws one line; a log record first ends that line,
  so the record starts on a line of its own. Elsewhere (a pipe, a CI log)
  it prints a line at every tenth of the way instead of redrawing.
  """

  def __init__(self, total, label):
    self.total, self.label = max(total, 1), label
    self.start = time.perf_counter()
    self.tty = sys.stderr.isatty()
    self.drawn = False          # a partial bar line is on the terminal
    self.step = -1
    self.handlers = [h for h in logging.getLogger().handlers]
    for h in self.handlers:
      h.addFilter(self._before_record)

  def _before_record(self, record):
    del record
    if self.drawn:
      sys.stderr.write("\n")
      self.drawn = False
    return True

  def update(self, done, extra=""):
    frac = min(done / self.total, 1.0)
    filled = int(30 * frac)
    text = (f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] "
            f"{done}/{self.total} {time.perf_counter() - self.start:5.1f}s "
            f"{extra}")
    if self.tty:
      sys.stderr.write(f"\r{text}   ")
      self.drawn = True
    elif int(10 * frac) > self.step:
      self.step = int(10 * frac)
      sys.stderr.write(text.rstrip() + "\n")
    sys.stderr.flush()

  def close(self):
    if self.drawn:
      sys.stderr.write("\n")
      self.drawn = False
    for h in self.handlers:
      h.removeFilter(self._before_record)


class _Run(typing.NamedTuple):
  """What the rounds produced."""
  results: list              # RoundResult of every request-round
  rounds: int                # verifier rounds (batches)
  outputs: dict              # rid -> its new tokens (--tokens of them, or
                             # the check's first token)


def _generate(verifier, caps, progress, drill=None):
  """Rounds until every request has --tokens new tokens.

  A request leaves the batch as soon as it has them. `drill(rounds, live)`
  may run rounds of its own (the --kill_worker_at fault drill).
  """
  rids = list(range(caps.max_requests))
  for rid in rids:
    verifier.add_request(rid, *_request_spec(rid, caps.vocab))
  start = {rid: len(verifier.requests[rid].tokens) for rid in rids}
  new = lambda r: len(verifier.requests[r].tokens) - start[r]
  results, rounds = [], 0
  live = rids
  while live:
    results += verifier.round(live)
    rounds += 1
    live = [r for r in live if new(r) < _TOKENS.value]
    if drill and (lost := drill(rounds, live)):
      results += lost
      rounds += 1
      live = [r for r in live if new(r) < _TOKENS.value]
    progress.update(sum(min(new(r), _TOKENS.value) for r in rids),
                    f"fallbacks {verifier.counters.events('fallbacks')}")
  progress.close()
  outputs = {rid: verifier.requests[rid].tokens[start[rid]:][:_TOKENS.value]
             for rid in rids}
  return _Run(results, rounds, outputs)


def _check(verifier, caps, progress):
  """First committed token of many fresh requests, one round each."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  r = caps.max_requests
  n = _CHECK_SAMPLES.value - _CHECK_SAMPLES.value % r
  first, results = [], []
  rounds = 0
  for start in range(0, n, r):
    rids = list(range(_CHECK_RID0 + start, _CHECK_RID0 + start + r))
    for rid in rids:     # one fixed prompt, a fresh seed per request
      verifier.add_request(rid, *_request_spec(rid, caps.vocab))
    out = verifier.round(rids)
    rounds += 1
    results += out
    first += [res.committed[0] for res in out]
    progress.update(start + r)
  progress.close()
  outputs = {res.rid: list(res.committed[:1]) for res in results}
  return np.asarray(first), _Run(results, rounds, outputs)


def _distribution_check(first, config):
  """Goodness of fit to the exact P/T and a two-sample test vs target-only."""
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np
  import dyadic_jax as dj
  from dyadic_jax.testing import stats
  from dyadic_jax.testing import toy_models
  # pylint: enable=g-import-not-at-top

  target, _ = toy_models.make_models(_model_config(config))
  row = target.row(np.asarray(_request_spec(_CHECK_RID0, config.vocab)[0],
                              np.int32))
  probs, _ = dj.target_probs(row)
  p_fixed, total = dj.quantize_target(probs)
  expected = np.asarray(p_fixed, np.float64) / int(total)
  # Target-only samples with keys of their own (a domain of the check).
  keys = jax.vmap(lambda i: dj.draw_key(dj.round_key(_SEED.value, 1 << 20, i),
                                        0, dj.Domain.TARGET_ONLY))(
                                            np.arange(len(first)))
  target_only, _ = jax.vmap(dj.sample_target, in_axes=(None, 0))(row, keys)
  target_only = np.asarray(target_only)
  v = config.vocab
  spec = np.bincount(first, minlength=v)
  ref = np.bincount(target_only, minlength=v)
  # Bins with expected count < 5 pooled into one, for both samples alike.
  e, s_obs, r_obs = stats.pool_small(expected * len(first), spec, ref)
  gof, _, gof_p = stats.goodness_of_fit(s_obs, e / e.sum())
  two, _, two_p = stats.two_sample(s_obs, r_obs)
  passed = gof_p >= _ALPHA.value and two_p >= _ALPHA.value
  return {"samples": int(len(first)), "alpha": _ALPHA.value,
          "bins": int(len(e)), "statistic": gof, "p_value": gof_p,
          "two_sample_statistic": two, "two_sample_p_value": two_p,
          "verdict": "pass" if passed else "fail",
          "expected": expected.tolist(), "speculative": spec.tolist(),
          "target_only": ref.tolist()}


# -- the record --------------------------------------------------------------


def _time_split(watch, worker_stats):
  """{phase: seconds} that adds up to the wall time (see the docstring)."""
  s = dict(watch.seconds)
  exchange = s.pop("exchange", 0.0)
  # The worker's own time drawing proposals, inside the exchanges (a
  # worker killed by the drill takes its figure with it: bridge gets it).
  draft = min(worker_stats.get("events", {}).get("propose_us", 0) / 1e6,
              exchange)
  split = {}
  for name in ("start-up", "compile", "worker start-up"):
    split[name] = s.pop(name, 0.0)
  split.update({"draft": draft, "bridge": exchange - draft,
                "verification": s.pop("verification", 0.0),
                "host": s.pop("rounds", 0.0)})
  split.update(s)      # worker restart, distribution check, shutdown
  split["other"] = watch.wall - sum(split.values())
  return split


def _link_figures(verifier, request_rounds, tmp, ranks):
  """Per link into the verifier (the session's; with rank links one per
  rank): bytes in per request-round and per round, and the time from a
  round's start to its last frame in (or the deadline), the session's from
  the verifier, the other ranks' from their --stats_out files."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rounds = max(len(verifier.seconds), 1)
  links = [{"rank": 0, "bytes_in": verifier.counters.events("bytes_in"),
            "request_rounds": request_rounds,
            "round_seconds": list(verifier.seconds),
            "deadline_s": (verifier.deadline.figures() if verifier.deadline
                           else None)}]
  for rank in range(1, ranks):
    try:
      with open(os.path.join(tmp, f"rank{rank}.json")) as f:
        links.append(json.load(f))
    except (OSError, ValueError):
      links.append({"rank": rank, "bytes_in": 0, "request_rounds": 0,
                    "round_seconds": []})
  # What every rank committed: a follower's requests, token for token.
  mine = {str(rid): list(req.tokens)
          for rid, req in verifier.requests.items()}
  agree = all(link.get("committed") == mine for link in links[1:])
  out = []
  for link in links:
    t = np.asarray(link["round_seconds"] or [0.0])
    out.append({"rank": link["rank"],
                "bytes_per_request_round": link["bytes_in"] / max(
                    link["request_rounds"], 1),
                "bytes_per_round": link["bytes_in"] / rounds,
                "round_ms_p50": float(np.median(t) * 1e3),
                "round_ms_mean": float(t.mean() * 1e3),
                "rounds": len(link["round_seconds"]),
                "deadline_s": link.get("deadline_s"),
                "errors": link.get("counters", {}).get("errors", {})})
  return out, agree


def _deadline_range(figures):
  """One AdaptiveDeadline.figures() for every link's: the range of the
  deadlines they used (None if none had one)."""
  figures = [f for f in figures if f and f["min_s"] is not None]
  if not figures:
    return None
  return dict(figures[0], min_s=min(f["min_s"] for f in figures),
              max_s=max(f["max_s"] for f in figures))


def _summarize(run, verifier, config, worker_stats, proxy, watch, check,
               links, agree):
  """The JSON record of a run."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  caps = verifier.caps
  results = run.results
  verified = [r for r in results if not r.fallback]
  depth = caps.max_depth
  acc = np.array([r.accepted for r in verified], np.int64)
  by_pos = [float(np.mean(acc[acc >= i] > i)) if np.any(acc >= i)
            else None for i in range(depth)]
  counters = verifier.counters.snapshot()
  generated = int(sum(len(r.committed) for r in results))
  kept = int(sum(len(t) for t in run.outputs.values()))
  batches = max(run.rounds, 1)
  # The seed's size table: q bytes per request and round (exact arithmetic).
  seed_q = caps.format.seed_bytes(depth, caps.vocab, config.k)
  bytes_in = verifier.counters.events("bytes_in")
  bytes_out = verifier.counters.events("bytes_out")
  record = {
      "config": {"vocab": caps.vocab, "requests": caps.max_requests,
                 "depth": depth, "q": config.q, "k": caps.max_support,
                 "tokens": _TOKENS.value,
                 "multiprocess": _verifier_ranks() > 1,
                 "verifier_ranks": _verifier_ranks(),
                 "worker_ranks": config.worker_ranks,
                 "rank_links": config.rank_links,
                 "verifier_mesh": ({"requests": 1, "vocab": _verifier_ranks()}
                                   if _verifier_ranks() > 1 else
                                   {"requests": _REQUEST_GROUPS.value,
                                    "vocab": _DEVICES.value
                                    // _REQUEST_GROUPS.value}),
                 "inject_faults": _FAULTS.value, "seed": _SEED.value,
                 "mutant": _MUTANT.value,
                 "kill_worker_at": _KILL_AT.value,
                 "authentication": ("none (--insecure)" if config.insecure
                                    else "keyed BLAKE3"),
                 "encrypt": config.encrypt,
                 "sampling_audit": not _NO_AUDIT.value,
                 "worker_bug": config.worker_bug},
      # Generation: requests x --tokens exactly; the check: one per request.
      "tokens": kept,
      "tokens_dropped": generated - kept,
      "tokens_generated": generated,
      "rounds": run.rounds,
      "request_rounds": len(results),
      "fallback_rounds": len(results) - len(verified),
      "mean_accepted": float(acc.mean()) if acc.size else 0.0,
      "tokens_per_round": generated / len(results) if results else 0.0,
      "acceptance_by_position": by_pos,
      # Per request and round: a batch shrinks as its requests finish.
      "bytes_per_request_round": {
          "measured_in": bytes_in / max(len(results), 1),
          "measured_out": bytes_out / max(len(results), 1),
          "seed_estimate_q": seed_q},
      "bytes_per_round": {"measured_in": bytes_in / batches,
                          "measured_out": bytes_out / batches},
      "errors": counters["errors"],
      # Why each fallback fell back (TIMEOUT: the answer came after the
      # deadline; the other codes: what was wrong with it).
      "fallbacks_by_code": dict(collections.Counter(
          getattr(r.code, "name", str(r.code)) for r in results
          if r.fallback)),
      "deadline_s": _deadline_range([x["deadline_s"] for x in links]),
      "events": counters["events"],
      "worker": worker_stats,
      "faults": ({f"{d}/{k}": n for (d, k), n in proxy.counts().items()}
                 if proxy else {}),
      "time_s": {"wall": watch.wall, "split": _time_split(watch,
                                                          worker_stats)},
  }
  record["outputs"] = {str(r): t for r, t in run.outputs.items()}
  # Every committed token of every request, in order (past --tokens too).
  record["committed"] = {
      str(r): list(verifier.requests[r].tokens[len(_request_spec(
          r, caps.vocab)[0]):]) for r in run.outputs if r in verifier.requests}
  record["bytes_per_link"] = {str(x["rank"]): x["bytes_per_request_round"]
                              for x in links}
  record["links"] = links
  if config.rank_links:
    # Every verifier rank committed exactly what the leader did.
    record["ranks_committed_identical"] = agree
  record["generated_by_request"] = {
      str(r): sum(len(x.committed) for x in results if x.rid == r)
      for r in run.outputs}
  if check is not None:
    record["distribution_check"] = check
  return record


def _print_summary(record):
  """The summary table (stdout)."""
  from dyadic_jax.testing import stats  # pylint: disable=g-import-not-at-top
  c = record["config"]
  print(f"\nPP1 pipeline: V={c['vocab']} requests={c['requests']} "
        f"depth={c['depth']} q={c['q']}"
        + (f" k={c['k']}" if _Q[c["q"]].uses_support else "")
        + (f" verifier ranks {c['verifier_ranks']}" if c["multiprocess"]
           else "")
        + (f" worker ranks {c['worker_ranks']}" if c["worker_ranks"] > 1
           else "")
        + (" (rank-to-rank q links)" if c["rank_links"] else "")
        + (f" verifier mesh {c['verifier_mesh']['requests']}x"
           f"{c['verifier_mesh']['vocab']}"
           if c["verifier_mesh"]["requests"] > 1 else "")
        + (f" faults={c['inject_faults']}" if c["inject_faults"] else ""))
  check = record.get("distribution_check")
  if check:
    new = (f"{record['tokens']} = {len(record['outputs'])} requests x 1 "
           f"(the check uses each one's first token; "
           f"+{record['tokens_dropped']} more committed)")
  else:
    new = (f"{record['tokens']} = {c['requests']} requests x {c['tokens']}"
           + (f" (+{record['tokens_dropped']} past --tokens in final "
              "rounds, dropped)" if record["tokens_dropped"] else ""))
  rows = [("new tokens", new),
          ("rounds (batches)", record["rounds"]),
          ("request-rounds / fallbacks",
           f"{record['request_rounds']} / {record['fallback_rounds']}"
           + (" (" + ", ".join(f"{k} {n}" for k, n in sorted(
               record["fallbacks_by_code"].items())) + ")"
              if record["fallbacks_by_code"] else "")),
          ("mean accepted drafts", f"{record['mean_accepted']:.3f}"),
          ("tokens per request-round", f"{record['tokens_per_round']:.3f}")]
  for name, value in rows:
    print(f"  {name:<28} {value}")
  for link in record["links"]:
    name = (f"rank link {link['rank']}" if c["rank_links"] else
            "link (exchange)")
    print(f"  {name:<28} "
          f"{link['bytes_per_request_round']:,.0f} B per request-round, "
          f"p50 {link['round_ms_p50']:.1f} ms per round"
          + (f", refused {link['errors']}" if link["errors"] else ""))
  print("  acceptance by position       " + "  ".join(
      "-" if a is None else f"{a:.3f}"
      for a in record["acceptance_by_position"]))
  b = record["bytes_per_request_round"]
  print(f"  bytes per request-round      in {b['measured_in']:,.0f}  out "
        f"{b['measured_out']:,.0f}  (seed estimate of q alone: "
        f"{b['seed_estimate_q']:,})")
  t = record["time_s"]
  parts = [f"{name} {s:.2f}" for name, s in t["split"].items()]
  print(f"  time split (s)               wall {t['wall']:.2f} = "
        + " + ".join(parts[:4]))
  for i in range(4, len(parts), 4):
    print(" " * 31 + "+ " + " + ".join(parts[i:i + 4]))
  print(f"  bridge link                  {c['authentication']}"
        + (", CURVE encrypted" if c["encrypt"] else "")
        + ("" if c["sampling_audit"] else ", sampling audit OFF")
        + (f", worker bug {c['worker_bug']}" if c["worker_bug"] != "none"
           else ""))
  if c["authentication"].startswith("none"):
    print("  " + pipeline_config.INSECURE_WARNING)
  print(f"  errors                       {record['errors'] or 'none'}")
  timeouts = record["fallbacks_by_code"].get("TIMEOUT", 0)
  deadline = record["deadline_s"]
  if timeouts and deadline:
    # Say what a TIMEOUT is: not a bad q, an answer later than the deadline.
    late = record["errors"].get("STALE_GENERATION", 0)
    lo, hi = deadline["min_s"], deadline["max_s"]
    used = f"{lo:.2f}" if lo == hi else f"{lo:.2f}-{hi:.2f}"
    print(f"  timeouts                     {timeouts} of the fallbacks: no "
          f"answer within the deadline ({used} s; --timeout_max "
          f"{deadline['ceiling_s']:g}), not a refused q"
          + (f"; {late} late answer{'s' * (late != 1)} refused as "
             "STALE_GENERATION" if late else "")
          + ("" if record["faults"] or c["kill_worker_at"] else
             " (a loaded machine, or a worker that died)"))
  if record["faults"]:
    print(f"  injected faults              {record['faults']}")
  if check:
    print(f"\nDistribution check: first committed token of "
          f"{check['samples']} fresh requests vs the target's exact P/T")
    print(f"  {'token':>6} {'P/T':>8} {'spec':>6} {'target-only':>11}")
    for v, (e, s, r) in enumerate(zip(check["expected"], check["speculative"],
                                      check["target_only"])):
      if e * check["samples"] >= 1 or s or r:
        print(f"  {v:>6} {e:8.4f} {s:6d} {r:11d}")
    print(f"  goodness of fit: chi2={check['statistic']:.2f} "
          f"bins={check['bins']} p={stats.format_p(check['p_value'])}; "
          f"two-sample: chi2={check['two_sample_statistic']:.2f} "
          f"p={stats.format_p(check['two_sample_p_value'])} -> "
          f"{check['verdict'].upper()} at alpha={check['alpha']:g}")


def _plot(record, path):
  """Acceptance by position, the time split and the check (a PNG)."""
  # Matplotlib logs "building the font cache" once per fresh install.
  logging.getLogger("matplotlib").setLevel(logging.ERROR)
  # pylint: disable=g-import-not-at-top
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from dyadic_jax.testing import stats
  # pylint: enable=g-import-not-at-top
  check = record.get("distribution_check")
  fig, axes = plt.subplots(1, 3 if check else 2, figsize=(
      16 if check else 11, 4.5))
  acc = [a or 0.0 for a in record["acceptance_by_position"]]
  axes[0].bar(range(1, len(acc) + 1), acc, color="tab:blue")
  axes[0].set(title="acceptance by draft position", xlabel="position i",
              ylabel="P(accept x_i | x_1..x_{i-1} accepted)", ylim=(0, 1))
  t = record["time_s"]
  names = list(t["split"])
  axes[1].bar(names, [t["split"][n] for n in names], color="tab:orange")
  axes[1].set(title=f"time split: bars add up to the wall time "
              f"({t['wall']:.1f} s)", ylabel="s")
  plt.setp(axes[1].get_xticklabels(), rotation=35, ha="right")
  if check:
    v = range(len(check["expected"]))
    n = check["samples"]
    axes[2].bar([x - 0.2 for x in v], [s / n for s in check["speculative"]],
                0.4, label="speculative")
    axes[2].bar([x + 0.2 for x in v], [s / n for s in check["target_only"]],
                0.4, label="target-only")
    axes[2].plot(list(v), check["expected"], "k.", label="exact P/T")
    axes[2].set(title=f"first token, p={stats.format_p(check['p_value'])} "
                f"({check['verdict']})", xlabel="token")
    axes[2].legend()
  c = record["config"]
  fig.suptitle(f"PP1 pipeline: V={c['vocab']}, {c['requests']} requests, "
               f"D={c['depth']}, q={c['q']}, mean accepted "
               f"{record['mean_accepted']:.2f}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# -- main --------------------------------------------------------------------


def _quiet_jax_logs():
  # absl shows INFO records; JAX logs its backend probe ("Unable to
  # initialize backend 'tpu'") and the distributed service at INFO.
  logging.getLogger("jax").setLevel(logging.WARNING)


def _follower():
  """A verifier rank s >= 1: runs the leader's plans. With rank links it
  receives block s of q on its own link first and takes part in the
  agreement; otherwise it never touches a transport."""
  config = _config()
  jax = _setup_jax(_verifier_ranks(), _RANK.value, _COORDINATOR.value)
  # pylint: disable=g-import-not-at-top
  import functools
  from dyadic_jax.bridge import rank_links, ranks
  import sharding
  # pylint: enable=g-import-not-at-top
  caps = config.capabilities()
  share = ranks.plan_broadcast(caps, counts=not config.rank_links)
  verifier = _build_verifier(jax, config, None, share,
                             _Stopwatch(time.perf_counter()))
  if not config.rank_links:
    verifier.follow()
    jax.distributed.shutdown()
    return
  secret, curve = config.link_keys("verifier")
  receiver = rank_links.ShardReceiver(
      caps.link(_RANK.value), _SHARD_ADDRESS.value, secret=secret,
      timeout_s=_TIMEOUT.value, deadline=_deadline(), curve=curve)
  # The worker rank may still be starting (JAX import, one compile).
  receiver.open(attempts=max(1, int(_READY_TIMEOUT_S / _TIMEOUT.value)))
  mesh = sharding.make_mesh(vocab=_verifier_ranks(), devices=jax.devices())
  rounds = rank_links.follow_rounds(
      verifier, receiver, sharding.executor(mesh),
      functools.partial(sharding.from_blocks, mesh=mesh))
  if _STATS_OUT.value:
    with open(_STATS_OUT.value, "w") as f:
      json.dump({"rank": _RANK.value, "rounds": rounds,
                 **receiver.figures(),
                 "deadline_s": receiver.deadline.figures(),
                 "counters": receiver.counters.snapshot(),
                 "committed": {str(rid): list(req.tokens)
                               for rid, req in verifier.requests.items()}},
                f)
  receiver.close()
  jax.distributed.shutdown()


def main(argv: list[str]) -> int | None:
  del argv
  cli.exit_with_parent()     # a follower rank: never outlives the leader
  _quiet_jax_logs()
  if _RANK.value:
    return _follower()
  with tempfile.TemporaryDirectory(prefix="pp1-") as tmp:
    try:
      return _lead(tmp)
    except _ChildFailed as e:
      sys.stderr.write(f"{cli.program()}: {e}\n")
      return 1


def _lead(tmp):
  """The leader rank: the whole run, its record and its outputs."""
  watch = _Stopwatch(_START)
  with watch.phase("start-up"):   # importing the bridge imports JAX
    config = _config()
    _say(f"start-up: V={config.vocab} q={config.q} requests="
         f"{config.requests} depth={config.depth}; starting the worker "
         f"({config.worker_ranks} process{'es' * (config.worker_ranks > 1)}"
         f"), JAX and the verifier")
    if config.insecure:
      print(pipeline_config.INSECURE_WARNING, file=sys.stderr, flush=True)
    elif config.keys_dir is None:
      # One command stays one command: a throwaway key set, removed with tmp.
      from dyadic_jax.bridge import keys  # pylint: disable=g-import-not-at-top
      config = dataclasses.replace(config, keys_dir=str(keys.make(
          os.path.join(tmp, "keys"))))
  multiprocess = _verifier_ranks() > 1
  workers, followers, proxy, jax = [], [], None, None
  try:
    with watch.phase("start-up"):
      if not multiprocess and "force_host_platform_device_count" not in (
          os.environ.get("XLA_FLAGS", "")):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count="
                                   f"{_DEVICES.value}").strip()
      # The worker starts (and compiles) while this process does the same.
      on_death = lambda: _cleanup(workers, tmp)
      workers.append(_WorkerGroup(config, tmp, on_death, [
          _link_address(tmp, s) for s in range(config.worker_ranks)]))
      coordinator = f"127.0.0.1:{_free_port()}"
      shard_links = list(workers[0].addresses)
      if _FAULTS.value > 0 and _FAULT_LINK.value:
        # Between verifier rank s and worker rank s (both start later).
        proxy = _proxy(shard_links[_FAULT_LINK.value])
        shard_links[_FAULT_LINK.value] = proxy.address
      for rank in range(1, _verifier_ranks()):
        log = os.path.join(tmp, f"follower{rank}.log")
        link = [f"--shard_address={shard_links[rank]}"
                if config.rank_links else "--shard_address="]
        if config.keys_dir and not flags.FLAGS["keys_dir"].present:
          link.append(f"--keys_dir={config.keys_dir}")   # the throwaway set
        with open(log, "w") as out:
          followers.append(subprocess.Popen(
              [sys.executable, "-m", "experiments.pp1_pipeline",
               f"--rank={rank}", f"--coordinator={coordinator}", *link,
               f"--stats_out={tmp}/rank{rank}.json"] + [
                   a for a in sys.argv[1:] if not a.startswith("--rank")],
              cwd=_ROOT, env=_child_env(), stdout=out,
              stderr=subprocess.STDOUT))
        # A follower that dies would leave the rendezvous waiting.
        _watch(followers[-1], log, f"verifier rank {rank}", on_death)
      if multiprocess:
        _say(f"start-up: {_verifier_ranks()} verifier ranks joining "
             "(jax.distributed, gloo)")
      # gloo prints "[Gloo] Rank 0 is connected ..." on stdout.
      with (_stdout_to_devnull() if multiprocess
            else contextlib.nullcontext()):
        jax = _setup_jax(_verifier_ranks(), 0, coordinator)
        _say(f"start-up: JAX on {jax.default_backend()}, "
             f"{jax.device_count()} device(s); building the verifier")
        caps = config.capabilities()
        share = None
        if multiprocess:
          from dyadic_jax.bridge import ranks  # pylint: disable=g-import-not-at-top
          share = ranks.plan_broadcast(caps, counts=not config.rank_links)
        verifier = _build_verifier(jax, config, None, share, watch)
    with watch.phase("worker start-up"):
      _say("worker start-up: waiting for the worker (its JAX start and "
           "compile, then the HELLO)")
      address = workers[0].wait_ready()
      if _FAULTS.value > 0 and not _FAULT_LINK.value:
        proxy = _proxy(address)
        address = proxy.address
      verifier.address = address
      verifier.open()
      _say(f"worker start-up: session open with the worker at {address}; "
           "rounds")
    check = None
    with watch.phase("rounds"):
      if _CHECK.value:
        first, run = _check(verifier, caps, _Progress(
            _CHECK_SAMPLES.value - _CHECK_SAMPLES.value % caps.max_requests,
            "check"))
      else:
        drill = (_drill(verifier, workers, config, tmp, watch, on_death)
                 if _KILL_AT.value else None)
        run = _generate(verifier, caps, _Progress(
            _TOKENS.value * caps.max_requests, "tokens"), drill)
    if _CHECK.value:
      with watch.phase("distribution check"):
        check = _distribution_check(first, config)
    with watch.phase("shutdown"):
      verifier.stop_followers()
      verifier.close()
  finally:
    with watch.phase("shutdown"):
      worker_stats = workers[-1].stop() if workers else {}
      if proxy:
        proxy.stop()
      for follower in followers:
        follower.watched = False
      if followers and jax is not None:
        # A barrier with the followers' own shutdown: before the wait.
        jax.distributed.shutdown()
      for follower in followers:
        try:
          follower.wait(timeout=120)
        except subprocess.TimeoutExpired:
          follower.kill()
  watch.stop()
  links, agree = _link_figures(verifier, len(run.results), tmp,
                               _verifier_ranks() if config.rank_links else 1)
  record = _summarize(run, verifier, config, worker_stats, proxy, watch,
                      check, links, agree)
  _print_summary(record)
  # An earlier run's outputs are replaced, and the run says so.
  replaced = lambda path: (" (replaced the previous one)"
                           if os.path.exists(path) else "")
  if _JSON_OUT.value:
    note = replaced(_JSON_OUT.value)
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=1)
    print(f"\nwrote {_JSON_OUT.value}{note}")
  if _PLOT_OUT.value:
    note = replaced(_PLOT_OUT.value)
    _plot(record, _PLOT_OUT.value)
    print(f"wrote {_PLOT_OUT.value}{note}")
  if check is not None and check["verdict"] != "pass":
    return 1
  return 0


def _proxy(address):
  """The --inject_faults proxy in front of the worker at `address`."""
  from dyadic_jax.testing import proxy as proxy_lib  # pylint: disable=g-import-not-at-top
  kinds = tuple(_FAULT_KINDS.value) or proxy_lib.KINDS
  floor, ceiling = _TIMEOUT.value, max(_TIMEOUT.value, _TIMEOUT_MAX.value)
  # deadline_s sets its jitter below the deadline's floor; a held reply is
  # never released before the longest deadline could pass.
  return proxy_lib.Proxy("tcp://127.0.0.1:0", address, rate=_FAULTS.value,
                         seed=_SEED.value, deadline_s=floor,
                         hold_max_s=max(10.0, 8 * floor, 2 * ceiling),
                         kinds=kinds).start()


def _cleanup(workers, tmp):
  """Last-resort cleanup before an abrupt exit: no orphan, no /tmp litter."""
  for group in workers:
    group.kill()
  shutil.rmtree(tmp, ignore_errors=True)


def _drill(verifier, workers, config, tmp, watch, on_death):
  """The --kill_worker_at fault drill (a `_generate` hook)."""

  def drill(rounds, live):
    if rounds != _KILL_AT.value or not live:
      return []
    # Its last rank (the whole worker when it has one rank) dies in the
    # middle of the next round: once the round has begun, before its STEP
    # goes out. Then the supervisor restarts the worker: every rank (the
    # survivors' collective group is broken).
    group = workers[-1]
    hook = next(h for h in verifier.hooks if isinstance(h, _RoundHook))
    hook.on_begin = lambda exchange: group.kill(len(group.ranks) - 1)
    try:
      lost = verifier.round(live)
    finally:
      hook.on_begin = None
    logging.info("fault drill: worker rank %d killed; restarting the "
                 "worker (its JAX start and compile)", len(group.ranks) - 1)
    with watch.phase("worker restart"):
      group.kill()
      workers.append(_WorkerGroup(config, tmp, on_death, group.addresses))
      workers[-1].wait_ready()
    logging.info("fault drill: worker restarted")
    return lost
  return drill


if __name__ == "__main__":
  cli.run(main)
