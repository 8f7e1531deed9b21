"""Fixed-seed, fixed-count libFuzzer campaigns of the atheris targets.

Shared by tests/fuzz_wire.py and tests/fuzz_sessions.py (`run_fuzz`) and
their CI tests (`check`). Standard library only: importing this module
imports nothing a target must instrument.
"""

import pathlib
import re
import resource
import subprocess
import sys


def run(script, corpus_dirs=(), *, runs, seed, max_len, artifact_dir=None,
        extra_args=(), timeout=None):
  """Runs `script` (an atheris target) as a campaign in a subprocess.

  Args:
    script: path of the target.
    corpus_dirs: corpus directories; libFuzzer writes new inputs into the
      first one, so pass a copy of a checked-in corpus.
    runs: executions in all (the corpus's included).
    seed: libFuzzer's -seed. A run still does not repeat bit for bit (the
      coverage atheris reports varies with memory layout), so a failure is
      reproduced from its crash file, not by running again.
    max_len: libFuzzer's -max_len.
    artifact_dir: where a crashing input is written (-artifact_prefix);
      the current directory when None.
    extra_args: further libFuzzer flags.
    timeout: seconds before subprocess.TimeoutExpired.

  Returns:
    The subprocess.CompletedProcess, stdout and stderr merged in `.stdout`.
  """
  # libFuzzer's memory check reads the peak RSS, which Linux carries over
  # from this (parent) process through fork and exec: a pytest worker that
  # already peaked at 2.5 GB would trip the default 2 GB limit at once. The
  # limit is 2 GB above what this process has already used.
  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
  cmd = [sys.executable, str(pathlib.Path(script).resolve()), f"-runs={runs}",
         f"-seed={seed}", f"-max_len={max_len}",
         f"-rss_limit_mb={peak_mb + 2048}", "-print_final_stats=1"]
  if artifact_dir is not None:
    cmd.append(f"-artifact_prefix={pathlib.Path(artifact_dir).resolve()}/")
  cmd += [*extra_args, *map(str, corpus_dirs)]
  return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=timeout, check=False)


def check(result, artifacts, runs, script, corpus_files=None):
  """Asserts that a campaign ran all its executions without a crash.

  With `corpus_files`, also that libFuzzer read that many seed files
  before its new executions (the replay is the default tier's regression
  value, so a corpus that silently failed to load must fail).
  """
  # Runs do not repeat bit for bit: the message carries the inputs.
  crashes = {p.name: p.read_bytes().hex()
             for p in pathlib.Path(artifacts).iterdir()}
  assert result.returncode == 0 and not crashes, (
      f"exit {result.returncode}, inputs (hex) {crashes}; reproduce with "
      f"python {script} FILE\n{result.stdout[-6000:]}")
  done = re.search(r"^Done (\d+) runs in (\d+) second", result.stdout,
                   re.MULTILINE)
  assert done and int(done.group(1)) == runs, result.stdout[-3000:]
  if corpus_files is not None:
    seeds = re.search(r"^INFO: seed corpus: files: (\d+)", result.stdout,
                      re.MULTILINE)
    assert seeds and int(seeds.group(1)) == corpus_files, (
        result.stdout[:3000])
