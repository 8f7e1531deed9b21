"""The interpreter that runs a benchmark's transformers peer (absl only).

torch and transformers are not dependencies of the project: a benchmark
that times the peer (bench_core: one verification round, hf_peer.py;
bench_pair: decoding, hf_decode.py) runs its peer script under the
interpreter --hf_python names, e.g. a separate venv made by

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers

`define_flags` defines --hf, --hf_python and --hf_threads with their
checks; `missing` says why an interpreter cannot run a peer; `run` runs a
peer script and returns its last stdout line as JSON.
"""

import json
import os
import shutil
import subprocess
import sys
import typing

from absl import flags

from experiments import cli


class Flags(typing.NamedTuple):
  hf: flags.FlagHolder[bool]
  python: flags.FlagHolder[str]
  threads: flags.FlagHolder[int]


def define_flags(script: str) -> Flags:
  """--hf, --hf_python and --hf_threads for a peer run by `script`."""
  holders = Flags(
      flags.DEFINE_boolean(
          "hf", True, "Time the HF transformers peer (needs --hf_python to "
          "import torch and transformers; skipped with a note otherwise)."),
      flags.DEFINE_string(
          "hf_python", sys.executable, f"Interpreter for experiments/"
          f"{script}, e.g. a separate venv with `pip install torch==2.13.0 "
          "transformers` (the CPU wheel)."),
      flags.DEFINE_integer("hf_threads", 2, "torch threads of the HF peer, "
                           "1..256."))
  cli.check("hf_threads", lambda v: 1 <= v <= 256,
            "--hf_threads must be in [1, 256]")
  cli.check_problem(["hf_python", "hf"], lambda hf_python, hf: None if (
      not hf or runnable(hf_python)) else (
          f"--hf_python={hf_python} is not an executable interpreter "
          "(--nohf skips the HF peer)"))
  return holders


def runnable(path: str) -> str | None:
  """The interpreter a path names (a file or a name on $PATH), or None."""
  found = shutil.which(path)
  return found if found and os.access(found, os.X_OK) else None


def missing(python: str) -> str | None:
  """Why `python` cannot run a peer (None: it can)."""
  probe = subprocess.run(
      [python, "-c", "import torch, transformers; print('hf peer ok')"],
      capture_output=True, text=True, check=False)
  if not probe.returncode and "hf peer ok" in probe.stdout:
    return None
  return (f"{python} cannot import torch and transformers (a venv with "
          "`pip install torch==2.13.0 transformers`, then "
          "--hf_python=<its python>)")


def check_named(holders: Flags) -> None:
  """A --hf_python given by name that cannot run the peer: a usage error
  now, not after the whole benchmark."""
  if (holders.hf.value and flags.FLAGS["hf_python"].present
      and (why := missing(holders.python.value))):
    cli.usage_error(f"--hf_python={holders.python.value}: {why}")


def run(python: str, script: str, *args: str,
        timeout: float = 3600) -> tuple[dict | None, str]:
  """(the last stdout line of experiments/`script` as JSON, or None; a
  one-line note naming the peer's versions, or why it did not run)."""
  why = missing(python)
  if why:
    return None, f"HF peer skipped: {why}"
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
  done = subprocess.run([python, path, *args], capture_output=True,
                        text=True, check=False, timeout=timeout)
  if done.returncode:
    return None, f"HF peer failed: {done.stderr.strip().splitlines()[-1:]}"
  record = json.loads(done.stdout.strip().splitlines()[-1])
  return record, (f"HF peer: transformers {record['transformers']}, torch "
                  f"{record['torch']}, {record['threads']} threads")
