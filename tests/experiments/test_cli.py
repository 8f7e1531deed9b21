"""Bad flags fail at parse time: one line, exit status 2, before JAX starts.

Every experiment is run as a user runs it (`python -m experiments.X`, a
fresh process) with a bad value. The error must be one line on stderr,
name the flag, carry no traceback, and come before any heavy work: the
process must not even import JAX (`python -X importtime` lists every module
it imported), except bench_sharding, whose flags partly live in
bench_core, which imports JAX; there the bound is "nothing compiled"
(JAX_LOG_COMPILES=1 logs every compilation). What only the machine can say
is checked there too, before JAX: a keys folder that cannot be loaded, a
port another process holds or that does not exist (issue 29: each was a
traceback after JAX had started, or a READY line naming the wrong port).
No test here reads a clock.
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

import dyadic_jax as dj

from tests import paths  # pylint: disable=g-import-not-at-top
from tests.paths import ROOT as _ROOT  # pylint: disable=g-import-not-at-top

# (experiment, bad flags, the flag the error must name)
_BAD = [
    # The list for the main job.
    ("pp1_pipeline", ["--depth=0"], "depth"),
    ("pp1_pipeline", ["--depth=-1"], "depth"),
    ("pp1_pipeline", ["--requests=0"], "requests"),
    ("pp1_pipeline", ["--vocab=1"], "vocab"),
    ("pp1_pipeline", ["--seed=-5"], "seed"),
    ("pp1_pipeline", ["--check_samples=0"], "check_samples"),
    ("pp1_pipeline", ["--inject_faults=2"], "inject_faults"),
    ("pp1_pipeline", ["--verifier_devices=0"], "verifier_devices"),
    ("pp1_pipeline", ["--timeout=0"], "timeout"),
    ("pp1_pipeline", ["--tokens=0"], "tokens"),
    ("pp1_pipeline", ["--tokens=-1"], "tokens"),
    ("pp1_pipeline", ["--alpha=5"], "alpha"),
    # ... and the rest of its flags.
    ("pp1_pipeline", ["--alpha=nan"], "alpha"),
    ("pp1_pipeline", ["--timeout=inf"], "timeout"),
    ("pp1_pipeline", ["--closeness=nan"], "closeness"),
    ("pp1_pipeline", ["--k=0"], "k"),
    ("pp1_pipeline", ["--model=toy", "--vocab=64", "--k=65"], "k"),
    ("pp1_pipeline", ["--check_distribution", "--k=17"], "k"),
    ("pp1_pipeline", ["--q=greedy"], "q"),
    ("pp1_pipeline", ["--inject_faults=0.1", "--encrypt"], "encrypt"),
    ("pp1_pipeline", ["--q=bogus"], "q"),
    ("pp1_pipeline", ["--repetition_penalty=0.5"], "repetition_penalty"),
    ("pp1_pipeline", ["--grammar_modulus=1"], "grammar_modulus"),
    ("pp1_pipeline", ["--model_seed=-1"], "model_seed"),
    ("pp1_pipeline", ["--check_vocab=1"], "check_vocab"),
    ("pp1_pipeline", ["--requests=8", "--check_samples=4"], "check_samples"),
    ("pp1_pipeline", ["--mutant=uniform_q"], "mutant"),
    ("pp1_pipeline", ["--kill_worker_at=-1"], "kill_worker_at"),
    ("pp1_pipeline", ["--in_flight=3"], "in_flight"),
    ("pp1_pipeline", ["--check_distribution", "--kill_worker_at=2"],
     "kill_worker_at"),
    ("pp1_pipeline", ["--multiprocess", "--verifier_devices=4"],
     "verifier_devices"),
    ("pp1_pipeline", ["--verifier_requests=0"], "verifier_requests"),
    ("pp1_pipeline", ["--verifier_devices=4", "--verifier_requests=3"],
     "verifier_requests"),
    ("pp1_pipeline", ["--multiprocess", "--verifier_requests=2"],
     "verifier_requests"),
    ("pp1_pipeline", ["--transport=udp"], "transport"),
    ("pp1_pipeline", ["--model=toy", "--q=dense", "--worker_ranks=2"],
     "verifier_ranks"),
    ("pp1_pipeline", ["--verifier_ranks=5"], "verifier_ranks"),
    ("pp1_pipeline", ["--multiprocess", "--verifier_ranks=2"],
     "verifier_ranks"),
    ("pp1_pipeline", ["--verifier_ranks=2", "--verifier_devices=2"],
     "verifier_devices"),
    ("pp1_pipeline", ["--fault_link=1"], "fault_link"),
    ("pp1_pipeline", ["--fault_kinds=drop,melt"], "fault_kinds"),
    ("pp1_pipeline", ["--worker_bug=shard_mass"], "shard_mass"),
    ("pp1_pipeline", ["--json_out=/nonexistent/dir/x.json"], "json_out"),
    ("pp1_pipeline", ["--plot_out=/nonexistent/dir/x.png"], "plot_out"),
    ("pp1_pipeline", ["--rank=1"], "rank"),
    ("pp1_pipeline", ["--depth=five"], "depth"),
    ("pp1_pipeline", ["--nosuchflag=1"], "nosuchflag"),
    ("pp1_pipeline", ["depth=0"], "depth=0"),        # a stray argument
    ("bridge_worker", ["--depth=0"], "depth"),
    ("bridge_worker", ["--address=localhost:5555"], "address"),
    ("bridge_worker", ["--vocab=16", "--k=32"], "k"),
    ("bridge_worker", ["--closeness=2"], "closeness"),
    ("bridge_worker", ["--worker_ranks=2"], "coordinator"),
    ("bridge_worker", ["--rank=1"], "rank"),
    ("bench_rank_links", ["--link_gbps=0"], "link_gbps"),
    ("wire_sizes", ["--link_ranks=1"], "link_ranks"),
    ("round_demo", ["--vocab=16", "--k=17"], "k"),
    ("round_demo", ["--prefix_token=-1"], "prefix_token"),
    ("round_demo", ["--vocab=64", "--prefix_token=64"], "prefix_token"),
    ("round_demo", ["--check_samples=-1"], "check_samples"),
    ("round_demo", ["--alpha=0"], "alpha"),
    ("round_demo", ["--seed=-1"], "seed"),
    ("acceptance", ["--ks=16,0"], "ks"),
    ("acceptance", ["--ks=16,x"], "ks"),
    ("acceptance", ["--closeness=0.9,1.5"], "closeness"),
    ("acceptance", ["--contexts=0"], "contexts"),
    ("acceptance", ["--chunk=0"], "chunk"),
    ("acceptance", ["--empirical_rounds=-1"], "empirical_rounds"),
    ("acceptance", ["--grammar_modulus=1"], "grammar_modulus"),
    ("acceptance", ["--plot_out=/nonexistent/dir/x.png"], "plot_out"),
    ("selection_bias", ["--samples=1"], "samples"),
    ("selection_bias", ["--threshold=3/2"], "threshold"),
    ("selection_bias", ["--threshold=half"], "threshold"),
    ("selection_bias", ["--ci_level=1"], "ci_level"),
    ("selection_bias", ["--alpha=0"], "alpha"),
    ("wire_sizes", ["--ks=0"], "ks"),
    ("wire_sizes", ["--fleet=4,0"], "fleet"),
    ("wire_sizes", ["--round_ms=0"], "round_ms"),
    ("wire_sizes", ["--link_gbps=-40"], "link_gbps"),
    ("wire_sizes", ["--depth=0"], "depth"),
    ("bench_sharding", ["--shards=1,16"], "shards"),
    # Issue 29: contradictions and outputs that used to run silently, and
    # the benchmarks that used absl's two-line FATAL after importing JAX.
    ("pp1_pipeline", ["--q=dense", "--k=32"], "k"),
    ("pp1_pipeline", ["--timeout_max=0"], "timeout_max"),
    ("bridge_worker", ["--address=tcp://127.0.0.1:abc", "--insecure"],
     "address"),
    ("bench_core", ["--vocab=0"], "vocab"),
    ("bench_core", ["--repeats=0"], "repeats"),
    ("bench_core", ["--ks=0"], "ks"),
    ("bench_core", ["--json_out=/nonexistent/dir/x.json"], "json_out"),
    ("bench_core", ["--hf_python=/nonexistent/bin/python"], "hf_python"),
    ("bench_core", ["stray"], "stray"),
    ("bench_bridge", ["--depth=0"], "depth"),
    ("bench_bridge", ["--transports=udp"], "transports"),
    ("bench_bridge", ["--link_gbps=0"], "link_gbps"),
    ("bench_bridge", ["--vocab=64", "--k=65"], "k"),
    ("bench_curve", ["--k=0"], "k"),
    ("bench_curve", ["--vocab=64", "--k=65"], "k"),
    ("bench_curve", ["--dense_messages=0"], "dense_messages"),
    ("bench_bridge", ["--json_out=/nonexistent/dir/x.json"], "json_out"),
    ("bench_sharding", ["--json_out=/nonexistent/dir/x.json"], "json_out"),
    ("record_figures", ["--commands=pp1_pipeline,round_demo"], "commands"),
    ("record_figures", ["--commands="], "commands"),
    ("record_figures", ["--norecord"], "norecord"),
    ("record_figures", ["--figures_json=/nonexistent/dir/x.json"],
     "figures_json"),
    ("record_figures", ["--plot_out=/nonexistent/dir/x.png"], "plot_out"),
    ("train_pair", ["--vocab=100"], "vocab"),
    ("train_pair", ["--seq_len=600"], "seq_len"),
    ("train_pair", ["--target_heads=3"], "target_heads"),
    ("train_pair", ["--draft_d_model=130", "--draft_heads=2"], "draft_heads"),
    ("train_pair", ["--lr=0"], "lr"),
    ("train_pair", ["--warmup=500", "--steps=100"], "warmup"),
    ("train_pair", ["--time_budget_s=-1"], "time_budget_s"),
    ("train_pair", ["--init_from=/nonexistent/pair"], "init_from"),
    ("train_pair", ["--corpus_root=/nonexistent/dir"], "corpus_root"),
    # Issue 40: found only after training (the pair lost), or a checkpoint
    # replaced without a word.
    ("train_pair", ["--output_dir=README.md"], "output_dir"),
    ("train_pair", ["--output_dir=README.md/pair"], "output_dir"),
    ("train_pair", ["--output_dir=dyadic_jax/models/checkpoints/stdlib"],
     "force"),
    ("train_pair", ["--warmup=20", "--steps=20"], "warmup"),
    ("bench_pair", ["--model=/nonexistent/pair"], "model"),
    ("adaptive_depth", ["--q=bogus"], "q"),
    ("adaptive_depth", ["--max_depth=0"], "max_depth"),
    ("adaptive_depth", ["--model=/nonexistent/pair"], "model"),
    ("adaptive_depth", ["--prior_weight=0"], "prior_weight"),
]


def _command(module, args):
  return [sys.executable, "-X", "importtime", "-m", f"experiments.{module}",
          *args]


def _env(**env):
  return paths.subprocess_env(**env)


def _run(module, args, **env):
  return subprocess.run(_command(module, args), cwd=_ROOT, env=_env(**env),
                        capture_output=True, text=True, timeout=300)


def _split(stderr):
  """(modules imported, the other stderr lines) of an -X importtime run."""
  modules, lines = set(), []
  for line in stderr.splitlines():
    if line.startswith("import time:"):
      modules.add(line.rsplit("|", 1)[-1].strip())
    elif line.strip():
      lines.append(line)
  return modules, lines


@pytest.mark.parametrize("module,args,flag", _BAD,
                         ids=[f"{m}:{' '.join(a)}" for m, a, _ in _BAD])
def test_bad_flag_is_one_line_at_parse_time(module, args, flag):
  run = _run(module, args, JAX_LOG_COMPILES="1")
  modules, lines = _split(run.stderr)
  assert run.returncode == 2, run.stdout + run.stderr
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"{module}: "), lines[0]
  assert re.search(rf"(--|\b|'){re.escape(flag)}\b", lines[0]), lines[0]
  assert "Traceback" not in run.stderr and not run.stdout
  if module == "bench_sharding":
    assert "Compiling" not in run.stderr and "compil" not in lines[0]
  else:
    assert "jax" not in modules, f"{module} imported JAX before failing"


def _assert_one_line_before_jax(run, module, flag):
  modules, lines = _split(run.stderr)
  assert run.returncode == 2, run.stdout + run.stderr
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"{module}: "), lines[0]
  assert f"--{flag}" in lines[0], lines[0]
  assert "Traceback" not in run.stderr and not run.stdout
  assert "jax" not in modules, f"{module} imported JAX before failing"


@pytest.fixture(name="keys_dirs")
def _keys_dirs(tmp_path):
  """(missing, empty, secret only) key folders."""
  empty, partial = tmp_path / "empty", tmp_path / "partial"
  empty.mkdir()
  partial.mkdir(mode=0o700)
  (partial / "secret.key").write_text("00" * 32 + "\n")
  os.chmod(partial / "secret.key", 0o600)
  return tmp_path / "missing", empty, partial


@pytest.mark.parametrize("module", ["pp1_pipeline", "bridge_worker"])
@pytest.mark.parametrize("which", ["missing", "empty", "partial_encrypt"])
def test_an_unusable_keys_dir_is_refused_at_parse_time(keys_dirs, module,
                                                       which):
  """Issue 29: a missing or empty --keys_dir (or one without the CURVE
  keys of --encrypt) was a FileNotFoundError traceback after JAX started
  and compiled (the pipeline: once its worker had started and died)."""
  folder = dict(zip(["missing", "empty", "partial_encrypt"], keys_dirs))[
      which]
  args = [f"--keys_dir={folder}"] + (
      ["--encrypt"] if which == "partial_encrypt" else [])
  run = _run(module, args)
  _assert_one_line_before_jax(run, module, "keys_dir")
  assert str(folder) in run.stderr
  assert "dyadic_jax.bridge.keys" in run.stderr     # how to make them


@pytest.mark.parametrize("defect", ["zero_secret", "patterned_secret",
                                    "bad_curve_key"])
def test_a_weak_secret_or_a_bad_curve_key_is_refused_at_parse_time(
    tmp_path, defect):
  """Issue 27: an all-zero secret was accepted, and a CURVE key file that
  is no key was a traceback after JAX had started."""
  from dyadic_jax.bridge import keys  # pylint: disable=g-import-not-at-top
  folder = keys.make(tmp_path / "keys")
  if defect == "bad_curve_key":
    (folder / "worker.curve").write_text("not a key\n")
  else:
    secret = bytes(32) if defect == "zero_secret" else b"0123" * 8
    (folder / "secret.key").write_text(secret.hex() + "\n")
  run = _run("bridge_worker", [f"--keys_dir={folder}"])
  _assert_one_line_before_jax(run, "bridge_worker", "keys_dir")
  assert ("CURVE key" if defect == "bad_curve_key" else "distinct") in (
      run.stderr)
  with pytest.raises(ValueError):
    keys.load(folder, "worker")


def _tiny_checkpoint(folder):
  """A loadable pair in `folder`: the shipped tokenizer (V = 4096) and
  two small transformers (a few hundred KB)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from dyadic_jax.models import checkpoint, transformer  # pylint: disable=g-import-not-at-top
  from experiments import cli  # pylint: disable=g-import-not-at-top
  folder.mkdir()
  shipped = cli.model_dir("stdlib")
  shutil.copy(shipped / checkpoint.TOKENIZER_FILE, folder)
  configs = {role: transformer.Config(vocab=4096, d_model=8, n_layers=1,
                                      n_heads=2, d_ff=8, max_len=32)
             for role in ("target", "draft")}
  for (role, config), name in zip(configs.items(), (checkpoint.TARGET_FILE,
                                                    checkpoint.DRAFT_FILE)):
    checkpoint.save_params(folder / name,
                           transformer.init(config, jax.random.key(0)))
  checkpoint.write_config(folder / checkpoint.CONFIG_FILE, {
      role: c.to_dict() for role, c in configs.items()})
  return folder


