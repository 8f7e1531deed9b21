"""Key material of a bridge deployment, made by one command.

    python -m dyadic_jax.bridge.keys DIR

writes, in DIR (created with mode 0700 if missing):

    secret.key            the deployment secret: 32 random bytes, hex
                          (mode 0600). Both sides load it: every frame's
                          MAC is keyed from it (docs/security.md).
    worker.curve          the worker's CURVE public key (z85), and
    worker.curve_secret   its secret key (0600): CURVE admits only the
                          deployment's keys and encrypts (the default;
                          `--noencrypt` turns it off);
    verifier.curve        the verifier's CURVE pair, likewise.
    verifier.curve_secret

It refuses to overwrite existing files (`--force` to replace them); the
command run again on a folder that already holds a complete, loadable set
keeps it and says so (exit status 0), so a one-liner that makes the keys
and then uses them can be run twice. A
side refuses to load a secret file that other users can read or write
(like ssh with its keys), a secret that is all zeros or has fewer than
MIN_DISTINCT_BYTES distinct bytes (typed or patterned, not drawn), and a
CURVE key that is not 40 z85 characters. The worker's host needs secret.key,
worker.curve_secret, worker.curve and verifier.curve; the verifier's host
secret.key, verifier.curve_secret, verifier.curve and worker.curve.
`temporary()` makes a throwaway directory (the pipeline's default, so its
one-command run stays one command).
"""

import os
import pathlib
import secrets
import shutil
import stat
import sys
import tempfile
import typing

from dyadic_jax.bridge import transport
from dyadic_jax.wire import auth
from dyadic_jax.wire import key_sizes
from dyadic_jax.wire.key_sizes import CURVE_KEY_CHARS, MIN_DISTINCT_BYTES

SECRET = key_sizes.SECRET_FILE
_CURVE = ("worker", "verifier")


def secret_problem(secret: bytes) -> str | None:
  """Why `secret` is no deployment secret, in words; None if it is one."""
  if len(secret) != auth.SECRET_BYTES:
    return f"must hold {auth.SECRET_BYTES} bytes in hex"
  if len(set(secret)) < MIN_DISTINCT_BYTES:
    return (f"holds {len(set(secret))} distinct byte values (fewer than "
            f"{MIN_DISTINCT_BYTES}: not random; make a new set)")
  return None


class Keys(typing.NamedTuple):
  """What one side loads: the MAC secret, and its CURVE material (or None)."""
  secret: bytes
  curve: transport.Curve | None


def _write(path: pathlib.Path, data: str, mode: int) -> None:
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
  with os.fdopen(fd, "w") as f:
    f.write(data + "\n")
  os.chmod(path, mode)


def make(directory: str | os.PathLike, *, force: bool = False) -> pathlib.Path:
  """Writes a fresh key set into `directory`; returns its path."""
  import zmq  # pylint: disable=g-import-not-at-top
  directory = pathlib.Path(directory)
  directory.mkdir(mode=0o700, parents=True, exist_ok=True)
  names = [SECRET] + [f"{side}.curve{tail}" for side in _CURVE
                      for tail in ("", "_secret")]
  existing = [n for n in names if (directory / n).exists()]
  if existing and not force:
    raise FileExistsError(f"keys: {directory} already holds {existing} "
                          "(--force replaces them)")
  _write(directory / SECRET, secrets.token_bytes(auth.SECRET_BYTES).hex(),
         0o600)
  for side in _CURVE:
    public, secret = zmq.curve_keypair()
    _write(directory / f"{side}.curve", public.decode(), 0o644)
    _write(directory / f"{side}.curve_secret", secret.decode(), 0o600)
  return directory


def _read_private(path: pathlib.Path) -> str:
  mode = path.stat().st_mode
  if mode & (stat.S_IRWXG | stat.S_IRWXO):
    raise PermissionError(f"keys: {path} is accessible by other users "
                          f"(mode {stat.filemode(mode)}); chmod 600 it")
  return path.read_text().strip()


def load_secret(directory: str | os.PathLike) -> bytes:
  """The deployment secret (32 bytes) of `directory`."""
  text = _read_private(pathlib.Path(directory) / SECRET)
  try:
    secret = bytes.fromhex(text)
  except ValueError:
    secret = b""
  problem = secret_problem(secret)
  if problem is not None:
    raise ValueError(f"keys: {directory}/{SECRET} {problem}")
  return secret


def load(directory: str | os.PathLike, role: str, *,
         encrypt: bool = True) -> Keys:
  """Keys of `role` ("worker" or "verifier") from `directory`.

  encrypt: load the CURVE keys too (the default: admission at the
  handshake and confidentiality; False only for an explicit
  `--noencrypt`)."""
  if role not in _CURVE:
    raise ValueError(f"keys: role {role!r} is not one of {_CURVE}")
  directory = pathlib.Path(directory)
  curve = None
  if encrypt:

    def read(name: str) -> bytes:
      return check_curve_key(directory / name, (
          directory / name).read_text().strip()).encode()

    curve = transport.Curve(
        public_key=read(f"{role}.curve"),
        secret_key=check_curve_key(
            directory / f"{role}.curve_secret",
            _read_private(directory / f"{role}.curve_secret")).encode(),
        server_public=read("worker.curve"),
        client_public=read("verifier.curve"))
  return Keys(load_secret(directory), curve)


def check_curve_key(path: pathlib.Path, text: str) -> str:
  """`text` if it is a CURVE key (40 z85 characters), else ValueError."""
  if len(text) != CURVE_KEY_CHARS or not set(text) <= key_sizes.Z85:
    raise ValueError(f"keys: {path} is not a CURVE key ({CURVE_KEY_CHARS} "
                     "z85 characters)")
  return text




class temporary:  # pylint: disable=invalid-name
  """A throwaway key directory (a context manager; removed on exit)."""

  def __init__(self) -> None:
    self.path = pathlib.Path(tempfile.mkdtemp(prefix="dyadic-keys-"))
    make(self.path, force=True)

  def __enter__(self) -> pathlib.Path:
    return self.path

  def __exit__(self, *exc: object) -> None:
    self.cleanup()

  def cleanup(self) -> None:
    shutil.rmtree(self.path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  force = "--force" in argv
  args = [a for a in argv if a != "--force"]
  if len(args) != 1 or args[0].startswith("-") or not args[0].strip():
    # An empty DIR would write the secret into the current folder.
    print("usage: python -m dyadic_jax.bridge.keys DIR [--force]",
          file=sys.stderr)
    return 2
  if not force and _complete(args[0]):
    print(f"keys: {args[0]} already holds a complete key set: kept it "
          "(--force makes a new one)")
    return 0
  try:
    path = make(args[0], force=force)
  except OSError as e:
    text = str(e)     # make's own errors already say "keys: "
    print(text if text.startswith("keys: ") else f"keys: {text}",
          file=sys.stderr)
    return 1
  print(f"wrote the bridge keys to {path} (secret.key: mode 0600)")
  return 0


def _complete(directory: str) -> bool:
  """True if `directory` holds every key file and both roles load."""
  try:
    for role in _CURVE:
      load(directory, role, encrypt=True)
  except (OSError, ValueError):
    return False
  return True


if __name__ == "__main__":
  sys.exit(main())
