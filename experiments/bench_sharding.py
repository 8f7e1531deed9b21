"""Benchmark of the sharded ops (sharding/) against their single-device twins.

    python -m experiments.bench_sharding --json_out /tmp/bench_sharding.json

Expected runtime: about 2 minutes (130 s measured) on a 2-core CPU with the
defaults (V = 129280, 4 requests x depth 5 = 20 rows, --shards=1,2,4,8,
--repeats=3, which this module sets as its default); much of it is XLA
compilation (every op once per shard count, for the timed 20-row programs and
again for the one-row programs whose collectives are reported). The tables
print at the end; until then each stage's start (the unsharded ops, then
each shard count) goes to stderr with the seconds so far.

The module asks XLA for 8 emulated CPU devices (XLA_FLAGS
--xla_force_host_platform_device_count=8) before JAX is imported. On two
CPU cores, n emulated devices share the same cores and memory, so the times
say how much the collectives and per-shard overhead cost here, not how the
ops scale on GPUs; the collective byte counts carry over unchanged.

Workloads, on the round of experiments/bench_core.py (toy-model logits):

  dense     draft_weights + allocate_dense + sample_counts on [R*D, V]
  sparse-k  draft_weights + allocate_sparse(k) + sample_counts, each --ks
            (sample_counts of the replicated [k] counts is the core op)
  verify    jax.vmap(verify_chain) over the R requests, with the dense q
            and with the sparse k=--verify_k q

For each shard count n, the inputs are placed on `sharding.vocab_mesh(n)`
(`sharding.place`: contiguous vocabulary blocks; per-row inputs replicated)
and the `sharding` ops run with mesh=. Each figure is the median of
--repeats calls after one warm-up (compile) call, with block_until_ready,
reported per drafted row beside figures measured in the same run:

  x 1dev  the unsharded `dyadic_jax` op on one device
  x read  one fused jitted read (jnp.sum) of the same input in the same
          layout: the floor
  x copy  numpy memcpy of the same bytes into a preallocated buffer

Every sharded result must equal the unsharded one bit for bit (asserted;
vocabulary-sized outputs are compared on [..., :V] and padding ids must hold
zero).

Collectives: each public sharded op's program (`hlo.program`) is compiled
on ONE row of the benchmark data (verification: one request, D+1 target
rows) and its call sites are listed with `hlo.collectives`, so every
byte figure is per call site per row, each site counted once. A site inside
a loop of the compiled program (a bisection, or the map over the D+1 target
rows of a request) runs once per iteration: the "loop" column counts those.
Expected: O(n * k) elements for top-k candidate merges (k = 64 for the tie
ranking of allocate_dense and the sparse allocation), O(n) scalars for
normalizers and draws (verification: O((D+1) * n) per request, a scalar per
row and shard), never a vocabulary-sized array. The verdict is "largest
dimension moved < V / n"; the bound of the expectation is reported beside it.
"""

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                             + _DEVICES_FLAG).strip()

# pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import logging
import re
import statistics
import time
import typing

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import dyadic_jax as dj
import sharding
from dyadic_jax.testing import hlo
from experiments import bench_core
from experiments import cli
# pylint: enable=g-import-not-at-top,g-bad-import-order

# --vocab, --requests, --depth, --ks, --verify_k, --repeats, --seed and
# --json_out are bench_core's flags (defined once, shared by both
# benchmarks); they are adopted so that --help lists them here.
flags.adopt_module_key_flags(bench_core)
flags.FLAGS.set_default("repeats", 3)

_SHARDS = flags.DEFINE_list(
    "shards", ["1", "2", "4", "8"], "Shard counts n: each runs the sharded "
    "ops on sharding.vocab_mesh(n) (at most the 8 emulated devices).")
cli.check("shards", lambda s: cli.int_list(s, 1, 8),
          "--shards must be shard counts in [1, 8] (the emulated devices)")

