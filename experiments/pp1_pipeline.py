"""The PP1 pipeline end to end: draft worker -> wire -> sharded verifier.

    python -m experiments.pp1_pipeline

Runtime with the defaults: 32 s, measured 2026-12-06 on 2 cores with load
average 0.1 before and 0.6 after (memcpy of 10 MB: 0.21 ms before, 0.17 ms
after); docs/figures.json, recorded by `python -m experiments.record_figures`.
Of the 31.1 s its summary counts, start-up, compile and worker start-up took
27.7 s and the 54 rounds 1.2 s; --tokens scales only the rounds.

The summary's time split says where a run's time went.

What runs (docs/architecture.md, "One round"; one round per step of the
progress bar):

* the draft worker, `experiments.bridge_worker`, as a subprocess on
  loopback: the shipped pair's draft (`--model=stdlib`, the default: a
  transformer with its KV cache, fed from the CONTEXT frames; or
  `--model=toy`, the DSpark-style toy draft of
  dyadic_jax/models/toy_pair.py, a parallel backbone + Markov head, at the
  seed's V=129280) drawing dyadic q rows (sparse top-k or dense) with its
  PROPOSAL keys;
* the host bridge (dyadic_jax.bridge): HELLO negotiation, STEP, REPLY rows,
  COMPLETION, validation before use, COMMIT, fallback on any defect;
* the verifier on a requests x vocab mesh (`--verifier_requests` groups of
  the vocabulary split; 1 by default): `sharding.verify_batch`, one call
  per round, and `sharding.sample_target` over --verifier_devices devices
  (emulated CPU devices here), with the pair's target (the trained one's
  rows for every request of a round in one call, its KV caches in one
  slab; the toy's with its processors, repetition penalty and optional
  grammar mask, applied unchanged);
* the baseline: the same prompts decoded by the target alone, batched
  (`generate.target_only`), and the cost model's terms that say why
  speculation paid or did not.

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
the worker's READY and HELLO beyond that), then per round wait (the
verifier waiting for answers: the worker's draft and the link, what of
them the other group's round did not hide), verification (target rows,
verify_batch, fallback samples), host (everything else in the loop:
STEP/COMMIT, bookkeeping, the plan broadcast with --multiprocess),
shutdown, and other (what no phase claims: the gaps between phases). The
requests run as two groups whose rounds overlap where the session allows
it (one with --kill_worker_at). The overlap line (`overlap` in the JSON)
puts the rounds' wall beside each side's busy time: the worker's (from
its counters), the verifier's (verification + host), the wait, and the
share of the worker's busy time hidden. The wall
time runs from the program's start to the end of the shutdown; the Python
interpreter's own start before it and writing the JSON and the plot after
it are not in it.

Every flag is checked when the command line is parsed (bad values exit at
once with a one-line error). The worker's session flags (--vocab, --depth,
--requests, --q, --k, --closeness, --model_seed, --backbone, and the
link's --keys_dir, --insecure, --encrypt, --worker_bug) are shared with
it: experiments/pipeline_config.py.

This file is the entry point; the program is the package experiments/pp1/
(flags and their checks, the process supervisor, the verifier, the
rounds, the drills, the report and plot, and `main`).
"""

from absl import flags as absl_flags

from experiments import cli
from experiments import interrupt

if __name__ == "__main__":
  # Before any thread starts (numpy's BLAS pool when the flags import the
  # library, JAX's, the extras' check): every thread inherits the mask.
  interrupt.install()

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import pipeline_config
# The wall clock starts when stopwatch is imported (its first import).
from experiments.pp1 import stopwatch  # pylint: disable=unused-import
from experiments.pp1 import flags
# pylint: enable=g-import-not-at-top,wrong-import-position

# --help lists the pipeline's flags and the session flags (--q, --k,
# --depth, --keys_dir ...), not only under --helpfull.
absl_flags.adopt_module_key_flags(flags)
absl_flags.adopt_module_key_flags(pipeline_config)
# The main job runs the shipped trained pair; the worker alone keeps the
# toy (it takes --model from the pipeline's command line).
cli.set_default("model", "stdlib")
# A bad flag, or a missing extra, exits here, before JAX.
cli.parse_flags_early(__name__, extra="experiments")

# pylint: disable-next=g-import-not-at-top,wrong-import-position
from experiments.pp1 import main as pp1_main

if __name__ == "__main__":
  cli.run(pp1_main.main)
