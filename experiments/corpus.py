"""The training text every machine has: the Python standard library's source.

Every `*.py` file under `sysconfig.get_paths()["stdlib"]`, outside
`site-packages`, that decodes as UTF-8 (a handful of test files are
deliberately in other encodings or broken; they are skipped). Which files
and which bytes depend on the Python version, so the `fingerprint` (sha256
over the sorted (relative path, file sha256) pairs, plus the version) is
recorded in the checkpoint: a model trained elsewhere can be told apart.

The split is by path: a file is held out when the first 8 bytes of
sha256(relative path) read as an integer fall below HELD_OUT_FRACTION of
2^64 (~5%), so it does not depend on which other files exist.
"""

import dataclasses
import hashlib
import pathlib
import sys
import sysconfig
import typing

import numpy as np

HELD_OUT_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """One corpus file."""
  path: str    # relative to the stdlib root, '/'-separated
  text: str
  sha256: str  # of the file's bytes


def stdlib_root() -> pathlib.Path:
  """The running interpreter's standard library directory."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def is_held_out(path: str) -> bool:
  """Whether the file at relative path is in the held-out split."""
  digest = hashlib.sha256(path.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") < HELD_OUT_FRACTION * 2.0**64


def load_files(root: pathlib.Path | None = None) -> list[SourceFile]:
  """Every corpus file, sorted by relative path."""
  root = stdlib_root() if root is None else root
  files = []
  for file in sorted(root.rglob("*.py")):
    rel = file.relative_to(root)
    if "site-packages" in rel.parts or not file.is_file():
      continue
    data = file.read_bytes()
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError:
      continue
    files.append(SourceFile(path=rel.as_posix(), text=text,
                            sha256=hashlib.sha256(data).hexdigest()))
  files.sort(key=lambda f: f.path)
  return files


def split(files: list[SourceFile]
          ) -> tuple[list[SourceFile], list[SourceFile]]:
  """(train, held out), each in path order."""
  train = [f for f in files if not is_held_out(f.path)]
  held = [f for f in files if is_held_out(f.path)]
  return train, held


def fingerprint(files: list[SourceFile]) -> str:
  """sha256 over the Python version and sorted (path, file sha256) pairs."""
  h = hashlib.sha256()
  h.update(f"python {sys.version_info[0]}.{sys.version_info[1]}."
           f"{sys.version_info[2]}\n".encode())
  for f in sorted(files, key=lambda f: f.path):
    h.update(f"{f.path}\0{f.sha256}\n".encode("utf-8"))
  return h.hexdigest()


class _Encoder(typing.Protocol):
  def encode(self, text: str) -> np.ndarray: ...


def held_out_prompts(tokenizer: _Encoder, n: int, length: int, seed: int,
                     files: list[SourceFile] | None = None) -> np.ndarray:
  """int32[n, length] prompts cut from held-out files, deterministic in seed.

  Each prompt is `length` consecutive tokens of one held-out file (a file
  with at least `length` tokens, chosen uniformly, then a uniform offset).

  Raises:
    ValueError: no held-out file is that long.
  """
  return prompts(tokenizer, n, length, seed, files, held_out=True)


def prompts(tokenizer: _Encoder, n: int, length: int, seed: int,
            files: list[SourceFile] | None = None, *,
            held_out: bool) -> np.ndarray:
  """`held_out_prompts`, or with held_out=False the same cut from the
  training files (what a policy is tuned on, never reported on)."""
  if files is None:
    files = load_files()
  train, held = split(files)
  chosen = held if held_out else train
  which = "held-out" if held_out else "training"
  encoded = [tokenizer.encode(f.text) for f in chosen]
  long_enough = [e for e in encoded if e.size >= length]
  if not long_enough:
    raise ValueError(f"{'held_out_prompts' if held_out else 'prompts'}: no "
                     f"{which} file has {length} tokens")
  rng = np.random.default_rng(seed)
  out = np.empty((n, length), np.int32)
  for i in range(n):
    tokens = long_enough[int(rng.integers(len(long_enough)))]
    offset = int(rng.integers(tokens.size - length + 1))
    out[i] = tokens[offset:offset + length]
  return out
