"""The run's record: the JSON (`summarize`), the summary table on stdout,
the plot, and writing them.

The time split adds up to the wall time (the entry point's docstring says
what each phase holds); per link, the bytes and times of the session's
link and, with rank links, of every rank's (from the follower ranks'
--stats_out files).
"""

import collections
import json
import logging
import os
import typing

import numpy as np

from dyadic_jax.testing import stats
from dyadic_jax.wire.layouts import Feature
from experiments import pipeline_config
from experiments.pp1 import flags

_Q = pipeline_config.Q_FORMATS


def time_split(watch):
  """{phase: seconds} that adds up to the wall time (see the docstring)."""
  s = dict(watch.seconds)
  split = {}
  for name in ("start-up", "compile", "worker start-up"):
    split[name] = s.pop(name, 0.0)
  # The verifier's waits for answers: the worker's draft and the link,
  # the part of them not hidden behind the other group's verification.
  split.update({"wait": s.pop("exchange", 0.0),
                "verification": s.pop("verification", 0.0),
                "host": s.pop("rounds", 0.0)})
  split.update(s)      # worker restart, distribution check, shutdown
  split["other"] = watch.wall - sum(split.values())
  return split


ROUND_PARTS = ("wait", "verification", "host")


def overlap(split, worker_stats, rounds, in_flight):
  """What the rounds' wall holds of each side's busy time.

  The verifier is busy for verification + host; it waits (`wait`) for
  what of the worker's turn was not hidden behind its own work. The
  worker's busy time is its `busy_us` (each STEP message answered and
  sent; `draft_s` of it drawing proposals), from its counters (a worker
  killed by the drill takes its figures with it: 0). hidden: the share
  of the worker's busy time the verifier did not wait for, a lower bound
  on the share of its turn hidden (the turn adds the link); with one
  round in flight about 0. wall_over_busier: the rounds' time over the
  busier side's busy time (1: perfect overlap)."""
  events = worker_stats.get("events", {})
  worker = events.get("busy_us", 0) / 1e6
  verifier = split["verification"] + split["host"]
  round_s = sum(split[name] for name in ROUND_PARTS)
  per = 1e3 / max(rounds, 1)
  return {"in_flight": in_flight, "round_s": round_s, "parts": ROUND_PARTS,
          "worker_busy_s": worker,
          "draft_s": events.get("propose_us", 0) / 1e6,
          "verifier_busy_s": verifier, "wait_s": split["wait"],
          "round_ms": round_s * per, "worker_ms": worker * per,
          "verifier_ms": verifier * per, "wait_ms": split["wait"] * per,
          "hidden": max(0.0, 1.0 - split["wait"] / worker) if worker else None,
          "wall_over_busier": round_s / max(worker, verifier, 1e-12)}


def link_figures(verifier, request_rounds, tmp, ranks):
  """Per link into the verifier (the session's; with rank links one per
  rank): bytes in per request-round and per round, and the time from a
  round's start to its last frame in (or the deadline), the session's from
  the verifier, the other ranks' from their --stats_out files."""
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


def deadline_range(figures):
  """One AdaptiveDeadline.figures() for every link's: the range of the
  deadlines they used (None if none had one)."""
  figures = [f for f in figures if f and f["min_s"] is not None]
  if not figures:
    return None
  return dict(figures[0], min_s=min(f["min_s"] for f in figures),
              max_s=max(f["max_s"] for f in figures))


