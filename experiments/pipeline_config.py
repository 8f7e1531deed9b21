"""One configuration for the PP1 pipeline's worker and verifier.

`PipelineConfig` is what both ends must agree on (their HELLO: vocabulary,
depth, batch, q representation and support) plus the draft model's knobs.
Its flags are defined here, once, with their bounds, so that
`experiments.pp1_pipeline` and `experiments.bridge_worker` accept the same
names and values; the pipeline resolves its config and hands it to the
worker process as flags (`PipelineConfig.to_flags`), so the two can never
disagree about a default.

Adding a shared setting: a field of `PipelineConfig`, its flag below (with
its bounds), and its value in `from_flags`; `to_flags` forwards every field
(k only with a q format that uses it: --k is refused with any other --q).
Settings of one side only (the pipeline's --tokens, the worker's --address)
are that program's own flags.

Importing this module costs absl only (no JAX): the bounds are checked when
the command line is parsed, before any heavy import.
"""

import dataclasses
import functools
import json
import os
import pathlib
import stat
import typing

from absl import flags

from dyadic_jax.wire import key_sizes
from dyadic_jax.wire import qformats
from dyadic_jax.wire.key_sizes import (CURVE_KEY_CHARS, MIN_DISTINCT_BYTES,
                                       SECRET_BYTES)
from experiments import cli

if typing.TYPE_CHECKING:
  from dyadic_jax import bridge
  from dyadic_jax.models import toy_pair

MAX_DEPTH = 32        # drafted positions per round (the toy's backbone is
                      # [depth, 16, V] floats: 8 MB per position at V=129280)
MAX_REQUESTS = 64     # requests per batch slot
MAX_RANKS = 4         # processes of a tensor-parallel side, on loopback
MAX_MODEL_SEED = (1 << 31) - 2    # jax.random.key(seed + 1) in int32


class QChoice(typing.NamedTuple):
  """What the flags' checks need of a q format (`dyadic_jax.wire.qformats`:
  `uses_support`, `shardable`, `sampled`)."""
  uses_support: bool     # --k is its row width
  shardable: bool        # rank links may split its rows (--worker_ranks)
  sampled: bool          # its rows carry q (else the greedy mode)


# The q formats by --q name, read from the library (importing the q
# formats starts no JAX: tests/test_layers.py).
Q_FORMATS = {name: QChoice(f.uses_support, f.shardable, f.sampled)
             for name, f in qformats.BY_NAME.items()}
Q_CHOICES = tuple(Q_FORMATS)
KEYS_SECRET = key_sizes.SECRET_FILE

VOCAB = flags.DEFINE_integer(
    "vocab", None, f"Vocabulary size V in [2, {cli.MAX_VOCAB}] (default "
    f"{cli.DEFAULT_VOCAB}; the pipeline's --check_distribution: "
    "--check_vocab).", lower_bound=2, upper_bound=cli.MAX_VOCAB)
DEPTH = flags.DEFINE_integer(
    "depth", 5, f"Fixed draft depth D: positions drafted per request and "
    f"round (1..{MAX_DEPTH}).", lower_bound=1, upper_bound=MAX_DEPTH)
REQUESTS = flags.DEFINE_integer(
    "requests", 4, f"Requests verified together in one batch slot "
    f"(1..{MAX_REQUESTS}).", lower_bound=1, upper_bound=MAX_REQUESTS)
Q = flags.DEFINE_enum(
    "q", "sparse", list(Q_CHOICES), "Wire representation of q (a "
    "dyadic_jax.wire.qformats name): sparse top-k rows, dense V rows, or "
    "greedy (v1: token ids only, worker only).")
K = flags.DEFINE_integer(
    "k", 32, "Support of sparse q rows, in [1, V] (when not given: "
    "min(32, V / 2), e.g. for the distribution check's small vocabulary); "
    "only with --q=sparse (a dense row has all V entries).",
    lower_bound=1)
