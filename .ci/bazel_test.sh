#!/usr/bin/env bash
# Runs the Bazel tests of dyadic-jax offline with a virtualenv's interpreter.
#
#   bash .ci/bazel_test.sh /path/to/venv/bin/python [TARGET_PATTERN...]
#
# First every target is built (`bazel build //...`: each analyzes, its deps
# resolve, its runfiles are laid out), then the tests TARGET_PATTERN names
# run. TARGET_PATTERN defaults to //:smoke (one quick file per layer, what
# CI runs); //:fast skips the tests tagged "slow", //:multidevice / //:slow
# select by tag, //... is everything, //:core_test_qcodec runs one file.
# Options for Bazel itself may be mixed in, e.g.
#   bash .ci/bazel_test.sh /work/venv/bin/python --test_filter=roundtrip //:core_test_qcodec
#
# Needs Bazel 4.2.x (Debian: apt-get install bazel-bootstrap; installed here
# when missing and we are root). The interpreter must have jax, numpy, chex,
# absl-py, hypothesis, pytest and matplotlib: they are not Bazel targets.
# Before Bazel runs, third_party/bazel/check_build.py checks that BUILD covers
# every source file with the deps its imports call for.
# Exits non-zero when the check, the build or any test fails; the last line
# reads "bazel: N passed, M failed".
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi

python_arg=$1
shift
if [[ ! -x "$python_arg" ]]; then
  echo "bazel_test.sh: $python_arg is not an executable interpreter" >&2
  exit 2
fi
# Absolute, but do not resolve symlinks: a venv's bin/python is a symlink to
# the base interpreter, and only the venv path finds the venv's packages.
python_dir=$(cd "$(dirname "$python_arg")" && pwd)
python="$python_dir/$(basename "$python_arg")"
if ! "$python" -c 'import jax, numpy, pytest' >/dev/null 2>&1; then
  echo "bazel_test.sh: $python cannot import jax, numpy and pytest" >&2
  exit 2
fi

cd "$(dirname "$0")/.."

if ! command -v bazel >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "bazel_test.sh: installing bazel-bootstrap (Bazel 4.2.3)" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap >&2
  else
    echo "bazel_test.sh: bazel not found (apt-get install bazel-bootstrap)" >&2
    exit 2
  fi
fi

"$python" third_party/bazel/check_build.py

targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(//:smoke)
fi

# Bazel's Python launcher starts with "#!/usr/bin/env python"; put the venv
# first on PATH so that resolves (Debian has no bare "python") to the same
# interpreter that --python_path then runs the test with.
export PATH="$python_dir:$PATH"

# A persistent XLA compilation cache (JAX_COMPILATION_CACHE_DIR, set by
# .ci/run for pytest and Bazel alike) reaches the sandboxed tests as a
# writable path: programs pytest already compiled are not compiled again.
cache_args=()
if [[ -n "${JAX_COMPILATION_CACHE_DIR:-}" ]]; then
  mkdir -p "$JAX_COMPILATION_CACHE_DIR"
  cache_args=(--test_env=JAX_COMPILATION_CACHE_DIR
              "--sandbox_writable_path=$JAX_COMPILATION_CACHE_DIR")
fi

# Every target builds, whichever tests run below.
bazel build --python_path="$python" //...

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
bazel test --python_path="$python" "${cache_args[@]}" "${targets[@]}" 2>&1 \
  | tee "$log" || status=$?

# One summary line in the "N passed, N failed" form that CI logs are read for.
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(PASSED|FLAKY)' "$log" || true)
failed=$(grep -E '^//[^ ]+ +' "$log" \
  | grep -cE '(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|REMOTE FAILURE|FAILED TO BUILD)' || true)
echo "bazel: ${passed} passed, ${failed} failed"
if [[ $status -ne 0 ]]; then
  echo "bazel_test.sh: bazel test exited with $status" >&2
fi
exit "$status"
