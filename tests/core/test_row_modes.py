"""The row-mode switch: DYADIC_JAX_ROWS, the `rows` scope, the jit key.

The "batched" mode is what accelerators run; this file shows that CPU
really runs it when asked (a different program), that jit caches never
serve a program traced in the other mode, and that both modes give the
same bits on shapes where XLA CPU picks different kernels for a batch than
for a row.
"""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dyadic_jax as dj
from dyadic_jax import qcheck
from dyadic_jax import rowops
from dyadic_jax import rowwise
from dyadic_jax import weights


def _recording_jit():
  """A jitted row op whose body records the row shapes it is traced with."""
  traced = []

  def body(x):
    traced.append(x.shape)
    return x * 2

  return jax.jit(lambda x: rowwise.map_rows(body, x, core_ndims=(1,))), traced


def _run_python(code, mode):
  env = dict(os.environ)
  env.pop(rowwise.ROWS_ENV, None)
  if mode is not None:
    env[rowwise.ROWS_ENV] = mode
  return subprocess.run([sys.executable, "-c", code], env=env,
                        capture_output=True, text=True, timeout=120,
                        check=False)


_PRINT_MODE = ("from dyadic_jax import rowwise; "
               "print(rowwise.setting(), rowwise.row_mode())")


@pytest.mark.parametrize("env,want", [
    (None, "auto loop"), ("loop", "loop loop"),
    ("batched", "batched batched")])
def test_environment_variable_sets_the_mode(env, want):
  out = _run_python(_PRINT_MODE, env)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split()[-2:] == want.split()


def test_bad_environment_value_is_refused_at_import():
  out = _run_python("import dyadic_jax", "fast")
  assert out.returncode != 0
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("ValueError: environment variable DYADIC_JAX_ROWS")
  assert "'fast'" in last and "auto, loop, batched" in last


def test_bad_scope_value_is_refused():
  with pytest.raises(ValueError, match="scope: row mode 'fast'"):
    with rowwise.scope("fast"):
      pass
  assert rowwise.setting() in rowwise.SETTINGS


def test_scope_nests_and_restores():
  outer = rowwise.setting()
  with rowwise.scope("batched") as mode:
    assert mode == "batched" and rowwise.row_mode() == "batched"
    with rowwise.scope("loop") as inner:
      assert inner == "loop" and rowwise.setting() == "loop"
    assert rowwise.setting() == "batched"
  assert rowwise.setting() == outer


@pytest.mark.qualify
def test_jit_cache_is_keyed_on_the_mode():
  f, traced = _recording_jit()
  x = np.ones((3, 5), np.float32)
  for mode in ("loop", "batched", "loop", "batched"):
    with rowwise.scope(mode):
      np.testing.assert_array_equal(f(x), 2 * x)
  # One trace per mode, each with its own row shape; the repeats hit the
  # cache of their own mode.
  assert traced == [(5,), (3, 5)]
  assert rowwise.jit_keyed()  # this JAX has jax.make_user_context


def test_fallback_without_user_context_clears_caches(monkeypatch):
  monkeypatch.setattr(rowwise, "_SETTING",
                      rowwise._make_context("auto", keyed=False))
  assert not rowwise.jit_keyed()
  f, traced = _recording_jit()
  x = np.ones((3, 5), np.float32)
  for mode in ("loop", "batched", "loop"):
    with rowwise.scope(mode):
      np.testing.assert_array_equal(f(x), 2 * x)
  assert traced == [(5,), (3, 5), (5,)]


def _reduction_results(text):
  """Result types of the reductions (row max, row sums) in a StableHLO
  program."""
  return {line.rsplit("->", 1)[1].strip() for line in text.splitlines()
          if "stablehlo.reduce(" in line}


def test_modes_trace_different_programs():
  x = jnp.zeros((4, 1000), jnp.float32)
  programs = {}
  for mode in ("loop", "batched"):
    with rowwise.scope(mode), jax.enable_x64(True):
      programs[mode] = weights._target_probs.lower(
          x, rowops.LOCAL).as_text()
  loop, batched = programs["loop"], programs["batched"]
  # Loop: a while loop over the 4 rows, each reduction yields one row's
  # scalar. Batched: every reduction yields the whole batch's [4].
  assert "stablehlo.while" in loop
  # (The (f32, i32) pair is the row max beside its NaN flag.)
  assert _reduction_results(loop) == {
      "tensor<f32>", "tensor<f64>", "tensor<i32>",
      "(tensor<f32>, tensor<i32>)", "(tensor<i1>, tensor<i64>)"}
  assert _reduction_results(batched) == {
      "tensor<4xf32>", "tensor<4xf64>", "tensor<4xi32>",
      "(tensor<4xf32>, tensor<4xi32>)", "(tensor<4xi1>, tensor<4xi64>)"}


# Shapes on both sides of the batch size where XLA CPU hands a fused
# elementwise pass to a library kernel (about 5,000 elements): a batch may
# take that kernel while its rows do not.
@pytest.mark.qualify
@pytest.mark.parametrize("rows,v", [
    (8, 1000),            # by default: several scan blocks
    # k = V, 16 rows (verify_chain at depth 15) and the full vocabulary:
    # --runslow.
    pytest.param(3, 7, marks=pytest.mark.slow),
    pytest.param(16, 1000, marks=pytest.mark.slow),
    pytest.param(2, dj.DEFAULT_VOCAB, marks=pytest.mark.slow)])