CLOSENESS = flags.DEFINE_float(
    "closeness", 0.9, "How closely the toy draft tracks the toy target, in "
    "[0, 1] (1: the target's bigram without its processors).",
    lower_bound=0.0, upper_bound=1.0)
MODEL_SEED = flags.DEFINE_integer(
    "model_seed", 0, f"Seed of the toy models' factors, in [0, "
    f"{MAX_MODEL_SEED}].", lower_bound=0, upper_bound=MAX_MODEL_SEED)
BACKBONE = flags.DEFINE_bool(
    "backbone", True, "Give the draft its parallel backbone (DSpark-style); "
    "--nobackbone: a purely sequential Markov draft.")
KEYS_DIR = flags.DEFINE_string(
    "keys_dir", None, "Directory of the bridge keys (python -m "
    "dyadic_jax.bridge.keys DIR): the secret every frame's MAC is keyed "
    "with, and the CURVE keys of --encrypt. The pipeline makes a throwaway "
    "set when it is not given; the worker needs it (or --insecure).")
INSECURE = flags.DEFINE_bool(
    "insecure", False, "No authentication on the bridge link (CRC32C "
    "tags only): any process that reaches the socket can talk to either "
    "side. Said loudly at start and in the summary. Benchmarks only.")
ENCRYPT = flags.DEFINE_bool(
    "encrypt", True, "ZeroMQ CURVE on the bridge link (keys from "
    "--keys_dir): only the deployment's keys get past the handshake, and "
    "the link is encrypted. --noencrypt: the link in the clear and open "
    "to any process that reaches the port at the ZeroMQ level (its cost "
    "per round, measured: docs/security.md).")
WORKER_BUG = flags.DEFINE_enum(
    "worker_bug", "none", ["none", "token_not_from_q", "shard_mass"],
    "Fault drill: token_not_from_q: the worker sends its q but each drafted "
    "token is the entry after the one its draw picked (never drawn from "
    "that q); the verifier's sampling audit refuses every such proposal. "
    "shard_mass (rank links): the worker's last rank adds 2^-24 to the "
    "first entry of its block's first row, a well-formed, authenticated "
    "shard whose row no longer sums to 1; only the verifier ranks' global "
    "mass agreement can see it.")
MODEL = flags.DEFINE_string(
    "model", "toy", "The draft/target pair. toy: deterministic pseudo-random "
    "logits of any V (--closeness, --model_seed, --backbone); stdlib: the "
    "transformer pair trained on the Python standard library's source, "
    "shipped in dyadic_jax/models/checkpoints/stdlib; or the directory of a "
    "checkpoint that python -m experiments.train_pair wrote. A trained pair "
    "keeps KV caches on both sides; V is its tokenizer's, prompts are cut "
    "from held-out files.")
WORKER_RANKS = flags.DEFINE_integer(
    "worker_ranks", 1, f"Tensor-parallel ranks of the draft worker "
    f"(1..{MAX_RANKS}): jax.distributed processes on loopback, each holding one vocabulary "
    "block of the draft; the token draws are shard-then-token collectives. "
    "With --q=dense each rank sends its block on its own link to the "
    "verifier rank of the same index (the pipeline then needs "
    "--verifier_ranks equal to it).", lower_bound=1, upper_bound=MAX_RANKS)
INSECURE_WARNING = ("WARNING: --insecure: the bridge link is NOT "
                    "authenticated; any process that reaches the socket "
                    "can talk to either side")



def checkpoint_meta(model: str) -> dict[str, typing.Any]:
  """The config.json of trained pair `model` (`cli.model_dir`)."""
  return _checkpoint_meta(cli.model_dir(model))


@functools.cache
def _checkpoint_meta(directory: pathlib.Path) -> dict[str, typing.Any]:
  with open(directory / "config.json", encoding="utf-8") as f:
    return dict(json.load(f))


def model_vocab(name: str) -> int | None:
  """V of pair `name` (None: the toy, any V)."""
  return None if name == "toy" else int(checkpoint_meta(name)["target"][
      "vocab"])


