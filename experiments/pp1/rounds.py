"""The rounds: open-ended generation until every request has --tokens new
tokens, or the distribution check's first tokens and their tests; the
progress bar they draw."""

import collections
import functools
import logging
import sys
import time
import typing

import jax
import numpy as np

import dyadic_jax as dj
from dyadic_jax import bridge
from dyadic_jax.testing import stats
from experiments import cli
from experiments import pipeline_config
from experiments.pp1 import flags


class Progress:
  """A progress bar on stderr that log records do not break.

  On a terminal it redraws one line; a log record first ends that line,
  so the record starts on a line of its own. Elsewhere (a pipe, a CI log)
  it prints a line at every tenth of the way instead of redrawing.
  """

  def __init__(self, total: int, label: str):
    self.total, self.label = max(total, 1), label
    self.start = time.perf_counter()
    self.tty = sys.stderr.isatty()
    self.drawn = False          # a partial bar line is on the terminal
    self.step = -1
    self.handlers = [h for h in logging.getLogger().handlers]
    for h in self.handlers:
      h.addFilter(self._before_record)

  def _before_record(self, record: logging.LogRecord) -> bool:
    del record
    if self.drawn:
      sys.stderr.write("\n")
      self.drawn = False
    return True

  def update(self, done: int, extra: str = "") -> None:
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

  def close(self) -> None:
    if self.drawn:
      sys.stderr.write("\n")
      self.drawn = False
    for h in self.handlers:
      h.removeFilter(self._before_record)


class Run(typing.NamedTuple):
  """What the rounds produced."""
  results: list              # RoundResult of every request-round
  rounds: int                # verifier rounds (batches)
  outputs: dict              # rid -> its new tokens (--tokens of them, or
                             # the check's first token)
  in_flight: int = 1         # rounds in flight at once (request groups)


# A drill between rounds: (verifier, rounds so far, live request ids) ->
# the RoundResults of a round it ran itself ([] if none).
Drill = typing.Callable[[bridge.Verifier, int, list[int]],
                        list[bridge.RoundResult]]


def generate(verifier: bridge.Verifier, progress: Progress,
             drill: Drill | None = None) -> Run:
  """Rounds until every request has --tokens new tokens.

  The requests are split into --in_flight groups (at most
  `verifier.in_flight`: two where the session allows it, the rank links
  included) whose rounds overlap: a group's next round starts
  as soon as its last one is committed, so the worker drafts it while
  the verifier verifies the other group's. A request leaves its group as
  soon as it has its tokens. `drill` may run rounds of its own (the
  --kill_worker_at fault drill: the run then keeps one round in flight).
  """
  caps, tokens = verifier.caps, flags.TOKENS.value
  rids = list(range(caps.max_requests))
  for rid in rids:
    verifier.add_request(rid, *flags.request_spec(rid, caps.vocab))
  start = {rid: len(verifier.requests[rid].tokens) for rid in rids}
  new = lambda r: len(verifier.requests[r].tokens) - start[r]
  results, rounds = [], 0
  slots = 1 if drill else min(flags.IN_FLIGHT.value, verifier.in_flight,
                              len(rids))
  flying = collections.deque((group, verifier.start(group)) for group in (
      rids[g::slots] for g in range(slots)))
  while flying:
    group, handle = flying.popleft()
    results += verifier.finish(handle)
    rounds += 1
    group = [r for r in group if new(r) < tokens]
    if drill and (lost := drill(verifier, rounds, group)):
      results += lost
      rounds += 1
      group = [r for r in group if new(r) < tokens]
    if group:
      flying.append((group, verifier.start(group)))
    progress.update(sum(min(new(r), tokens) for r in rids),
                    f"fallbacks {verifier.counters.events('fallbacks')}")
  progress.close()
  if drill and rounds <= flags.KILL_AT.value:     # it never ran its round
    cli.progress(f"--kill_worker_at={flags.KILL_AT.value}: the run ended "
                 f"after {rounds} rounds, before the drill: no worker was "
                 "killed")
  outputs = {rid: verifier.requests[rid].tokens[start[rid]:][:tokens]
             for rid in rids}
  return Run(results, rounds, outputs, slots)


