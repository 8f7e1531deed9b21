"""Qualification of the library on this machine's accelerator, in one command.

    python -m experiments.gpu_qualify --json_out=gpu_qualify.json
    python -m experiments.gpu_qualify --quick   # the small CPU preset CI runs

Runs on whatever JAX sees (a GPU, or CPU with --cpu_devices emulated
devices), prints progress, writes one JSON report with PASS, FAIL or SKIP
(and the reason) per check, prints where it went, and exits 1 when a
correctness check failed (with --strict_targets, a missed speed target too).
It imports neither the bridge nor zmq (GPU boxes may lack pyzmq).

Checks:
  no_bridge            dyadic_jax.bridge and zmq were not imported
  fp64_int64           float64, int64 and uint64 are 64-bit on the device
                       (results that float32 or int32 would change), and a
                       library op staged into a 32-bit jit raises X64Required
  division             weights.reciprocal == IEEE 1 / z (numpy) bit for bit:
                       on accelerators that is the vector division branch
                       that CPU cannot run faithfully (docs/numerics.md)
  oracle_allocation    allocate_dense / allocate_sparse on the adversarial
                       rows of dyadic_jax/testing/adversarial.py ==
                       dyadic_jax.reference, in both row modes
  oracle_verification  target grid == reference.quantize_target; the exact
                       output distribution of the implemented rule within
                       (V + 2) 2^-64 of P / T; verify_chain and sample_target
                       decisions == the oracle's replay of the same draws
  rows_identity        every single-device op on batches of rows == the op
                       on each row alone, in both row modes
  sharded_identity     every sharded op == its single-device twin on 1, 2,
                       4, 8 shards (as many as there are local devices), in
                       both row modes
  benchmark            experiments/bench_core.py in a subprocess (it asserts
                       that the library's results equal the numpy ones);
                       each of its speed targets becomes a performance check

Expected runtime: --quick about 1-2 minutes on a 2-core CPU (most of it
compilation); the full run (V = 129280, 8 shards where there are 8
devices) about 10-20 minutes on one GPU, mostly the full-vocabulary oracle
rows and the benchmark.
"""

import functools
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from fractions import Fraction
from typing import NamedTuple

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import dyadic_jax as dj
from dyadic_jax import allocation
from dyadic_jax import draws
from dyadic_jax import reference as ref
from dyadic_jax import rowwise
from dyadic_jax import weights
from dyadic_jax.testing import adversarial
import sharding
from sharding import collectives

_CHECKS = ("no_bridge", "fp64_int64", "division", "oracle_allocation",
           "oracle_verification", "rows_identity", "sharded_identity",
           "benchmark")

_JSON_OUT = flags.DEFINE_string(
    "json_out", "gpu_qualify.json", "Where the JSON report goes.")
_QUICK = flags.DEFINE_bool(
    "quick", False, "Small preset for CPU CI: V <= 1001, 2 shards, a tiny "
    "benchmark. Speed targets are not judged at that size.")
_CHECKS_FLAG = flags.DEFINE_list(
    "checks", list(_CHECKS), f"Checks to run, any of: {', '.join(_CHECKS)}.")
_VOCAB = flags.DEFINE_integer(
    "vocab", 129280, "Largest vocabulary of the identity checks and the "
    "benchmark (--quick: 1001).", lower_bound=8, upper_bound=dj.MAX_VOCAB)
_MAX_SHARDS = flags.DEFINE_integer(
    "max_shards", 8, "Largest mesh of the sharded identity check (capped by "
    "the local devices; --quick: 2).", lower_bound=1)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 8, "Emulated devices when JAX runs on CPU (XLA_FLAGS; "
    "--quick: 2); accelerators use their real devices.", lower_bound=1,
    upper_bound=64)
_ROUNDS = flags.DEFINE_integer(
    "rounds", 48, "Rounds of the verify_chain replay against the oracle "
    "(--quick: 16).", lower_bound=1)
_BENCH_REPEATS = flags.DEFINE_integer(
    "bench_repeats", 5, "--repeats of bench_core (--quick: 1).",
    lower_bound=1)
_BENCH_TIMEOUT = flags.DEFINE_integer(
    "bench_timeout_s", 1800, "Time limit of the benchmark subprocess.",
    lower_bound=1)
_STRICT = flags.DEFINE_bool(
    "strict_targets", False, "Exit 1 also when a speed target is missed.")