_SMALL = 64  # allocation._SMALL: candidates ranked exactly after the search
_SAMPLE_STRIDE = 64  # allocation._SAMPLE_STRIDE: the search's key sample


def _search_bound(n, vocab):
  """Largest gather of the remainder search: candidates or its sample."""
  return max(n * _SMALL, n * -(-(-(-vocab // n)) // _SAMPLE_STRIDE))


# ---------------------------------------------------------------------------
# Benchmark data.


def round_data(vocab: int, requests: int, depth: int, seed: int,
               verify_k: int) -> dict[str, typing.Any]:
  """The round of bench_core: proposal rows, draws, target rows, dense and
  sparse q. Everything is on the default device, unsharded."""
  logits, u, target, chain, keys, anchors = bench_core.round_inputs(
      vocab, requests=requests, depth=depth, seed=seed)
  w64, _ = dj.draft_weights(logits)                                # f64[N, V]
  counts, _ = dj.allocate_dense(w64)                               # i32[N, V]
  s_ids, s_counts, s_n, _ = dj.allocate_sparse(w64, verify_k)
  s_slot = dj.sample_counts(s_counts, u)
  s_tokens = jnp.take_along_axis(s_ids, s_slot[:, None], 1)[:, 0]
  # The sparse tokens come from rows conditioned on the dense chain: the
  # verification cost does not depend on which chain the rows came from.
  dense_q = dj.DenseQ(counts.reshape(requests, depth, vocab))
  sparse_q = dj.SparseQ(s_ids.reshape(requests, depth, verify_k),
                        s_counts.reshape(requests, depth, verify_k),
                        s_n.reshape(requests, depth))
  data = dict(logits=logits, u=u, w64=w64, counts=counts, target=target,
              keys=keys, anchors=anchors, chain=chain, dense_q=dense_q,
              sparse_q=sparse_q, sparse_tokens=s_tokens.reshape(requests,
                                                                depth))
  return jax.block_until_ready(data)


def replicate(x: typing.Any, mesh: jax.sharding.Mesh) -> typing.Any:
  """x (a pytree) replicated on every device of the mesh."""
  return jax.device_put(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def assert_same(name: str, single: typing.Any, sharded: typing.Any,
                vocab: int) -> None:
  """Sharded results equal the single-device ones bit for bit.

  Vocabulary-sized sharded outputs are in the padded layout: compared on
  [..., :V], and every padding id must hold zero.
  """
  a_leaves, b_leaves = jax.tree.leaves(single), jax.tree.leaves(sharded)
  assert len(a_leaves) == len(b_leaves), name
  for i, (a, b) in enumerate(zip(a_leaves, b_leaves)):
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim and a.shape[-1] == vocab and b.shape[-1] > vocab:
      assert not np.any(b[..., vocab:]), f"{name}: mass at padding ids"
      b = b[..., :vocab]
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{name} output {i}: {a.dtype}{a.shape} != {b.dtype}{b.shape}")
    assert np.array_equal(a, b), f"{name} output {i}: sharded != unsharded"


def paired_seconds(fn: typing.Callable[[], typing.Any],
                   baseline: typing.Callable[[], typing.Any],
                   repeats: int) -> tuple[float, float]:
  """Medians of fn() and baseline(), timed in alternation.

  One warm-up call each, then `repeats` rounds of one timed call of each
  (results blocked on): a change of machine load during the measurement
  hits both alike, so their ratio is steadier than that of two separate
  `bench_core.median_seconds` figures.
  """
  jax.block_until_ready((fn(), baseline()))
  times: tuple[list[float], list[float]] = ([], [])
  for _ in range(repeats):
    for spent, f in zip(times, (fn, baseline)):
      start = time.perf_counter()
      jax.block_until_ready(f())
      spent.append(time.perf_counter() - start)
  return statistics.median(times[0]), statistics.median(times[1])


# ---------------------------------------------------------------------------
# Collectives per call site, with the loop depth of each site.

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_CALLEE = re.compile(r"\b(condition|body|calls|to_apply|branch_computations|"
                     r"true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")


def collective_sites(hlo_text: str) -> list[tuple[int, hlo.Collective]]:
  """[(loop depth, hlo.Collective)] for every collective call site.

  The module is split into its computations; the loop depth of a
  computation is the number of while loops (body or condition) on the call
  path from ENTRY, the largest over paths. Each computation's sites come
  from `hlo.collectives` of its own text.
  """
  texts: dict[str, list[str]] = {}
  callees: dict[str, list[tuple[str, int]]] = {}
  entry, name = None, None
  for line in hlo_text.splitlines():
    m = _HEADER.match(line)
    if m:
      name = m.group(1)
      texts[name], callees[name] = [], []
      if line.startswith("ENTRY"):
        entry = name
      continue
    if name is None:
      continue
    if line.startswith("}"):
      name = None
      continue
    texts[name].append(line)
    for attr in _CALLEE.finditer(line):
      loop = attr.group(1) in ("condition", "body")
      for callee in re.findall(r"[\w.\-]+", attr.group(2)):
        callees[name].append((callee, loop))
  depth: dict[str, int] = {}

  def visit(comp, d):
    if comp not in texts or depth.get(comp, -1) >= d:
      return
    depth[comp] = d
    for callee, loop in callees[comp]:
      visit(callee, d + loop)

  visit(entry, 0)
  sites = [(depth.get(comp, 0), c) for comp, lines in texts.items()
           for c in hlo.collectives("\n".join(lines))]
  assert len(sites) == len(hlo.collectives(hlo_text)), (
      "collective_sites lost call sites: the HLO splitter is broken")
  return sites


def collective_report(name: str, hlo_text: str, vocab: int, n: int,
                      bound: int, expect: str) -> dict[str, typing.Any]:
  sites = collective_sites(hlo_text)
  found = [c for _, c in sites]
  largest = hlo.largest_dimension(found)
  block = -(-vocab // n)
  kinds: dict[str, int] = {}
  for c in found:
    kinds[c.kind] = kinds.get(c.kind, 0) + 1
  return {"op": name, "shards": n, "sites": len(found),
          "sites_in_loops": sum(d > 0 for d, _ in sites),
          "bytes_per_row": sum(c.nbytes for c in found),
          "bytes_per_row_in_loops": sum(c.nbytes for d, c in sites if d > 0),
          "largest_dim": largest, "block": block, "expect": expect,
          "bound": bound, "within_bound": largest <= bound,
          "pass": largest < block, "kinds": kinds,
          "site_list": [{"kind": c.kind, "shapes": [list(s) for s in c.shapes],
                         "bytes": c.nbytes, "loop_depth": d}
                        for d, c in sites]}


def collective_programs(data: dict[str, typing.Any], n: int,
                        mesh: jax.sharding.Mesh, ks: list[int],
                        verify_k: int) -> list[tuple[str, str, int, str]]:
  """(name, compiled HLO text, bound, expectation) of each op on one row.

  Each public sharded op is compiled as it runs (`hlo.program`: 64-bit
  mode on, as the ops scope it).
  """
  one = lambda x: x[:1]
  logits, w64, counts, u = (one(data[k]) for k in ("logits", "w64", "counts",
                                                   "u"))
  out = [
      ("draft_weights", hlo.program(sharding.draft_weights, logits,
                                    mesh=mesh), n, "O(n) scalars"),
      ("allocate_dense", hlo.program(sharding.allocate_dense, w64, mesh=mesh),
       _search_bound(n, w64.shape[-1]),
       f"max({_SMALL}n, V/{_SAMPLE_STRIDE}) = "
       f"{_search_bound(n, w64.shape[-1])} candidates / sample"),
      ("sample_counts", hlo.program(sharding.sample_counts, counts, u,
                                    mesh=mesh),
       n, "O(n) shard totals"),
  ]
  for k in ks:
    out.append((f"allocate_sparse k={k}",
                hlo.program(sharding.allocate_sparse, w64, k=k, mesh=mesh),
                max(n * k, _search_bound(n, w64.shape[-1])),
                f"max(n*k, search) = "
                f"{max(n * k, _search_bound(n, w64.shape[-1]))}"))
  request = lambda tree: jax.tree.map(lambda x: x[0], tree)
  rows = data["chain"].shape[1] + 1  # D + 1 target rows of one request
  for label, q, tokens in (
      ("verify dense", data["dense_q"], data["chain"]),
      (f"verify sparse k={verify_k}", data["sparse_q"],
       data["sparse_tokens"])):
    out.append((label, hlo.program(
        sharding.verify_chain, data["target"][0], request(q), tokens[0],
        data["keys"][0], anchor=int(data["anchors"][0]), mesh=mesh),
        rows * n, f"O((D+1)*n) = {rows * n} /req"))
  return out


# ---------------------------------------------------------------------------


def _label(n):
  return "1dev" if n == 0 else f"n={n}"


def main(argv: list[str]) -> None:
  del argv
  # absl shows INFO records; JAX's backend probe logs "Unable to initialize
  # backend 'tpu'" at INFO on every machine without a TPU.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  flag = flags.FLAGS
  vocab, requests, depth = flag.vocab, flag.requests, flag.depth
  ks = [int(k) for k in flag.ks]
  verify_k, repeats = flag.verify_k, flag.repeats
  shards = [int(s) for s in _SHARDS.value]
  rows = requests * depth
  if any(not 1 <= k <= vocab for k in ks + [verify_k]):
    cli.usage_error(f"every k (--ks, --verify_k) must be in [1, {vocab}]")
  if any(not 1 <= s <= jax.device_count() for s in shards):
    cli.usage_error(f"--shards: every shard count must be in [1, "
                    f"{jax.device_count()}] (devices available)")
  median = lambda fn: bench_core.median_seconds(fn, repeats)
  paired = lambda fn, baseline: paired_seconds(fn, baseline, repeats)
  wall_start = time.perf_counter()
  print(f"bench_sharding: V={vocab} requests={requests} depth={depth} "
        f"({rows} rows) shards={shards} repeats={repeats} "
        f"backend={jax.default_backend()} devices={jax.device_count()} "
        f"cpu cores={os.cpu_count()}")
  print("NOTE: emulated CPU devices share the host's cores and memory; the "
        "times show collective and per-shard overhead on this machine, not "
        "GPU scaling. Collective byte counts do carry over.")

  def step(what):
    # The tables print at the end (the defaults take minutes, mostly XLA
    # compiles): say where the run is, on stderr, as it goes.
    cli.progress(f"{what} ({time.perf_counter() - wall_start:.0f} s so far)")

  step("the round's inputs (bench_core's)")
  data = round_data(vocab, requests, depth, flag.seed, verify_k)
  logits, u, target = data["logits"], data["u"], data["target"]
  results, stages, floors, collectives = [], [], [], []

  def record(workload, n, seconds, single_s, floor_s, memcpy_s, extra=None):
    """single_s: the unsharded op timed in alternation with this one."""
    entry = {"workload": workload, "shards": n, "s": seconds,
             "us_per_row": seconds / rows * 1e6,
             "unsharded_paired_s": single_s,
             "x_unsharded": seconds / single_s if single_s else 1.0,
             "x_floor_read": seconds / floor_s, "x_memcpy": seconds / memcpy_s,
             "floor_read_s": floor_s, "memcpy_s": memcpy_s}
    entry.update(extra or {})
    results.append(entry)

  # memcpy floors: the same bytes whatever the layout.
  def memcpy_of(*arrays):
    host = [np.asarray(a) for a in arrays]
    bufs = [np.empty_like(a) for a in host]
    return median(lambda: [np.copyto(b, a) for b, a in zip(bufs, host)])

  memcpy_prop = memcpy_of(logits)
  memcpy_vdense = memcpy_of(target, data["dense_q"].counts)
  memcpy_vsparse = memcpy_of(target)
  read_all = jax.jit(lambda *a: sum(jnp.sum(x) for x in a))

  # ---- Unsharded: the dyadic_jax ops on one device.
  def dense_single():
    w, ws = dj.draft_weights(logits)
    c, cs = dj.allocate_dense(w)
    return w, ws, c, cs, dj.sample_counts(c, u)

  def sparse_single(k):
    w, _ = dj.draft_weights(logits)
    out = dj.allocate_sparse(w, k)
    return (*out, dj.sample_counts(out[1], u))

  verify = lambda fn: jax.vmap(
      lambda t, q, x, key, a: fn(t, q, x, key, anchor=a))
  verify_single = verify(dj.verify_chain)
  verify_cases = (
      ("verify dense", data["dense_q"], data["chain"], memcpy_vdense),
      (f"verify sparse k={verify_k}", data["sparse_q"], data["sparse_tokens"],
       memcpy_vsparse))

  step("the unsharded ops on one device: compiled, then timed")
  single = {"dense": dense_single()}
  floor_1 = median(lambda: read_all(logits))
  record("dense", 0, median(dense_single), 0, floor_1, memcpy_prop)
  w64 = single["dense"][0]
  single_stages = {
      "draft_weights": lambda: dj.draft_weights(logits),
      "allocate_dense": lambda: dj.allocate_dense(w64),
      "sample_counts": lambda: dj.sample_counts(single["dense"][2], u)}
  stages.append({"shards": 0, **{op: median(fn)
                                 for op, fn in single_stages.items()}})
  for k in ks:
    name = f"sparse k={k}"
    single[name] = sparse_single(k)
    record(name, 0, median(lambda k=k: sparse_single(k)), 0, floor_1,
           memcpy_prop, {"k": k})
  for name, q, tokens, memcpy_s in verify_cases:
    args = (target, q, tokens, data["keys"], data["anchors"])
    single[name] = verify_single(*args)
    seconds = median(lambda args=args: verify_single(*args))
    floor_args = (target,) + ((q.counts,) if name == "verify dense" else ())
    floor_s = median(lambda a=floor_args: read_all(*a))
    record(name, 0, seconds, 0, floor_s, memcpy_s,
           {"accepted": np.asarray(single[name][0]).tolist(),
            "next_tokens": np.asarray(single[name][1]).tolist()})
  floors.append({"shards": 0, "read_logits_s": floor_1})

  # ---- Sharded.
  for n in shards:
    step(f"{n} shard{'s' if n > 1 else ''}: every op compiled, checked "
         "against the unsharded one bit for bit, then timed")
    mesh = sharding.vocab_mesh(n)
    p_logits = sharding.place(logits, mesh, fill=-jnp.inf)
    p_target = sharding.place(target, mesh, fill=-jnp.inf)
    p_dense_q = dj.DenseQ(sharding.place(data["dense_q"].counts, mesh))
    r_u, r_keys, r_anchors, r_chain, r_sparse_q, r_sparse_tokens = replicate(
        (u, data["keys"], data["anchors"], data["chain"], data["sparse_q"],
         data["sparse_tokens"]), mesh)

    def dense_sharded(mesh=mesh, p_logits=p_logits, r_u=r_u):
      w, ws = sharding.draft_weights(p_logits, mesh=mesh)
      c, cs = sharding.allocate_dense(w, mesh=mesh)
      return w, ws, c, cs, sharding.sample_counts(c, r_u, mesh=mesh)

    def sparse_sharded(k, mesh=mesh, p_logits=p_logits, r_u=r_u):
      w, _ = sharding.draft_weights(p_logits, mesh=mesh)
      out = sharding.allocate_sparse(w, k, mesh=mesh)
      return (*out, dj.sample_counts(out[1], r_u))

    floor_n = median(lambda p=p_logits: read_all(p))
    floors.append({"shards": n, "read_logits_s": floor_n})
    out = dense_sharded()
    assert_same(f"dense n={n}", single["dense"], out, vocab)
    record("dense", n, *paired(dense_sharded, dense_single), floor_n,
           memcpy_prop)
    w_n, c_n = out[0], out[2]
    sharded_stages = {
        "draft_weights": lambda: sharding.draft_weights(p_logits, mesh=mesh),
        "allocate_dense": lambda: sharding.allocate_dense(w_n, mesh=mesh),
        "sample_counts": lambda: sharding.sample_counts(c_n, r_u, mesh=mesh)}
    stage: dict[str, typing.Any] = {"shards": n}
    for op, fn in sharded_stages.items():
      stage[op], stage[op + "_unsharded_paired"] = paired(
          fn, single_stages[op])
    stages.append(stage)
    for k in ks:
      name = f"sparse k={k}"
      assert_same(f"{name} n={n}", single[name], sparse_sharded(k), vocab)
      record(name, n, *paired(lambda k=k: sparse_sharded(k),
                              lambda k=k: sparse_single(k)),
             floor_n, memcpy_prop, {"k": k})
    verify_n = verify(
        lambda *a, mesh=mesh, **kw: sharding.verify_chain(*a, mesh=mesh,
                                                          **kw))
    for (name, q_1, tokens_1, memcpy_s), q, tokens in zip(
        verify_cases, (p_dense_q, r_sparse_q), (r_chain, r_sparse_tokens)):
      args = (p_target, q, tokens, r_keys, r_anchors)
      args_1 = (target, q_1, tokens_1, data["keys"], data["anchors"])
      assert_same(f"{name} n={n}", single[name], verify_n(*args), vocab)
      seconds, single_paired = paired(
          lambda args=args: verify_n(*args),
          lambda args_1=args_1: verify_single(*args_1))
      floor_args = (p_target,) + ((q.counts,) if name == "verify dense"
                                  else ())
      floor_s = median(lambda a=floor_args: read_all(*a))
      record(name, n, seconds, single_paired, floor_s, memcpy_s)

    step(f"{n} shard{'s' if n > 1 else ''}: the one-row programs' "
         "collectives")
    for name, text, bound, expect in collective_programs(
        data, n, mesh, ks, verify_k):
      collectives.append(collective_report(name, text, vocab, n, bound,
                                           expect))

  # ---- Report.
  print(f"\nfloor: fused read of the [{rows}, {vocab}] f32 logits, "
        + ", ".join(f"{_label(f['shards'])} {f['read_logits_s'] * 1e3:.3f} ms"
                    for f in floors)
        + f"; memcpy {memcpy_prop * 1e3:.3f} ms")
  header = (f"{'workload':<20} {'n':>5} {'us/row':>10} {'1dev us/row':>12} "
            f"{'x 1dev':>7} {'x read':>7} {'x copy':>7}")
  print("\ntimes per drafted row (median of "
        f"{repeats}); n=1dev is the unsharded dyadic_jax op; on the sharded "
        "rows '1dev us/row' is the unsharded op timed in alternation with the "
        "sharded one and 'x 1dev' their ratio; x read / x copy are against "
        "the floors of the same input in the same layout")
  print(header + "\n" + "-" * len(header))
  order: dict[str, list[dict[str, typing.Any]]] = {}
  for e in results:
    order.setdefault(e["workload"], []).append(e)
  for workload, entries in order.items():
    for e in sorted(entries, key=lambda e: e["shards"]):
      label = "1dev" if e["shards"] == 0 else str(e["shards"])
      paired_us = ("" if not e["unsharded_paired_s"] else
                   f"{e['unsharded_paired_s'] / rows * 1e6:.1f}")
      print(f"{workload:<20} {label:>5} {e['us_per_row']:10.1f} "
            f"{paired_us:>12} "
            f"{e['x_unsharded']:7.2f} {e['x_floor_read']:7.1f} "
            f"{e['x_memcpy']:7.1f}")
  print("\ndense stages per row (us; sharded / unsharded timed in "
        "alternation):")
  for stage in stages:
    if stage["shards"] == 0:
      print(f"  {'1dev':>5}: " + ", ".join(
          f"{op} {stage[op] / rows * 1e6:.1f}" for op in single_stages))
      continue
    print(f"  {_label(stage['shards']):>5}: " + ", ".join(
        f"{op} {stage[op] / rows * 1e6:.1f} "
        f"({stage[op] / stage[op + '_unsharded_paired']:.2f}x)"
        for op in single_stages))
  for e in results:
    if "accepted" in e:
      print(f"{e['workload']}: accepted {e['accepted']}, next tokens "
            f"{e['next_tokens']} (equal on every n)")

  header = (f"{'op':<22} {'n':>2} {'sites':>5} {'loop':>4} "
            f"{'bytes/row':>10} {'in loop':>8} {'largest':>8} {'V/n':>7} "
            f"{'expected':<24} {'check':<5}")
  print("\ncollectives per call site PER ROW: each op compiled on one row "
        "(verify: one request, D+1 target rows); each site counted once; "
        "'loop' sites sit inside a loop (bisection, or the map over target "
        "rows) and run once per iteration; check: largest dimension moved < "
        "V/n")
  print(header + "\n" + "-" * len(header))
  for c in collectives:
    print(f"{c['op']:<22} {c['shards']:>2} {c['sites']:>5} "
          f"{c['sites_in_loops']:>4} {c['bytes_per_row']:>10} "
          f"{c['bytes_per_row_in_loops']:>8} {c['largest_dim']:>8} "
          f"{c['block']:>7} {c['expect']:<24} "
          f"{'PASS' if c['pass'] else 'MISS'}"
          + ("" if c["within_bound"] else f" (above {c['bound']})"))

  misses = [c for c in collectives if not c["pass"]]
  over = [c for c in collectives if not c["within_bound"]]
  print(f"\n  [PASS] every sharded result equals the unsharded one "
        f"({len(results) - len(order)} sharded runs compared)")
  print(f"  [{'PASS' if not misses else 'MISS'}] no collective moves a "
        f"dimension >= V/n ({len(collectives)} programs; "
        + (", ".join(f"{c['op']} n={c['shards']}" for c in misses)
           or "none above") + ")")
  print(f"  [{'INFO' if not over else 'MISS'}] largest dimension within the "
        "expected bound (column 'expected'): "
        + (", ".join(f"{c['op']} n={c['shards']} ({c['largest_dim']} > "
                     f"{c['bound']})" for c in over) or "all"))
  wall = time.perf_counter() - wall_start
  print(f"\ntotal wall time {wall:.1f} s")

  if flag.json_out:
    out = {"vocab": vocab, "requests": requests, "depth": depth, "rows": rows,
           "shards": shards, "repeats": repeats,
           "backend": jax.default_backend(), "devices": jax.device_count(),
           "cpu_count": os.cpu_count(), "floors": floors,
           "memcpy_logits_s": memcpy_prop, "results": results,
           "dense_stages_s": stages, "collectives": collectives,
           "wall_s": wall,
           "targets": [
               {"target": "largest collective dimension < V/n",
                "pass": not misses},
               {"target": "largest collective dimension within O(n*k) bound",
                "pass": not over}]}
    with open(flag.json_out, "w") as f:
      json.dump(out, f, indent=2)
    print(f"Wrote {flag.json_out}")


if __name__ == "__main__":
  cli.run(main)