def first_tokens(verifier: bridge.Verifier,
                 progress: Progress) -> tuple[np.ndarray, Run]:
  """First committed token of many fresh requests, one round each."""
  r = verifier.caps.max_requests
  n = flags.CHECK_SAMPLES.value - flags.CHECK_SAMPLES.value % r
  first, results = [], []
  rounds = 0
  for start in range(0, n, r):
    rids = list(range(flags.CHECK_RID0 + start,
                      flags.CHECK_RID0 + start + r))
    for rid in rids:     # one fixed prompt, a fresh seed per request
      verifier.add_request(rid, *flags.request_spec(rid, verifier.caps.vocab))
    out = verifier.round(rids)
    rounds += 1
    results += out
    first += [res.committed[0] for res in out]
    progress.update(start + r)
  progress.close()
  outputs = {res.rid: list(res.committed[:1]) for res in results}
  return np.asarray(first), Run(results, rounds, outputs)


def target_only(config: pipeline_config.PipelineConfig
                ) -> dict[str, typing.Any]:
  """The same prompts and --tokens decoded by the target alone, the
  speedup's denominator: the best plain decoding this engine does (a
  target with a slab decodes the --requests prompts as one batch, the
  draw fused, `generate.target_only`; any other one call per token)."""
  from dyadic_jax.bridge import generate  # pylint: disable=g-import-not-at-top
  target, _ = flags.models(config)
  prompts = [flags.request_spec(rid, config.vocab)[0]
             for rid in range(config.requests)]
  run = functools.partial(generate.target_only, target, prompts,
                          max_new_tokens=flags.TOKENS.value,
                          batch=config.requests)
  # The same run once untimed: every shape it meets compiles there.
  run(seed=flags.SEED.value + 1)
  out = run(seed=flags.SEED.value)
  return {"tokens": out.new_tokens, "seconds": out.seconds["wall"],
          "tokens_per_second": out.tokens_per_second,
          "split_s": {k: v for k, v in out.seconds.items() if k != "wall"}}


def distribution_check(first: np.ndarray,
                       config: pipeline_config.PipelineConfig
                       ) -> dict[str, typing.Any]:
  """Goodness of fit to the exact P/T and a two-sample test vs target-only."""
  target, _ = flags.models(config)
  rows, _ = target.logits(target.init_state(), np.asarray(
      flags.request_spec(flags.CHECK_RID0, config.vocab)[0], np.int32),
                          np.zeros(0, np.int32))
  row = rows[0]
  probs, _ = dj.target_probs(row)
  p_fixed, total = dj.quantize_target(probs)
  expected = np.asarray(p_fixed, np.float64) / int(total)
  # Target-only samples with keys of their own (a domain of the check).
  seed = flags.SEED.value
  keys = jax.vmap(lambda i: dj.draw_key(dj.round_key(seed, 1 << 20, i),
                                        0, dj.Domain.TARGET_ONLY))(
                                            np.arange(len(first)))
  drawn, _ = jax.vmap(dj.sample_target, in_axes=(None, 0))(row, keys)
  target_only = np.asarray(drawn)
  v = config.vocab
  spec = np.bincount(first, minlength=v)
  ref = np.bincount(target_only, minlength=v)
  # Bins with expected count < 5 pooled into one, for both samples alike.
  e, s_obs, r_obs = stats.pool_small(expected * len(first), spec, ref)
  gof, _, gof_p = stats.goodness_of_fit(s_obs, e / e.sum())
  two, _, two_p = stats.two_sample(s_obs, r_obs)
  alpha = flags.ALPHA.value
  passed = gof_p >= alpha and two_p >= alpha
  return {"samples": int(len(first)), "alpha": alpha,
          "bins": int(len(e)), "statistic": gof, "p_value": gof_p,
          "two_sample_statistic": two, "two_sample_p_value": two_p,
          "verdict": "pass" if passed else "fail",
          "expected": expected.tolist(), "speculative": spec.tolist(),
          "target_only": ref.tolist()}