def model_max_len(name: str) -> int | None:
  """Tokens a request of pair `name` may hold (None: the toy, unbounded)."""
  return None if name == "toy" else int(checkpoint_meta(name)["target"][
      "max_len"])


TOY_FLAGS = ("closeness", "model_seed", "backbone")
cli.check_checkpoint("model", "--model is toy, stdlib, or a checkpoint "
                     "directory that python -m experiments.train_pair "
                     "--output_dir wrote", allow=lambda model: model == "toy")


def unusable_model(model: str) -> bool:
  """True for a --model that is refused on its own (its check's message
  says why): checks of it with other flags pass it by."""
  return model != "toy" and cli.checkpoint_problem(model) is not None


cli.check(["model", "vocab"], lambda model, vocab: (
    vocab is None or model == "toy" or unusable_model(model)
    or vocab == model_vocab(model)),
          "--vocab is the model's with --model (leave it out)")
cli.check(["model", *TOY_FLAGS], lambda model, **_: model == "toy" or not any(
    flags.FLAGS[name].present for name in TOY_FLAGS),
          "--closeness, --model_seed and --backbone are the toy pair's "
          "(--model=toy)")
cli.check_problem("model", lambda model: None if model == "toy" else (
    cli.extra_problem("models", f"--model={model}")))
cli.check(["model", "worker_ranks"], lambda model, worker_ranks: (
    model == "toy" or worker_ranks == 1),
          "--model runs its draft on one worker rank (--worker_ranks=1)")
cli.check("closeness", lambda c: 0.0 <= c <= 1.0,   # NaN fails it too
          "--closeness must be a number in [0, 1]")
cli.check(["k", "vocab"], lambda k, vocab: vocab is None or k <= vocab,
          "--k must be <= --vocab")


def _k_problem(k: int, model: str, q: str) -> str | None:
  """--k beyond a trained pair's V (its tokenizer's, not --vocab's)."""
  if (model == "toy" or unusable_model(model) or not flags.FLAGS["k"].present
      or not Q_FORMATS[q].uses_support):
    return None
  vocab = model_vocab(model)
  return None if vocab is None or k <= vocab else (
      f"--k={k} must be <= the vocabulary of --model={model}, V={vocab}")


cli.check_problem(["k", "model", "q"], _k_problem)
cli.check(["worker_bug", "q", "worker_ranks"],
          lambda worker_bug, q, worker_ranks: worker_bug != "shard_mass" or (
              Q_FORMATS[q].shardable and worker_ranks > 1),
          "--worker_bug=shard_mass corrupts one rank link's shard: it needs "
          "--q=dense and --worker_ranks > 1")
cli.check(["k", "q"],
          lambda k, q: Q_FORMATS[q].uses_support
          or not flags.FLAGS["k"].present,
          "--k is the support of sparse q rows: it does not apply to "
          + " or ".join(f"--q={n}" for n, f in Q_FORMATS.items()
                        if not f.uses_support)
          + " (give one of --q=" + ", --q=".join(
              n for n, f in Q_FORMATS.items() if f.uses_support)
          + ", or no --k)")
cli.check(["insecure", "keys_dir", "encrypt"],
          lambda insecure, keys_dir, encrypt: not (insecure and (
              keys_dir or (encrypt and flags.FLAGS["encrypt"].present))),
          "--insecure excludes --keys_dir and --encrypt")