_MUTANT = flags.DEFINE_enum(
    "mutant", "none", ["none", "reciprocal", "ticket"],
    "Deliberately broken library, to show that the checks catch it: "
    "'reciprocal' rounds every reciprocal 1 ulp up (division fails); "
    "'ticket' moves one ticket in batched-mode dense allocations "
    "(oracle_allocation and rows_identity fail).")


def _checks_valid(names):
  return bool(names) and all(n in _CHECKS for n in names)


flags.register_validator(
    "checks", _checks_valid,
    message=f"--checks takes a non-empty list of: {', '.join(_CHECKS)}")
flags.register_validator(
    "json_out", lambda p: bool(p) and os.path.isdir(
        os.path.dirname(os.path.abspath(p))),
    message="--json_out needs a file path in an existing directory")

MODES = ("loop", "batched")


class Config:
  """The sizes of one run (the --quick preset or the flags)."""

  def __init__(self):
    quick = _QUICK.value
    present = lambda f: flags.FLAGS[f].present
    self.quick = quick
    self.vocab = (min(_VOCAB.value, 1001) if quick and not present("vocab")
                  else _VOCAB.value)
    self.max_shards = (2 if quick and not present("max_shards")
                       else _MAX_SHARDS.value)
    self.rounds = 16 if quick and not present("rounds") else _ROUNDS.value
    self.bench_repeats = (1 if quick and not present("bench_repeats")
                          else _BENCH_REPEATS.value)
    # Identity checks: vocabularies (7 leaves padding-only shards) and the
    # batch sizes compared with one row at a time.
    self.vocabs = sorted({7, min(1001, self.vocab), self.vocab})
    if quick:
      self.vocabs = [v for v in self.vocabs if v != 7] or [self.vocab]
    self.batches = (8,) if quick else (2, 3, 9)  # of the 9 rows
    self.ks = (1, 32) if quick else (1, 2, 5, 32)


def _log(msg):
  print(msg, flush=True)


def _same_bits(a, b):
  """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count)."""
  a, b = np.asarray(a), np.asarray(b)
  return (a.dtype == b.dtype and a.shape == b.shape
          and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                             np.ascontiguousarray(b).view(np.uint8)))