def summarize(run, verifier, config, worker_stats, proxy, watch, check,
               links, agree):
  """The JSON record of a run."""
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
  ranks = flags.verifier_ranks()
  groups = flags.REQUEST_GROUPS.value
  record = {
      "config": {"vocab": caps.vocab, "requests": caps.max_requests,
                 "depth": depth, "q": config.q, "k": caps.max_support,
                 "tokens": flags.TOKENS.value,
                 "multiprocess": ranks > 1,
                 "verifier_ranks": ranks,
                 "worker_ranks": config.worker_ranks,
                 "rank_links": config.rank_links,
                 "verifier_mesh": ({"requests": 1, "vocab": ranks}
                                   if ranks > 1 else
                                   {"requests": groups,
                                    "vocab": flags.DEVICES.value // groups}),
                 "inject_faults": flags.FAULTS.value,
                 "seed": flags.SEED.value,
                 "mutant": flags.MUTANT.value,
                 "kill_worker_at": flags.KILL_AT.value,
                 "in_flight": run.in_flight,
                 "authentication": (
                     "none (--insecure)" if config.insecure else
                     "keyed BLAKE3, batch answers AES-256-GMAC"
                     if verifier.session.features & Feature.GMAC
                     else "keyed BLAKE3"),
                 "encrypt": config.encrypt,
                 "sampling_audit": not flags.NO_AUDIT.value,
                 "worker_bug": config.worker_bug,
                 "model": config.model},
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
      "deadline_s": deadline_range([x["deadline_s"] for x in links]),
      "events": counters["events"],
      "worker": worker_stats,
      "faults": ({f"{d}/{k}": n for (d, k), n in proxy.counts().items()}
                 if proxy else {}),
      "time_s": {"wall": watch.wall, "split": time_split(watch)},
  }
  record["overlap"] = overlap(record["time_s"]["split"], worker_stats,
                              run.rounds, run.in_flight)
  record["outputs"] = {str(r): t for r, t in run.outputs.items()}
  # Every committed token of every request, in order (past --tokens too).
  record["committed"] = {
      str(r): list(verifier.requests[r].tokens[len(flags.request_spec(
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


def speed(record, baseline):
  """Tokens per second of the rounds vs the target-only baseline, and the
  cost model's terms that explain the ratio (`verdict`).

  In units of one batched target-only step (the baseline's seconds per
  token of a request): E, the tokens a round commits per request, and
  the round's cost, split into the verifier's wait for the worker (the
  draft and the link, less what the other group's round hid), its part
  (the verify pass over D + 1 rows, verification, fallbacks) and host.
  Speculation pays where E exceeds the cost."""
  share = record["overlap"]
  rounds_s = share["round_s"]   # the rounds' phases
  spec = record["tokens"] / rounds_s if rounds_s else 0.0
  out = {"tokens_per_second": spec, "target_only": baseline,
         "speedup": spec / baseline["tokens_per_second"]
         if baseline["tokens_per_second"] else None}
  steps = baseline["tokens"] / max(record["config"]["requests"], 1)
  if steps and baseline["seconds"] and record["rounds"]:
    step_s = baseline["seconds"] / steps
    split = record["time_s"]["split"]
    per_round = {name: split[name] / record["rounds"] / step_s
                 for name in share["parts"]}
    out["cost_model"] = {
        "tokens_per_request_round": record["tokens_per_round"],
        "step_ms": step_s * 1e3,
        "round_cost_steps": sum(per_round.values()),
        "round_cost_split_steps": per_round}
  return out


def verdict(sp) -> str:
  """In words: whether speculation paid, and the cost model's terms."""
  model = sp.get("cost_model")
  if not model or sp["speedup"] is None:
    return "no baseline to compare with"
  e, cost = model["tokens_per_request_round"], model["round_cost_steps"]
  parts = model["round_cost_split_steps"]
  terms = (f"a round commits E = {e:.2f} tokens per request and costs "
           f"{cost:.2f} target-only steps of {model['step_ms']:.2f} ms "
           f"(waiting for the worker {parts['wait']:.2f}, verifier "
           f"{parts['verification']:.2f}, host {parts['host']:.2f})")
  if sp["speedup"] >= 1:
    return f"speculation paid ({sp['speedup']:.2f}x): {terms}"
  return (f"speculation did not pay ({sp['speedup']:.2f}x): {terms}; it pays "
          "where a round costs fewer steps than it commits tokens")


def samples(run, config):
  """Prompt and generated text of the first --show_samples requests."""
  tok = flags.pair().tokenizer
  eos = flags.pair().meta.get("eos")
  out = []
  for rid in sorted(run.outputs)[:flags.SAMPLES.value]:
    prompt = flags.request_spec(rid, config.vocab)[0]
    generated = list(run.outputs[rid])
    if eos in generated:          # a chat answer ends at its end marker
      generated = generated[:generated.index(eos) + 1]
    out.append({"request": rid, "prompt": tok.decode(prompt),
                "generated": tok.decode(generated)})
  return out


def print_summary(record):
  """The summary table (stdout)."""
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
  o = record["overlap"]
  hidden = ("" if o["hidden"] is None else
            f"; >= {o['hidden']:.0%} of the worker's busy time hidden")
  print(f"  rounds in flight             {o['in_flight']}: per round the "
        f"worker busy {o['worker_ms']:.2f} ms, the verifier "
        f"{o['verifier_ms']:.2f} ms, waiting {o['wait_ms']:.2f} ms; wall "
        f"{o['round_ms']:.2f} ms = {o['wall_over_busier']:.2f}x the busier "
        f"side{hidden}")
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
  if "speed" in record:
    sp = record["speed"]
    base = sp["target_only"]
    print(f"  tokens per second            {sp['tokens_per_second']:.1f} "
          f"speculative (the rounds, worker and bridge included) vs "
          f"{base['tokens_per_second']:.1f} target-only (same prompts, "
          f"one process) = {sp['speedup']:.2f}x")
    print(f"  why                          {verdict(sp)}")
  for sample in record.get("samples", []):
    source = ("held-out chat prompt" if flags.pair().meta.get("chat")
              else "held-out source")
    print(f"\nRequest {sample['request']}: prompt ({source}), then "
          "the generated text after '>>>'")
    print(sample["prompt"][-400:] + ">>>" + sample["generated"])
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


def plot(record, path):
  """Acceptance by position, the time split and the check (a PNG)."""
  # Matplotlib logs "building the font cache" once per fresh install.
  logging.getLogger("matplotlib").setLevel(logging.ERROR)
  # pyplot is imported here, after the log level is set, and only by a
  # run that writes a plot.
  # pylint: disable=g-import-not-at-top
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
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


def write(record: dict[str, typing.Any]) -> None:
  """Writes --json_out and --plot_out (an earlier run's are replaced, and
  the run says so)."""
  replaced = lambda path: (" (replaced the previous one)"
                           if os.path.exists(path) else "")
  json_out, plot_out = flags.JSON_OUT.value, flags.PLOT_OUT.value
  if json_out:
    note = replaced(json_out)
    with open(json_out, "w") as f:
      json.dump(record, f, indent=1)
    print(f"\nwrote {json_out}{note}")
  if plot_out:
    note = replaced(plot_out)
    plot(record, plot_out)
    print(f"wrote {plot_out}{note}")