def keys_dir_problem(path: str | None, encrypt: bool,
                     roles: typing.Sequence[str]) -> str | None:
  """Why `dyadic_jax.bridge.keys.load(path, role, encrypt=)` would fail for
  one of `roles` ("worker", "verifier"), in one line; None if it would not.

  The same checks as the loader (files present, secret files private, the
  secret's length), made before JAX starts.
  """
  if path is None:
    return None
  made = f"python -m dyadic_jax.bridge.keys {path} makes a key set"
  if not os.path.isdir(path):
    return (f"--keys_dir={path}: " + ("not a directory" if os.path.exists(
        path) else "no such directory") + f" ({made})")
  names = [KEYS_SECRET]
  if encrypt:
    names += [f"{role}.curve_secret" for role in roles]
    names += ["worker.curve", "verifier.curve"]
  missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
  if missing:
    return (f"--keys_dir={path} holds no {', '.join(missing)} ({made}"
            + (", with the CURVE keys of --encrypt" if encrypt else "") + ")")
  for name in names:
    if name.endswith(("secret", ".key")):
      mode = os.stat(os.path.join(path, name)).st_mode
      if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"--keys_dir={path}: {name} is accessible by other users "
                f"(mode {stat.filemode(mode)}); chmod 600 it")
  try:
    with open(os.path.join(path, KEYS_SECRET)) as f:
      secret = bytes.fromhex(f.read().strip())
  except OSError as e:
    return f"--keys_dir={path}: cannot read {KEYS_SECRET}: {e.strerror}"
  except ValueError:
    secret = b""
  if len(secret) != SECRET_BYTES:
    return (f"--keys_dir={path}: {KEYS_SECRET} must hold {SECRET_BYTES} "
            f"bytes in hex ({made} --force)")
  if len(set(secret)) < MIN_DISTINCT_BYTES:
    return (f"--keys_dir={path}: {KEYS_SECRET} holds {len(set(secret))} "
            f"distinct byte values, fewer than {MIN_DISTINCT_BYTES}: not "
            f"a random secret ({made} --force)")
  for name in names[1:]:
    try:
      with open(os.path.join(path, name)) as f:
        text = f.read().strip()
    except OSError as e:
      return f"--keys_dir={path}: cannot read {name}: {e.strerror}"
    if len(text) != CURVE_KEY_CHARS or not set(text) <= key_sizes.Z85:
      return (f"--keys_dir={path}: {name} is not a CURVE key "
              f"({CURVE_KEY_CHARS} z85 characters; {made} --force)")
  return None



