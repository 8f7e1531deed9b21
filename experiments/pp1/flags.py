"""The main job's flags and their cross-flag checks (absl only: cheap).

Importing this module defines every flag of `python -m
experiments.pp1_pipeline` and registers every check, so a bad command line
exits with one line (status 2) when the entry point parses it, before JAX
is imported. The session flags (--q, --k, --depth, --keys_dir ...) are
experiments/pipeline_config.py's, shared with the worker. The helpers at
the end read the parsed flags.
"""

import dataclasses
import functools
import math
import typing

from absl import flags

from experiments import cli
from experiments import pipeline_config

# --help lists the session flags (--q, --k, --depth, --keys_dir ...) too.
flags.adopt_module_key_flags(pipeline_config)

CHECK_RID0 = 1000             # request ids of the distribution check
MAX_RID = 0xFFFE              # wire: 0xFFFF means "every request"
# A request's seed, seed * 1000003 + rid, must fit the keys' int64.
MAX_SEED = ((1 << 63) - 1 - MAX_RID) // 1_000_003

TOKENS = flags.DEFINE_integer(
    "tokens", 48, "New tokens to generate per request (>= 1).",
    lower_bound=1, upper_bound=1_000_000)
PENALTY, GRAMMAR = cli.define_target_processor()
MULTIPROCESS = flags.DEFINE_bool(
    "multiprocess", False, "Verifier as 2 jax.distributed ranks (gloo, one "
    "CPU device each) plus the worker: 3 processes.")
VERIFIER_RANKS = flags.DEFINE_integer(
    "verifier_ranks", 1, f"Verifier as this many jax.distributed ranks "
    f"(1..{pipeline_config.MAX_RANKS}; gloo, one CPU device each, a "
    "vocabulary mesh over them). With --q=dense and --worker_ranks equal to "
    "it, rank s receives block s of q on its own link from worker rank s "
    "(rank-to-rank links); otherwise rank 0 receives q and broadcasts the "
    "round's plan.", lower_bound=1, upper_bound=pipeline_config.MAX_RANKS)
DEVICES = flags.DEFINE_integer(
    "verifier_devices", 2, "Devices of the single-process verifier's mesh, "
    "1..64 (emulated CPU devices when on CPU).", lower_bound=1,
    upper_bound=64)
REQUEST_GROUPS = flags.DEFINE_integer(
    "verifier_requests", 1, "Size of the verifier mesh's \"requests\" axis: "
    "a round's requests split over this many device groups, each group's "
    "vocabulary over --verifier_devices / this many devices; must divide "
    "--verifier_devices.", lower_bound=1, upper_bound=64)
FAULTS = flags.DEFINE_float(
    "inject_faults", 0.0, "Fraction of exchanges a loopback proxy damages, "
    "in [0, 1]. The proxy is an on-path relay without the deployment's "
    "keys, which CURVE admits to neither side: its link runs in the clear "
    "(authenticated, not encrypted).")
FAULT_LINK = flags.DEFINE_integer(
    "fault_link", 0, "With rank links: the rank whose link the "
    "--inject_faults proxy sits on (0: the leader's session link).",
    lower_bound=0, upper_bound=pipeline_config.MAX_RANKS - 1)
FAULT_KINDS = flags.DEFINE_list(
    "fault_kinds", [], "The faults --inject_faults draws from (default: "
    "all of drop, delay, duplicate, reorder, truncate, corrupt, reset).")
SEED = flags.DEFINE_integer(
    "seed", 0, f"Request seeds are seed * 1000003 + request id; seed in [0, "
    f"{MAX_SEED}].", lower_bound=0, upper_bound=MAX_SEED)
TIMEOUT = flags.DEFINE_float(
    "timeout", 2.0, "Floor of the verifier's deadline of one exchange, "
    "seconds, in (0, 3600]: each exchange gets 4x the median time of the "
    "last 32 answered ones (a session's first: at least 4x --timeout), "
    "within [--timeout, --timeout_max], so that a loaded machine does not "
    "time out a healthy run (a fixed deadline: --timeout_max equal to it).")
TIMEOUT_MAX = flags.DEFINE_float(
    "timeout_max", 30.0, "Ceiling of the verifier's deadline of one "
    "exchange, seconds, in (0, 3600] (at least --timeout: the larger of the "
    "two is used): the longest a lost exchange can cost.")
TRANSPORT = flags.DEFINE_enum(
    "transport", "tcp", ["tcp", "ipc"], "The session link: loopback TCP (the "
    "worker binds port 0) or an ipc socket. Rank links are always ipc "
    "sockets in the run's private folder.")
CHECK = flags.DEFINE_bool(
    "check_distribution", False, "Run the distribution check instead of "
    "open-ended generation.")
CHECK_SAMPLES = flags.DEFINE_integer(
    "check_samples", 2000, "Independent first tokens in the check (at "
    "least --requests; rounded down to a multiple of it).", lower_bound=1,
    upper_bound=MAX_RID - CHECK_RID0 - pipeline_config.MAX_REQUESTS)