def _damage(folder, defect):
  """Damages checkpoint `folder`; returns what the error must name."""
  config = folder / "config.json"
  if defect == "truncated_weights":
    data = (folder / "target.safetensors").read_bytes()
    (folder / "target.safetensors").write_bytes(data[:len(data) // 2])
    return r"target\.safetensors is truncated: \d+ bytes, its header needs \d+"
  if defect == "missing_weights":
    (folder / "draft.safetensors").unlink()
    return r"draft\.safetensors is missing"
  if defect == "not_safetensors":
    (folder / "draft.safetensors").write_bytes(b"\xff" * 64)
    return r"draft\.safetensors is no safetensors file"
  if defect == "broken_config":
    config.write_text(config.read_text()[:-20])
    return r"config\.json: not readable JSON"
  if defect == "config_field":
    meta = json.loads(config.read_text())
    del meta["draft"]["d_ff"]
    config.write_text(json.dumps(meta))
    return r"config\.json: its draft has fields"
  if defect == "wrong_shape":
    meta = json.loads(config.read_text())
    meta["target"]["d_model"] = 16
    config.write_text(json.dumps(meta))
    return (r"target\.safetensors has \w+ of shape \(.*\), config\.json "
            r"says \(.*16.*\)")
  if defect == "missing_tokenizer":
    (folder / "tokenizer.json").unlink()
    return r"tokenizer\.json is missing"
  if defect == "broken_tokenizer":
    (folder / "tokenizer.json").write_text("{}")
    return r"tokenizer\.json is no tokenizer file"
  raise AssertionError(defect)


_DEFECTS = ["truncated_weights", "missing_weights", "not_safetensors",
            "broken_config", "config_field", "wrong_shape",
            "missing_tokenizer", "broken_tokenizer"]
# Every program that takes a trained pair, by its flag; each defect on the
# main job, the three on the others.
_TAKERS = [("pp1_pipeline", "model", d) for d in _DEFECTS] + [
    (m, f, d) for m, f in (("bridge_worker", "model"), ("bench_pair", "model"),
                           ("train_pair", "init_from"), ("export_hf", "model"))
    for d in ("truncated_weights", "broken_config", "missing_tokenizer")]


@pytest.mark.parametrize("module,flag,defect", _TAKERS,
                         ids=[f"{m}:{d}" for m, _, d in _TAKERS])
def test_a_damaged_checkpoint_is_refused_at_parse_time(tmp_path, module,
                                                       flag, defect):
  """Issue 40: a truncated weights file, a broken config.json or a missing
  tokenizer was a traceback 0.4 to 11 s in (after JAX had started). The
  flag's check reads config.json and the safetensors headers (no weight
  is loaded) and names the file in one line."""
  folder = _tiny_checkpoint(tmp_path / "pair")
  from experiments import cli  # pylint: disable=g-import-not-at-top
  assert cli.checkpoint_problem(str(folder)) is None
  want = _damage(folder, defect)
  # export_hf's --output_dir is required (a fresh folder, so it passes).
  extra = [f"--output_dir={tmp_path / 'hf'}"] if module == "export_hf" else []
  run = _run(module, [f"--{flag}={folder}", *extra])
  _assert_one_line_before_jax(run, module, flag)
  assert re.search(want, run.stderr), run.stderr
  assert str(folder) in run.stderr


def test_a_trained_pairs_context_error_names_the_numbers(tmp_path):
  """Issue 40: a pair trained with a small max_len refused the pipeline's
  defaults with no numbers in the error; it now gives the sum, the
  context and flags that fit."""
  folder = _tiny_checkpoint(tmp_path / "pair")          # max_len 32
  run = _run("pp1_pipeline", [f"--model={folder}"])
  _assert_one_line_before_jax(run, "pp1_pipeline", "prompt_tokens")
  assert ("--prompt_tokens=64 + --tokens=48 + --depth=5 + 1 = 118 exceeds "
          "the model's context, max_len 32 (its config.json); e.g. "
          "--prompt_tokens=16 --tokens=10 fit") in run.stderr, run.stderr
  run = _run("pp1_pipeline", [f"--model={folder}", "--check_distribution",
                              "--prompt_tokens=30"])
  _assert_one_line_before_jax(run, "pp1_pipeline", "prompt_tokens")
  assert "= 37 exceeds the model's context, max_len 32" in run.stderr
  assert "--prompt_tokens=25 fits" in run.stderr


def test_the_checkpoint_check_mirrors_the_library():
  """cli's checkpoint check (no JAX) expects what the loader loads."""
  # pylint: disable=g-import-not-at-top
  from dyadic_jax.models import checkpoint, transformer
  from experiments import cli
  # pylint: enable=g-import-not-at-top
  assert cli.CHECKPOINT_FILES == {"target": checkpoint.TARGET_FILE,
                                  "draft": checkpoint.DRAFT_FILE}
  assert cli.CHECKPOINT_CONFIG == checkpoint.CONFIG_FILE
  assert cli.CHECKPOINT_TOKENIZER == checkpoint.TOKENIZER_FILE
  for config in (transformer.Config(vocab=300, d_model=32, n_layers=3,
                                    n_heads=4, d_ff=48, max_len=96),
                 transformer.Config(vocab=2, d_model=2, n_layers=1,
                                    n_heads=1, d_ff=1, max_len=1)):
    assert cli.param_shapes(config.to_dict()) == transformer.init_shapes(
        config)
  assert cli.checkpoint_problem("stdlib") is None


def test_a_port_in_use_is_refused_at_parse_time():
  """Issue 29: the worker bound its port only after JAX had started and
  compiled, and a port another process holds was a ZMQError traceback."""
  with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    run = _run("bridge_worker", [f"--address=tcp://127.0.0.1:{port}",
                                 "--insecure"])
  _assert_one_line_before_jax(run, "bridge_worker", "address")
  assert "in use" in run.stderr


def test_the_worker_never_announces_an_address_it_did_not_bind():
  """Issue 29: --address=tcp://127.0.0.1:99999 printed READY with that
  address while libzmq listened on port 99999 - 65536. A port out of range
  is refused at parse time; READY names the endpoint actually bound."""
  proc = subprocess.Popen(
      _command("bridge_worker", ["--address=tcp://127.0.0.1:99999",
                                 "--insecure", "--vocab=64", "--k=8",
                                 "--depth=2", "--requests=1"]),
      cwd=_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  try:
    first = proc.stdout.readline()   # READY, or "" once the process ends
  finally:
    if proc.poll() is None:
      proc.kill()
    _, stderr = proc.communicate(timeout=300)
  assert not first.startswith("READY"), (
      f"announced {first.strip()!r} for a port it cannot bind")
  run = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
  _assert_one_line_before_jax(run, "bridge_worker", "address")
  assert "65535" in stderr


def test_help_exits_0_and_shows_the_main_flags():
  """Issue 29: --help exited 1 and hid the pipeline's session flags
  (defined in experiments/pipeline_config.py) behind --helpfull."""
  for module in ("pp1_pipeline", "bridge_worker"):
    run = _run(module, ["--help"])
    modules, _ = _split(run.stderr)
    assert run.returncode == 0, run.stderr
    assert "jax" not in modules, module
    for flag in ("q", "k", "depth", "requests", "vocab", "keys_dir",
                 "encrypt", "worker_ranks"):
      assert f"  --{flag}:" in run.stdout or f"  --[no]{flag}:" in (
          run.stdout), (module, flag)


def test_good_flags_pass_the_same_gate():
  """--help parses every flag's default (no validator rejects a default),
  prints the docstring and exits before JAX."""
  for module in ("pp1_pipeline", "bridge_worker", "round_demo", "acceptance",
                 "selection_bias", "wire_sizes", "bench_core",
                 "bench_bridge", "record_figures"):
    run = _run(module, ["--helpfull"])
    modules, _ = _split(run.stderr)
    assert run.returncode == 0, (module, run.stderr)
    assert "jax" not in modules, module
    assert f"experiments.{module}" in run.stdout, module
    assert "%%" not in run.stdout, module  # absl prints help text verbatim
    assert "DESIGN.md" not in run.stdout, module


def test_flags_read_the_librarys_constants():
  """No copies: the flags' bounds and key checks are the library's own
  objects (importing them starts no JAX: tests/test_layers.py), and the
  q formats the flags offer are every registered one, as it says."""
  # pylint: disable=g-import-not-at-top
  from dyadic_jax.bridge import keys
  from dyadic_jax.wire import auth, key_sizes, qformats
  from experiments import cli
  from experiments import pipeline_config
  # pylint: enable=g-import-not-at-top
  assert cli.DEFAULT_VOCAB == dj.DEFAULT_VOCAB
  assert cli.MAX_VOCAB == dj.MAX_VOCAB
  assert pipeline_config.KEYS_SECRET == keys.SECRET == key_sizes.SECRET_FILE
  assert pipeline_config.SECRET_BYTES == auth.SECRET_BYTES
  assert pipeline_config.MIN_DISTINCT_BYTES == keys.MIN_DISTINCT_BYTES
  assert pipeline_config.CURVE_KEY_CHARS == keys.CURVE_KEY_CHARS
  assert pipeline_config.Q_FORMATS == {
      name: pipeline_config.QChoice(f.uses_support, f.shardable, f.sampled)
      for name, f in qformats.BY_NAME.items()}
  for path in ("experiments/cli.py", "experiments/pipeline_config.py"):
    source = open(os.path.join(_ROOT, path)).read()
    for name in ("DEFAULT_VOCAB", "MAX_VOCAB", "SECRET_BYTES",
                 "MIN_DISTINCT_BYTES", "CURVE_KEY_CHARS", "_Z85"):
      assert not re.search(rf"^{name} = ", source, re.M), (path, name)


def test_worker_config_round_trips_through_its_flags():
  """The pipeline hands its resolved config to the worker as flags; the
  worker's parse of them gives back the same config, field for field."""
  code = (
      "from absl import flags\n"
      "from experiments import pipeline_config as pc\n"
      "c = pc.PipelineConfig(vocab=77, depth=3, requests=5, q='sparse', k=7,\n"
      "                      closeness=0.25, model_seed=9, backbone=False)\n"
      "flags.FLAGS(['worker', *c.to_flags()])\n"
      "print(pc.from_flags() == c, pc.from_flags(default_vocab=5) == c)\n"
      "# Dense: no --k (it is refused with --q=dense); both ends derive it.\n"
      "d = pc.PipelineConfig(vocab=77, q='dense', worker_ranks=2)\n"
      "flags.FLAGS.unparse_flags()\n"
      "flags.FLAGS(['worker', *d.to_flags()])\n"
      "print('--k' not in ' '.join(d.to_flags()), pc.from_flags() == d)\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=_ROOT,
                       env=paths.subprocess_env(),
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert run.stdout.split() == ["True", "True", "True", "True"]