def check_keys_dir(roles: typing.Sequence[str]) -> None:
  """Registers the parse-time check of --keys_dir for a program that loads
  the keys of `roles` (the pipeline: both; the worker: its own)."""
  cli.check_problem(["keys_dir", "encrypt"],
                    lambda keys_dir, encrypt: keys_dir_problem(
                        keys_dir, encrypt, roles))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
  """What the worker and the verifier share.

  Attributes:
    vocab: V.
    depth: D, drafted positions per request and round.
    requests: requests per batch slot.
    q: a q format's name (`Q_FORMATS`): "sparse", "dense" or "greedy"
      (v1, token ids only).
    k: support of sparse rows (ignored by a format that does not use it).
    closeness: the toy draft's closeness to the target, in [0, 1].
    model_seed: seed of the toy models.
    backbone: the draft's parallel backbone on or off.
    keys_dir: the bridge keys (None: a throwaway set, or --insecure).
    insecure: no authentication on the link.
    encrypt: ZeroMQ CURVE on the link (admission and confidentiality; off
      when insecure).
    worker_bug: "none", or the "token_not_from_q" or "shard_mass" drill.
    worker_ranks: tensor-parallel ranks of the worker (shardable, i.e.
      dense, q: one rank link per rank, `Capabilities.shards`).
    model: the pair: "toy", a shipped checkpoint's name or a checkpoint
      directory (`cli.model_dir`).
  """
  vocab: int = cli.DEFAULT_VOCAB
  depth: int = 5
  requests: int = 4
  q: str = "sparse"
  k: int = 32
  closeness: float = 0.9
  model_seed: int = 0
  backbone: bool = True
  keys_dir: str | None = None
  insecure: bool = False
  encrypt: bool = True
  worker_bug: str = "none"
  worker_ranks: int = 1
  model: str = "toy"

  def __post_init__(self):
    if self.insecure:    # no keys at all: no CURVE either
      object.__setattr__(self, "encrypt", False)
    if self.q not in Q_CHOICES:
      raise ValueError(f"PipelineConfig: q must be one of {Q_CHOICES}")
    if not (2 <= self.vocab <= cli.MAX_VOCAB and 1 <= self.depth <= MAX_DEPTH
            and 1 <= self.requests <= MAX_REQUESTS
            and 0.0 <= self.closeness <= 1.0
            and 0 <= self.model_seed <= MAX_MODEL_SEED
            and 1 <= self.worker_ranks <= MAX_RANKS and self.model):
      raise ValueError(f"PipelineConfig: a value out of bounds: {self}")
    if Q_FORMATS[self.q].uses_support and not 1 <= self.k <= self.vocab:
      raise ValueError(f"PipelineConfig: k={self.k} not in [1, V={self.vocab}]")

  def to_flags(self) -> list[str]:
    """The command-line flags that reproduce this config in another process."""
    out = []
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None or (field.name == "k"
                           and not Q_FORMATS[self.q].uses_support) or (
                               field.name in TOY_FLAGS and self.model != "toy"):
        continue   # k is sparse rows' only, the toy's knobs the toy's (the
                   # other end derives them alike)
      if isinstance(value, bool):
        out.append(f"--{field.name}" if value else f"--no{field.name}")
      else:
        out.append(f"--{field.name}={value}")
    return out

  @property
  def rank_links(self) -> bool:
    """Shardable (dense) q from a tensor-parallel worker: one link per
    rank."""
    return Q_FORMATS[self.q].shardable and self.worker_ranks > 1

  def capabilities(self) -> "bridge.Capabilities":
    """The bridge Capabilities (HELLO) of this config (of rank 0's link
    with rank links: `Capabilities.link(s)` is rank s's); imports the
    bridge."""
    from dyadic_jax import bridge  # pylint: disable=g-import-not-at-top
    from dyadic_jax.wire import qformats  # pylint: disable=g-import-not-at-top
    fmt = qformats.BY_NAME[self.q]
    return bridge.Capabilities(
        mode=fmt.mode, vocab=self.vocab, max_depth=self.depth,
        max_requests=self.requests, representation=fmt.representation,
        max_support=self.k,
        shards=self.worker_ranks if self.rank_links else 1)

  def link_keys(self, role: str) -> tuple[typing.Any, typing.Any]:
    """(secret, curve) of one side: (None, None) when insecure."""
    if self.insecure:
      return None, None
    from dyadic_jax.bridge import keys  # pylint: disable=g-import-not-at-top
    if self.keys_dir is None:
      raise ValueError("PipelineConfig: no keys_dir (and not insecure)")
    loaded = keys.load(self.keys_dir, role, encrypt=self.encrypt)
    return loaded.secret, loaded.curve

  def model_config(self, **target_knobs: typing.Any
                   ) -> "toy_pair.ModelConfig":
    """The toy pair's ModelConfig; `target_knobs`: the target's processors."""
    from dyadic_jax.models import toy_pair  # pylint: disable=g-import-not-at-top
    return toy_pair.ModelConfig(
        vocab=self.vocab, seed=self.model_seed, closeness=self.closeness,
        max_depth=self.depth, **target_knobs)


def from_flags(default_vocab: int = cli.DEFAULT_VOCAB) -> PipelineConfig:
  """The PipelineConfig of the parsed flags.

  Args:
    default_vocab: V when --vocab is not given.

  When --k is not given it is min(--k default, V // 2) (at least 1).
  """
  model = MODEL.value
  if model != "toy":    # a path made absolute: the worker may start elsewhere
    model = cli.model_name(model)
  vocab = model_vocab(model) or (
      VOCAB.value if VOCAB.value is not None else default_vocab)
  k = K.value if flags.FLAGS["k"].present else min(K.value,
                                                    max(1, vocab // 2))
  return PipelineConfig(vocab=vocab, depth=DEPTH.value,
                        requests=REQUESTS.value, q=Q.value, k=k,
                        closeness=CLOSENESS.value,
                        model_seed=MODEL_SEED.value, backbone=BACKBONE.value,
                        keys_dir=KEYS_DIR.value, insecure=INSECURE.value,
                        encrypt=ENCRYPT.value, worker_bug=WORKER_BUG.value,
                        worker_ranks=WORKER_RANKS.value, model=model)