CHECK_VOCAB = flags.DEFINE_integer(
    "check_vocab", 16, "Vocabulary of the check when --vocab is not given "
    "(small, for power).", lower_bound=2, upper_bound=cli.MAX_VOCAB)
ALPHA = flags.DEFINE_float(
    "alpha", 1e-3, "Significance level of the check, in (0, 1): its "
    "false-failure rate for a correct pipeline.")
MUTANT = flags.DEFINE_enum(
    "mutant", "none", ["none", "uniform_q"], "Deliberately wrong verifier "
    "for the check's power test (needs --check_distribution): uniform_q "
    "verifies against a uniform q instead of the q the draft sampled from.")
NO_AUDIT = flags.DEFINE_bool(
    "no_sampling_audit", False, "Turn the sampling audit off: the verifier "
    "then no longer recomputes each drafted token from its q and the "
    "PROPOSAL key (for the --worker_bug drill).")
JSON_OUT = flags.DEFINE_string(
    "json_out", "pp1_pipeline.json", "Where to write the JSON record ('' "
    "for none); an existing file is replaced, and the run says so.")
PLOT_OUT = flags.DEFINE_string(
    "plot_out", "pp1_pipeline.png", "Where to write the PNG plot ('' for "
    "none); an existing file is replaced, and the run says so.")
KILL_AT = flags.DEFINE_integer(
    "kill_worker_at", 0, "Fault drill: after this many rounds, kill the "
    "worker process (with --worker_ranks, its last rank) in the middle of "
    "the next round (once its STEP is made), then start the worker again "
    "on the same address(es), as a supervisor would (0: never). The "
    "verifier falls back while it is gone and negotiates a new session "
    "with the new process.", lower_bound=0)
IN_FLIGHT = flags.DEFINE_integer(
    "in_flight", 2, "Rounds in flight at once, 1..2: the requests run in "
    "this many groups, the worker drafting one group's round while the "
    "verifier verifies another's (1: one exchange at a time). The tokens "
    "are the same either way.", lower_bound=1, upper_bound=2)
PROMPT_TOKENS = flags.DEFINE_integer(
    "prompt_tokens", 64, "With --model (not the toy): tokens of each "
    "request's prompt, cut from a held-out file of the standard library "
    "(a fixed split by path, experiments/corpus.py).", lower_bound=1,
    upper_bound=1 << 16)
SAMPLES = flags.DEFINE_integer(
    "show_samples", 2, "With --model: requests whose prompt and generated "
    "text the summary prints.", lower_bound=0,
    upper_bound=pipeline_config.MAX_REQUESTS)
# Internal: the follower ranks of --verifier_ranks.
RANK = flags.DEFINE_integer("rank", 0, "Internal: jax.distributed rank.",
                             lower_bound=0,
                             upper_bound=pipeline_config.MAX_RANKS - 1)
SHARD_ADDRESS = flags.DEFINE_string(
    "shard_address", "", "Internal: the rank link a follower rank connects.")
STATS_OUT = flags.DEFINE_string(
    "stats_out", "", "Internal: where a follower rank writes its link's "
    "figures.")
COORDINATOR = flags.DEFINE_string(
    "coordinator", "", "Internal: rank 0's jax.distributed coordinator "
    "(unix:PATH, a socket in the run's private folder).")


def _finite_in(lo: float, hi: float, *,
               open_lo: bool = False) -> typing.Callable[[float], bool]:
  def ok(x: float) -> bool:
    return math.isfinite(x) and (lo < x if open_lo else lo <= x) and x <= hi
  return ok


cli.check("inject_faults", _finite_in(0.0, 1.0),
          "--inject_faults must be a fraction in [0, 1]")
cli.check(["inject_faults", "encrypt"],
          lambda inject_faults, encrypt: not (
              inject_faults > 0 and encrypt and flags.FLAGS["encrypt"].present),
          "--inject_faults excludes --encrypt: its proxy has no keys, and "
          "CURVE admits no keyless relay")
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
cli.check(["kill_worker_at", "tokens"], lambda kill_worker_at, tokens:
          kill_worker_at < tokens or not kill_worker_at,
          "--kill_worker_at must be < --tokens: each round commits at least "
          "one token per request, so a run has at most --tokens rounds and "
          "the drill would never fire")
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
cli.check(["model", "repetition_penalty", "grammar_modulus", "check_vocab",
           "prompt_tokens", "show_samples"],
          lambda model, **_: model != "toy" or not any(
              flags.FLAGS[n].present for n in ("prompt_tokens",
                                               "show_samples")),
          "--prompt_tokens and --show_samples are for a trained pair "
          "(--model=stdlib): the toy's prompts are one token")
cli.check(["model", "repetition_penalty", "grammar_modulus", "check_vocab"],
          lambda model, **_: model == "toy" or not any(
              flags.FLAGS[n].present for n in ("repetition_penalty",
                                               "grammar_modulus",
                                               "check_vocab")),
          "--repetition_penalty, --grammar_modulus and --check_vocab are the "
          "toy pair's (--model=toy); a trained pair's V and rows are its own")