def test_modes_give_the_same_bits(rows, v):
  rng = np.random.default_rng(rows * v)
  logits = (rng.normal(size=(rows, v)) * 4).astype(np.float32)
  logits[0, : v // 2] = -np.inf
  bias = rng.normal(size=(rows, v)).astype(np.float32)
  keys = jax.vmap(lambda i: dj.rng_key(4, 0, 0, i, dj.Domain.TARGET_ONLY))(
      jnp.arange(rows))
  depth = rows - 1
  draws = jnp.asarray(rng.integers(0, dj.M, rows), jnp.uint32)

  def ops():
    w, _ = dj.draft_weights(logits, temperature=0.7, bias=bias)
    out = {"draft_weights": dj.draft_weights(logits, temperature=0.7,
                                             bias=bias),
           "target_probs": dj.target_probs(logits),
           "allocate_dense": dj.allocate_dense(w),
           "allocate_sparse": dj.allocate_sparse(w, min(16, v)),
           "sample_target": dj.sample_target(logits, keys)}
    counts, _ = out["allocate_dense"]
    out["sample_counts"] = dj.sample_counts(counts, draws)
    out["propose_dense"] = dj.propose_dense(logits, draws, temperature=0.7,
                                            bias=bias)
    out["propose_sparse"] = dj.propose_sparse(logits, draws, min(16, v),
                                              temperature=0.7, bias=bias)
    values = dj.counts_to_q(counts)
    out["check_dense"] = qcheck.check_dense(values, out["propose_dense"][2],
                                        draws, vocab=v)
    if depth:
      draft = jnp.argmax(counts[:depth], -1).astype(jnp.int32)
      out["verify_chain"] = dj.verify_chain(
          logits, dj.DenseQ(counts[:depth]), draft, dj.round_key(1, 2, 3))
    return jax.tree.map(np.asarray, out)

  with rowwise.scope("loop"):
    loop = ops()
  with rowwise.scope("batched"):
    batched = ops()
  for name in loop:
    chex.assert_trees_all_equal(loop[name], batched[name], strict=True)
  # And both equal the ops on one row at a time.
  for i in range(rows):
    row, _ = dj.draft_weights(logits[i:i + 1], temperature=0.7,
                              bias=bias[i:i + 1])
    np.testing.assert_array_equal(np.asarray(row)[0],
                                  loop["draft_weights"][0][i])


def _chains(rng, batch, depth, v, spread):
  """Chains whose q is near the target's rows, so they stop everywhere."""
  target = (rng.normal(size=(batch, depth + 1, v)) * 3).astype(np.float32)
  draft = target[:, :depth] + (rng.normal(size=(batch, depth, v))
                               * spread).astype(np.float32)
  w, _ = dj.draft_weights(draft)
  counts, _ = dj.allocate_dense(w)
  keys = jax.vmap(lambda r: dj.round_key(5, 0, r))(jnp.arange(batch))
  u = dj.draw24(jax.vmap(jax.vmap(dj.draw_key, in_axes=(None, 0, None)),
                         in_axes=(0, None, None))(
                             keys, jnp.arange(depth) + 3, dj.Domain.PROPOSAL))
  tokens = dj.sample_counts(counts, u)
  return target, np.array(counts), np.array(tokens), keys


@pytest.mark.qualify
# V = 1001 (several scan blocks) by default; V = 7 under --runslow.
@pytest.mark.parametrize("v", [pytest.param(7, marks=pytest.mark.slow), 1001])
def test_walked_chains_equal_the_batched_summaries(v):
  # Loop mode walks each chain and never normalizes rows past its first
  # rejection (verification.walk_chains); batched mode summarizes every
  # row. Same bits at every stopping position (0..D, D = bonus), D = 0,
  # refused target and q rows, dense and sparse q.
  rng = np.random.default_rng(v)
  depth, batch = 4, 48
  target, counts, tokens, keys = _chains(rng, batch, depth, v, spread=0.8)
  target[1, 2, 3] = np.nan                    # a refused target row
  counts[2, 1, 0] = -5                        # a NEGATIVE q row
  counts[3, 3, 0] += 7                        # WRONG_MASS in the last row
  tokens[4, 0] = (np.asarray(counts[4, 0]) == 0).argmax()  # c_x = 0
  with jax.enable_x64(True):
    s_ids, s_counts, s_n, _ = dj.allocate_sparse(
        dj.draft_weights(target[:, :depth])[0], min(8, v))
  sparse = dj.SparseQ(s_ids, s_counts, s_n)
  s_tokens = np.take_along_axis(np.asarray(s_ids), np.zeros(
      (batch, depth, 1), np.int64), -1)[..., 0]
  cases = {"dense": (target, dj.DenseQ(counts), tokens),
           "sparse": (target, sparse, s_tokens),
           "depth 0": (target[:, :1], None, tokens[:, :0])}
  for name, (t, q, x) in cases.items():
    out = {}
    for mode in ("loop", "batched"):
      with rowwise.scope(mode):
        out[mode] = jax.tree.map(np.asarray, dj.verify_batch(
            t, q, x, keys, np.arange(batch) * 10))
    chex.assert_trees_all_equal(out["loop"], out["batched"], strict=True)
    accepted, _, status = out["loop"]
    if name == "dense":
      # The harness reaches every stopping position and both refusals.
      assert set(accepted[status == 0]) == set(range(depth + 1)), accepted
      assert status[1] == dj.Status.NAN and status[2] == dj.Status.NEGATIVE
      assert status[3] == dj.Status.WRONG_MASS