def _tree_same_bits(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(_same_bits(x, y) for x, y in zip(la, lb))


class Outcome:
  """What a check found: mismatch descriptions and details for the report."""

  def __init__(self):
    self.failures = []
    self.details = {}
    self.skip_reason = None

  def expect(self, ok, what):
    if not ok:
      self.failures.append(what)
    return ok


# ---------------------------------------------------------------------------
# Checks. Each takes (Config, Outcome) and records into the Outcome.


def check_no_bridge(cfg, out):
  del cfg
  for name in ("dyadic_jax.bridge", "dyadic_jax.wire", "zmq"):
    out.expect(name not in sys.modules, f"{name} was imported")
  out.details["imported"] = sorted(
      m for m in sys.modules if m.split(".")[0] in ("zmq",)
      or m.startswith(("dyadic_jax.bridge", "dyadic_jax.wire")))


def check_fp64_int64(cfg, out):
  del cfg
  with jax.enable_x64(True):
    tiny = jax.jit(lambda a, b: (a + b) - a)(jnp.float64(1.0),
                                             jnp.float64(2.0 ** -40))
    out.expect(tiny.dtype == jnp.float64 and float(tiny) == 2.0 ** -40,
               f"float64 (1 + 2^-40) - 1 = {float(tiny)!r} ({tiny.dtype})")
    x = np.linspace(-700.0, 700.0, 4001)
    e = np.asarray(jax.jit(jnp.exp)(x))
    rel = float(np.max(np.abs(e - np.exp(x)) / np.exp(x)))
    out.details["exp_f64_max_rel_err"] = rel
    out.expect(e.dtype == np.float64 and rel < 1e-14,
               f"float64 exp relative error {rel:.3g} (float32: ~1e-7, "
               "overflow past 88)")
    a = np.int64(2 ** 40 + 7)
    prod = jax.jit(lambda a: a * np.int64(2 ** 20 + 3))(a)
    out.expect(int(prod) == (2 ** 40 + 7) * (2 ** 20 + 3),
               f"int64 product {int(prod)}")
    gen = np.random.default_rng(0)
    u = gen.integers(0, 2 ** 64, size=(2, 4096), dtype=np.uint64)
    u[:, :4] = [[0, 1, 2 ** 64 - 1, 2 ** 63], [2 ** 64 - 1, 2 ** 64 - 1, 2, 3]]
    hi = np.asarray(jax.jit(draws.mulhi64)(u[0], u[1]))
    want = [(int(p) * int(q)) >> 64 for p, q in zip(u[0], u[1])]
    out.expect(hi.dtype == np.uint64 and hi.tolist() == want,
               "uint64 mulhi64 differs from Python integers")
    probs = np.full((1, 1000), 1e-3)
    p_fixed, total = dj.quantize_target(probs)
    out.expect(np.asarray(total).dtype == np.int64
               and int(total[0]) == sum(ref.quantize_target(probs[0])),
               "quantize_target's int64 total differs from the oracle")
    limbs_e = jnp.asarray([1.0, 0.5, 2.0 ** -70, 0.1, 0.0,
                           np.nextafter(1.0, 0)])
    hi_l, lo_l = jax.jit(weights.fixed_point_limbs)(limbs_e)
    for v, h, l in zip(np.asarray(limbs_e), np.asarray(hi_l),
                       np.asarray(lo_l)):
      s = Fraction(float(v)) * 2 ** 32
      out.expect(h == int(s) and l == int((s - int(s)) * 2 ** 32),
                 f"fixed-point limbs of {v!r} are not the exact floors")
  w, _ = dj.draft_weights(np.zeros((1, 4), np.float32))
  out.expect(w.dtype == np.float64, f"draft_weights dtype {w.dtype}")
  if not jax.config.jax_enable_x64:
    try:
      jax.jit(lambda x: dj.draft_weights(x)[1])(np.zeros((1, 4), np.float32))
      out.failures.append("an op staged into a 32-bit jit did not raise "
                          "X64Required (the x64 guard is inactive)")
    except dj.X64Required:
      pass
  out.details["x64_guard_checked"] = not jax.config.jax_enable_x64


def check_division(cfg, out):
  del cfg
  gen = np.random.default_rng(1)
  z = np.concatenate([
      2.0 ** gen.uniform(-40, 40, 16384), gen.uniform(1.0, 2.0 ** 21, 16384),
      [1.0, 3.0, 5.0, 7.0, 1 / 3, 129280.0, 2.0 ** 52 + 1, 2.0 ** -1022]])
  want = 1.0 / z
  vector_bad = 0
  lib_bad = 0
  with jax.enable_x64(True):
    lib = jax.jit(weights.reciprocal)
    vec = jax.jit(lambda z: 1.0 / z)
    for shape in [(z.size,), (8, z.size // 8), (z.size // 4, 4)]:
      n = int(np.prod(shape))
      zz, ww = z[:n].reshape(shape), want[:n].reshape(shape)
      lib_bad += int(np.sum(np.asarray(lib(zz)) != ww))
      vector_bad += int(np.sum(np.asarray(vec(zz)) != ww))
  backend = jax.default_backend()
  out.details.update(values=int(z.size), library_mismatches=lib_bad,
                     vector_division_mismatches=vector_bad,
                     library_branch=("scalar loop" if backend == "cpu"
                                     else "vector 1.0 / z"))
  out.expect(lib_bad == 0, f"weights.reciprocal: {lib_bad} quotients are "
             "not correctly rounded")
  if backend != "cpu":
    out.expect(vector_bad == 0, f"vector 1.0 / z: {vector_bad} quotients "
               "are not correctly rounded on this accelerator")


def _modes():
  return [(m, rowwise.rows(m)) for m in MODES]


def check_oracle_allocation(cfg, out):
  rows = adversarial.allocation_rows()
  w = adversarial.pad_rows([r for _, r in rows], 512)
  names = [n for n, _ in rows]
  ks = cfg.ks
  dense_want = [ref.allocate_dense(x) for x in w]
  sparse_want = {k: [ref.allocate_sparse(x, k) for x in w] for k in ks}
  large = None
  if not cfg.quick:
    gen = np.random.default_rng(7)
    large = adversarial.normalized(np.exp(gen.normal(size=cfg.vocab) * 3))
    large_want = (ref.allocate_dense(large), ref.allocate_sparse(large, 32))
  for mode, scope in _modes():
    with scope:
      counts, status = (np.asarray(a) for a in dj.allocate_dense(w))
      for i, (c, s) in enumerate(dense_want):
        out.expect(int(status[i]) == s and counts[i].tolist() == c,
                   f"{mode}: dense {names[i]}")
      for k in ks:
        ids, cnt, n, st = (np.asarray(a) for a in dj.allocate_sparse(w, k))
        for i, want in enumerate(sparse_want[k]):
          got = (ids[i].tolist(), cnt[i].tolist(), int(n[i]), int(st[i]))
          out.expect(got == (want[0], want[1], want[2], int(want[3])),
                     f"{mode}: sparse k={k} {names[i]}")
      if large is not None:
        c, s = dj.allocate_dense(large[None])
        out.expect((np.asarray(c[0]).tolist(), int(s[0])) == large_want[0],
                   f"{mode}: dense random row V={cfg.vocab}")
        got = tuple(np.asarray(a[0]).tolist()
                    for a in dj.allocate_sparse(large[None], 32))
        want = large_want[1]
        out.expect(got == (want[0], want[1], want[2], int(want[3])),
                   f"{mode}: sparse k=32 random row V={cfg.vocab}")
    _log(f"    {mode}: {len(rows)} adversarial rows, dense and sparse k="
         f"{','.join(map(str, ks))}" + (f", one V={cfg.vocab} row"
                                         if large is not None else ""))
  out.details.update(rows=names, ks=list(ks),
                     large_vocab=None if large is None else cfg.vocab)


def _target_fixed(logits):
  """Library P rows of logits, compared row by row with the oracle."""
  probs, status = dj.target_probs(np.atleast_2d(logits))
  p_fixed, _ = dj.quantize_target(probs)
  p_fixed, probs = np.asarray(p_fixed), np.asarray(probs)
  ok = bool(np.all(np.asarray(status) == dj.Status.OK)) and all(
      row.tolist() == ref.quantize_target(prow)
      for row, prow in zip(p_fixed, probs))
  return [[int(x) for x in row] for row in p_fixed], ok


def _bits(key, position, domain):
  return int(dj.draw64(dj.draw_key(key, position, domain)))


def check_oracle_verification(cfg, out):
  worst = Fraction(0)
  for name, (p, q) in adversarial.verification_cases().items():
    p_fixed, ok = _target_fixed(adversarial.logits_for(p / p.sum()))
    out.expect(ok, f"target grid of {name} differs from the oracle")
    p_fixed = p_fixed[0]
    dist = ref.verify_step_distribution(p_fixed, adversarial.counts_for(q))
    tv = ref.total_variation(dist, ref.target_distribution(p_fixed))
    worst = max(worst, tv)
    out.expect(tv <= Fraction(len(p) + 2, 2 ** 64),
               f"{name}: TV {float(tv):.3g} above (V + 2) 2^-64")
  out.details["worst_tv"] = float(worst)
  _log(f"    exact output distributions: worst TV {float(worst):.3g} "
       f"(bound (V + 2) 2^-64 = {12 / 2 ** 64:.3g})")

  gen = np.random.default_rng(12)
  v, depth = 12, 3
  p = gen.dirichlet(np.ones(v) * 0.7, size=depth + 1)
  q = np.where(gen.random((depth, v)) < 0.3, 0.0, p[:depth] + 0.05)
  logits = adversarial.logits_for(p)
  p_rows, ok = _target_fixed(logits)
  out.expect(ok, "replay target grid differs from the oracle")
  count_rows = [adversarial.counts_for(row) for row in q]
  drafts = [[ref.sample_counts(count_rows[i], int(gen.integers(0, dj.M)))
             for i in range(depth)] for _ in range(cfg.rounds)]
  anchor = 17
  want = []
  for r, draft in enumerate(drafts):
    key = dj.round_key(5, 0, r)
    want.append(ref.verify_chain_replay(
        p_rows, count_rows, draft,
        [_bits(key, anchor + i, dj.Domain.ACCEPT) for i in range(depth)],
        [_bits(key, anchor + i, dj.Domain.CORRECTION) for i in range(depth)],
        _bits(key, anchor + depth, dj.Domain.BONUS)))
  tp = gen.dirichlet(np.ones(9), size=64)
  tp[:, 4] = 0.0
  t_logits = adversarial.logits_for(tp / tp.sum(-1, keepdims=True))
  t_rows, ok = _target_fixed(t_logits)
  out.expect(ok, "sample_target grid differs from the oracle")
  t_keys = jax.vmap(lambda i: dj.rng_key(9, 0, 0, i, dj.Domain.TARGET_ONLY))(
      jnp.arange(64))
  t_want = [ref.sample_counts(row, (int(b) * sum(row)) >> 64)
            for row, b in zip(t_rows, np.asarray(dj.draw64(t_keys)))]
  for mode, scope in _modes():
    with scope:
      for rep, qobj in (("dense", dj.DenseQ(np.asarray(count_rows, np.int32))),
                        ("sparse", adversarial.sparse_q(count_rows))):
        for r, draft in enumerate(drafts):
          got = dj.verify_chain(logits, qobj, np.asarray(draft, np.int32),
                                dj.round_key(5, 0, r), anchor=anchor)
          out.expect((int(got[0]), int(got[1])) == want[r],
                     f"{mode}: verify_chain {rep} round {r}")
      tokens, _ = dj.sample_target(t_logits, t_keys)
      out.expect(np.asarray(tokens).tolist() == t_want,
                 f"{mode}: sample_target differs from the oracle replay")
    _log(f"    {mode}: {cfg.rounds} verify_chain rounds (dense, sparse) and "
         "64 target-only draws replayed")
  out.details.update(rounds=cfg.rounds,
                     accepted_counts=sorted({w[0] for w in want}))


class IdentityInputs(NamedTuple):
  """The rows every identity check runs on (one vocabulary)."""
  logits: np.ndarray    # float32[R, V]: adversarial.logit_rows, then random
                        # (R = 9, the rows of adversarial.weight_rows)
  t: np.ndarray         # float64[R] per-row temperatures
  bias: np.ndarray      # float32[R, V]
  keys: jax.Array       # TARGET_ONLY keys [R]
  w: np.ndarray         # float64[9, V] adversarial.weight_rows
  counts: np.ndarray    # int32[9, V] dense counts of w
  u: np.ndarray         # uint32[9] 24-bit draws
  rnd: adversarial.Round  # 6 requests, depth 3
  anchors: jax.Array    # int[6]
  k: int                # sparse support


@functools.lru_cache(maxsize=None)
def _identity_inputs(v):
  gen = np.random.default_rng(v)
  w = adversarial.weight_rows(v)
  rows = len(w)
  logits = (gen.normal(size=(rows, v)) * 3).astype(np.float32)
  logits[:4] = adversarial.logit_rows(v)
  with rowwise.rows("loop"):
    counts = np.asarray(dj.allocate_dense(w)[0])
    rnd = adversarial.round_requests(v)
  return IdentityInputs(
      logits=logits, t=gen.uniform(0.5, 1.5, rows),
      bias=gen.normal(size=(rows, v)).astype(np.float32),
      keys=jax.vmap(lambda i: dj.rng_key(4, 0, 0, i, dj.Domain.TARGET_ONLY))(
          jnp.arange(rows)),
      w=w, counts=counts, u=gen.integers(0, dj.M, len(w)).astype(np.uint32),
      rnd=rnd, anchors=jnp.arange(len(rnd.keys)) * 10, k=min(7, v))


def _verify_all(fn, rnd, q, anchors):
  """fn (a verify_chain) vmapped over the round's requests."""
  return jax.vmap(lambda t, q, x, key, a: fn(t, q, x, key, anchor=a))(
      rnd.target, q, rnd.tokens, rnd.keys, anchors)


def _ops(x, lib, rows, requests):
  """Every op of `lib` (dyadic_jax, or sharding with a mesh bound) on the
  first `rows` rows and `requests` requests of x: {name: outputs}."""
  r, q = slice(0, rows), slice(0, requests)
  rnd = adversarial.Round(
      x.rnd.target[q], dj.DenseQ(x.rnd.dense.counts[q]),
      dj.SparseQ(*(a[q] for a in x.rnd.sparse)), x.rnd.tokens[q],
      x.rnd.keys[q])
  return jax.tree.map(np.asarray, {
      "draft_weights": lib.draft_weights(x.logits[r], temperature=x.t[r],
                                         bias=x.bias[r]),
      "target_probs": lib.target_probs(x.logits[r]),
      "allocate_dense": lib.allocate_dense(x.w[r]),
      "allocate_sparse": lib.allocate_sparse(x.w[r], x.k),
      "sample_counts": lib.sample_counts(x.counts[r], x.u[r]),
      "propose_dense": lib.propose_dense(x.logits[r], x.u[r],
                                         temperature=x.t[r], bias=x.bias[r]),
      "propose_sparse": lib.propose_sparse(x.logits[r], x.u[r], x.k,
                                           temperature=x.t[r],
                                           bias=x.bias[r]),
      "sample_target": lib.sample_target(x.logits[r], x.keys[r]),
      "verify_chain dense": _verify_all(lib.verify_chain, rnd, rnd.dense,
                                        x.anchors[q]),
      "verify_chain sparse": _verify_all(lib.verify_chain, rnd, rnd.sparse,
                                         x.anchors[q]),
  })


@functools.lru_cache(maxsize=None)
def _one_at_a_time(v):
  """The reference of the identity checks: each row (request) alone.

  A single row runs the same program in both row modes, so this is the
  common answer every batch size, row mode and layout must reproduce.
  """
  x = _identity_inputs(v)
  sliced = lambda a, i: a[i:i + 1]
  per_row = []
  for i in range(len(x.w)):
    qi = min(i, len(x.rnd.keys) - 1)
    one = x._replace(
        logits=sliced(x.logits, i), t=sliced(x.t, i),
        bias=sliced(x.bias, i), keys=sliced(x.keys, i),
        w=sliced(x.w, i), counts=sliced(x.counts, i), u=sliced(x.u, i),
        rnd=jax.tree.map(lambda a, qi=qi: sliced(a, qi), x.rnd),
        anchors=sliced(x.anchors, qi))
    with rowwise.rows("loop"):
      per_row.append(_ops(one, dj, 1, 1))
  return per_row


def _expected(v, name, rows, requests):
  """The one-at-a-time reference of op `name` on a batch."""
  n = requests if name.startswith("verify_chain") else rows
  return jax.tree.map(lambda *xs: np.concatenate(xs),
                      *[r[name] for r in _one_at_a_time(v)[:n]])


def _batch_sizes(cfg, x):
  """(rows, requests) pairs of the rows_identity check."""
  return [(min(b, len(x.w)), min(b, len(x.rnd.keys))) for b in cfg.batches]


def check_rows_identity(cfg, out):
  compared = 0
  for v in cfg.vocabs:
    x = _identity_inputs(v)
    _one_at_a_time(v)
    for mode, scope in _modes():
      with scope:
        for rows, requests in _batch_sizes(cfg, x):
          for name, got in _ops(x, dj, rows, requests).items():
            out.expect(_tree_same_bits(got, _expected(v, name, rows,
                                                      requests)),
                       f"{mode}: {name} on {rows} rows ({requests} "
                       f"requests), V={v}")
            compared += 1
    _log(f"    V={v}: batches {cfg.batches} == one row at a time, modes "
         f"{', '.join(MODES)}")
  out.details.update(vocabs=cfg.vocabs, batches=list(cfg.batches),
                     comparisons=compared)


def _unpad(single, sharded):
  """The sharded output on the single output's ids (drops padding ids).

  Padding ids must hold zero mass; a nonzero one is returned whole so that
  the comparison fails.
  """
  single, sharded = np.asarray(single), np.asarray(sharded)
  if single.ndim and sharded.shape[-1] > single.shape[-1]:
    if np.any(sharded[..., single.shape[-1]:]):
      return sharded
    return sharded[..., :single.shape[-1]]
  return sharded


def _shard_counts(cfg):
  n_dev = jax.device_count()
  sizes = (2,) if cfg.quick and n_dev >= 2 else (1, 2, 4, 8)
  counts = [n for n in sizes if n <= min(n_dev, cfg.max_shards)]
  if not cfg.quick and n_dev <= cfg.max_shards and n_dev not in counts:
    counts.append(n_dev)
  return counts


class _Sharded:
  """The `sharding` ops with one mesh bound, shaped like `dyadic_jax`'s."""

  def __init__(self, mesh):
    for name in ("draft_weights", "target_probs", "allocate_dense",
                 "allocate_sparse", "sample_counts", "propose_dense",
                 "propose_sparse", "sample_target", "verify_chain"):
      setattr(self, name, functools.partial(getattr(sharding, name),
                                            mesh=mesh))


def check_sharded_identity(cfg, out):
  shards = _shard_counts(cfg)
  out.details.update(shards=shards, local_devices=jax.device_count())
  compared = 0
  for v in cfg.vocabs:
    x = _identity_inputs(v)
    rows, requests = len(x.w), len(x.rnd.keys)
    for mode, scope in _modes():
      with scope:
        for n in shards:
          got = _ops(x, _Sharded(sharding.vocab_mesh(n)), rows, requests)
          for name, value in got.items():
            want = _expected(v, name, rows, requests)
            out.expect(_tree_same_bits(want, jax.tree.map(_unpad, want,
                                                          value)),
                       f"{mode}: {name} on {n} shards, V={v}")
            compared += 1
      _log(f"    V={v} {mode}: 8 ops on {shards} shards == one row at a "
           "time on one device")
  out.details["comparisons"] = compared
  if jax.device_count() == 1:
    out.details["note"] = ("one local device: a 1-device mesh against the "
                           "direct call; rows_identity covers batch sizes "
                           "and row modes")


def check_benchmark(cfg, out, env):
  """bench_core in a subprocess: its asserts, figures and targets."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "bench_core.json")
    cmd = [sys.executable, "-m", "experiments.bench_core",
           f"--json_out={path}", f"--repeats={cfg.bench_repeats}"]
    if cfg.quick:
      cmd += [f"--vocab={min(cfg.vocab, 2000)}", "--requests=2", "--depth=2",
              "--ks=32"]
    else:
      cmd += [f"--vocab={cfg.vocab}"]
    out.details["command"] = " ".join(cmd[1:])
    _log("    $ python " + out.details["command"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=_REPO_ROOT)
    tail = []
    deadline = time.monotonic() + _BENCH_TIMEOUT.value
    for line in proc.stdout:
      line = line.rstrip("\n")
      tail = (tail + [line])[-40:]
      if line.strip():
        _log("    | " + line)
      if time.monotonic() > deadline:
        proc.kill()
        break
    try:
      rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      proc.kill()
      rc = proc.wait()
    out.details["returncode"] = rc
    if rc != 0:
      out.failures.append(f"bench_core exited {rc}: " + " / ".join(
          t for t in tail[-5:] if t.strip()))
      out.details["output_tail"] = tail
      return []
    with open(path) as f:
      record = json.load(f)
  out.details["results"] = record.get("results", [])
  out.details["backend"] = record.get("backend")
  return record.get("targets", [])


# ---------------------------------------------------------------------------


_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _install_mutant(name):
  """Breaks the library in one known way (--mutant); returns what it did."""
  if name == "reciprocal":
    exact = weights.reciprocal

    def reciprocal_1ulp_up(z):
      r = exact(z)
      return jnp.nextafter(r, jnp.full_like(r, jnp.inf))
    weights.reciprocal = reciprocal_1ulp_up
    allocation.reciprocal = reciprocal_1ulp_up
    return "weights.reciprocal rounds 1 ulp up"
  if name == "ticket":
    exact = allocation._allocate_dense  # pylint: disable=protected-access

    def moved_ticket(w, executor):
      counts, status = exact(w, executor)
      if rowwise.row_mode() != "batched" or w.ndim < 2 or w.shape[0] < 2:
        return counts, status
      # Row 0: one ticket from its largest count to the next id (mod V).
      row = counts[0]
      top = jnp.argmax(row)
      row = row.at[top].add(-1).at[(top + 1) % row.shape[-1]].add(1)
      return counts.at[0].set(row), status
    allocation._allocate_dense = moved_ticket  # pylint: disable=W0212
    return "batched allocate_dense moves one ticket in row 0"
  return None


def _platform():
  devices = jax.devices()
  return {
      "backend": jax.default_backend(),
      "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices],
      "device_count": len(devices),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
      "row_setting": rowwise.setting(),
      "row_mode_default": rowwise.row_mode(),
      "row_modes_in_jit_key": rowwise.jit_keyed(),
      "gather": collectives.GATHER,
      "x64_global": bool(jax.config.jax_enable_x64),
  }


def _jaxlib_version():
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    return jaxlib.__version__
  except (ImportError, AttributeError):  # pragma: no cover
    return None


def _run_check(name, fn, report, index, total, *args):
  _log(f"[{index}/{total}] {name}")
  out = Outcome()
  start, cpu = time.perf_counter(), time.process_time()
  try:
    extra = fn(*args, out)
  except Exception as e:  # pylint: disable=broad-except
    extra = None
    out.failures.append(f"{type(e).__name__}: {e}")
    out.details["traceback"] = traceback.format_exc().splitlines()[-12:]
  seconds = time.perf_counter() - start
  cpu = time.process_time() - cpu
  if out.skip_reason:
    status = "SKIP"
  else:
    status = "FAIL" if out.failures else "PASS"
  entry = {"name": name, "kind": "correctness", "status": status,
           "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
           "details": out.details}
  if out.failures:
    entry["failures"] = out.failures[:50]
    entry["failure_count"] = len(out.failures)
  if out.skip_reason:
    entry["reason"] = out.skip_reason
  report["checks"].append(entry)
  _log(f"    -> {status} ({seconds:.1f} s, cpu {cpu:.1f} s)" + (
      f": {len(out.failures)} failure(s), first: {out.failures[0]}"
      if out.failures else ""))
  return extra


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  cfg = Config()
  wall = time.perf_counter()
  bench_env = dict(os.environ)
  report = {"command": " ".join(sys.argv), "quick": cfg.quick,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": {"vocabs": cfg.vocabs, "max_shards": cfg.max_shards,
                       "rounds": cfg.rounds, "batches": list(cfg.batches),
                       "bench_repeats": cfg.bench_repeats},
            "checks": []}
  report["platform"] = _platform()
  report["mutant"] = _install_mutant(_MUTANT.value)
  if report["mutant"]:
    _log(f"MUTANT: {report['mutant']} (checks are expected to fail)")
  p = report["platform"]
  _log(f"gpu_qualify: backend={p['backend']} devices={p['device_count']} "
       f"({p['devices'][0]}) jax={p['jax']} python={p['python']} "
       f"quick={cfg.quick} vocabs={cfg.vocabs}")
  names = [n for n in _CHECKS if n in _CHECKS_FLAG.value]
  fns = {"no_bridge": check_no_bridge, "fp64_int64": check_fp64_int64,
         "division": check_division,
         "oracle_allocation": check_oracle_allocation,
         "oracle_verification": check_oracle_verification,
         "rows_identity": check_rows_identity,
         "sharded_identity": check_sharded_identity}
  for i, name in enumerate(names, 1):
    if name == "benchmark":
      targets = _run_check(name, lambda cfg, out: check_benchmark(
          cfg, out, bench_env), report, i, len(names), cfg) or []
      for t in targets:
        entry = {"name": f"target: {t.get('target')}", "kind": "performance",
                 "details": {"detail": t.get("detail")}}
        if cfg.quick:
          entry.update(status="SKIP", reason="--quick sizes are too small "
                       f"to judge speed targets (measured: {t.get('detail')})")
        else:
          entry["status"] = "PASS" if t.get("pass") else "FAIL"
        report["checks"].append(entry)
        _log(f"    {entry['status']:4s} {entry['name']} ({t.get('detail')})")
    else:
      _run_check(name, fns[name], report, i, len(names), cfg)

  counts = {s: sum(c["status"] == s for c in report["checks"])
            for s in ("PASS", "FAIL", "SKIP")}
  failed = [c["name"] for c in report["checks"] if c["status"] == "FAIL" and (
      c["kind"] == "correctness" or _STRICT.value)]
  report["summary"] = counts
  report["exit_status"] = 1 if failed else 0
  report["wall_s"] = round(time.perf_counter() - wall, 1)
  path = os.path.abspath(_JSON_OUT.value)
  with open(path, "w") as f:
    json.dump(report, f, indent=2, default=str)
  _log("\n" + "\n".join(f"  {c['status']:4s}  {c['name']}"
                        for c in report["checks"]))
  _log(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, "
       f"{counts['SKIP']} skipped in {report['wall_s']} s; report: {path}")
  if failed:
    _log(f"FAILED: {', '.join(failed)}")
  return report["exit_status"]


def _set_cpu_devices():
  """Emulated CPU devices: XLA_FLAGS must be set before JAX starts a backend."""
  n = _CPU_DEVICES.value
  if _QUICK.value and not flags.FLAGS["cpu_devices"].present:
    n = 2
  flag = f"--xla_force_host_platform_device_count={n}"
  current = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in current:
    os.environ["XLA_FLAGS"] = (current + " " + flag).strip()


def _main(argv):
  _set_cpu_devices()
  return main(argv)


if __name__ == "__main__":
  app.run(_main)