def _context_problem(model: str, prompt_tokens: int, tokens: int, depth: int,
                     check_distribution: bool) -> str | None:
  """The numbers when a trained pair's requests outgrow its context."""
  if model == "toy" or pipeline_config.unusable_model(model):
    return None
  new = 1 if check_distribution else tokens
  need = prompt_tokens + new + depth + 1
  max_len = pipeline_config.model_max_len(model) or 0
  if need <= max_len:
    return None
  # What fits: the prompt at most half the context, the rest generated.
  prompt = min(prompt_tokens, max_len // 2)
  if check_distribution:
    fits = (f"; --prompt_tokens={max_len - depth - 2} fits"
            if max_len - depth - 2 >= 1 else "")
  else:
    fits = (f"; e.g. --prompt_tokens={prompt} --tokens="
            f"{max_len - prompt - depth - 1} fit"
            if max_len - prompt - depth - 1 >= 1 else "")
  return (f"--prompt_tokens={prompt_tokens} + "
          + ("1 (--check_distribution)" if check_distribution
             else f"--tokens={tokens}")
          + f" + --depth={depth} + 1 = {need} exceeds the model's context, "
          f"max_len {max_len} (its config.json){fits}")


cli.check_problem(["model", "prompt_tokens", "tokens", "depth",
                   "check_distribution"], _context_problem)
cli.check(["rank", "coordinator"],
          lambda rank, coordinator: rank == 0 or bool(coordinator),
          "--rank is internal: it needs --coordinator")
cli.check_output_path("json_out")
cli.check_output_path("plot_out")
# The leader loads the verifier's keys and starts the worker on the same
# folder: both roles' files.
pipeline_config.check_keys_dir(["verifier", "worker"])


def given(name: str) -> bool:
  """Whether flag --`name` is on the command line (not its default)."""
  return bool(flags.FLAGS[name].present)


def verifier_ranks() -> int:
  """The verifier's jax.distributed ranks (--multiprocess is 2)."""
  return 2 if MULTIPROCESS.value else VERIFIER_RANKS.value


def config() -> pipeline_config.PipelineConfig:
  """The session's config (the check's small vocabulary by default)."""
  config_ = pipeline_config.from_flags(
      default_vocab=CHECK_VOCAB.value if CHECK.value else cli.DEFAULT_VOCAB)
  if FAULTS.value > 0 and config_.encrypt:   # the keyless proxy's link
    config_ = dataclasses.replace(config_, encrypt=False)
  return config_


def model_config(config_: pipeline_config.PipelineConfig) -> typing.Any:
  """The toy pair's ModelConfig with the target's processors of the flags."""
  return config_.model_config(repetition_penalty=PENALTY.value,
                              grammar_modulus=GRAMMAR.value)


def request_spec(rid: int, vocab: int) -> tuple[list[int], int]:
  """(prompt, seed) of request rid: the same on every rank. A trained
  pair's prompts are held-out source (the check's: the first one)."""
  seed = SEED.value * 1_000_003 + rid
  if pipeline_config.MODEL.value != "toy":
    prompts = held_out_prompts()
    return [int(t) for t in prompts[0 if rid >= CHECK_RID0
                                    else rid % len(prompts)]], seed
  prompt = [1] if rid >= CHECK_RID0 else [(7 * rid + 1) % vocab]
  return prompt, seed


@functools.cache
def pair() -> typing.Any:
  """The trained pair of --model (`dyadic_jax.models.pair.Pair`; loaded
  once, JAX starts)."""
  from dyadic_jax.models import pair as pair_lib  # pylint: disable=g-import-not-at-top
  return pair_lib.load_dir(cli.model_dir(
      pipeline_config.MODEL.value), max_depth=pipeline_config.DEPTH.value)


@functools.cache
def held_out_prompts() -> typing.Any:
  """int32[--requests, --prompt_tokens]: the run's prompts (--model); a
  chat model's (SmolLM2) are held-out chat prompts in its template, whole
  (a list of int32 arrays of their own lengths)."""
  if pair().meta.get("chat"):
    from dyadic_jax.models import gguf_model  # pylint: disable=g-import-not-at-top
    from experiments import chat_prompts  # pylint: disable=g-import-not-at-top
    texts = chat_prompts.prompts("held_out")
    import numpy as np  # pylint: disable=g-import-not-at-top
    order = np.random.default_rng(SEED.value).permutation(len(texts))
    return [pair().tokenizer.encode(gguf_model.chat(texts[i]))
            for i in order[:pipeline_config.MAX_REQUESTS]]
  from experiments import corpus  # pylint: disable=g-import-not-at-top
  return corpus.held_out_prompts(pair().tokenizer,
                                 pipeline_config.MAX_REQUESTS,
                                 PROMPT_TOKENS.value, SEED.value)


def models(config_: pipeline_config.PipelineConfig) -> tuple[typing.Any,
                                                             typing.Any]:
  """(target, draft) of the run: the toy pair with the flags' processors,
  or the trained pair of --model."""
  if config_.model == "toy":
    from dyadic_jax.models import toy_pair  # pylint: disable=g-import-not-at-top
    return toy_pair.make_models(model_config(config_))
  loaded = pair()
  return loaded.target, loaded.draft
