"""Frame tags: a keyed BLAKE3 MAC (default) or CRC32C (`--insecure`).

Every frame carries a 16-byte tag at bytes [32, 48) of its header, computed
over every other byte of the frame ([0, 32) and [48, length)): magic,
version, kind, length, session, generation, round, the body (request,
positions, anchor, ...) and the payload. A tag is one of:

* `Blake3Tag(key)`: keyed BLAKE3 (the `blake3` package), 128-bit output.
  Keys are derived (BLAKE3 derive_key mode, one context string per use):

      hello key, direction d  = derive("hello " + d, secret)
      session key, direction d = derive("session " + d,
                                        secret | session | nonce_v | nonce_w)

  with d = "v->w" (verifier to worker) or "w->v". nonce_v is the
  verifier's HELLO nonce, nonce_w the worker's answer's: both fresh per
  HELLO, so a frame recorded in one session fails authentication in any
  other, and a frame reflected back to its sender fails too (the two
  directions have different keys). Inside a session, sequencing
  (generation, round, request) refuses replays (docs/security.md).
* `Crc32cTag()`: CRC32C of the same bytes, in the first 4 bytes (little
  endian), zeros after. Detects transport corruption, authenticates
  nothing: `--insecure` sessions only.

CRC32C is not computed on authenticated sessions: any corruption that
CRC32C would catch fails the MAC too, so it would be a second pass over
the bytes for nothing.
"""

import hmac
import typing

import blake3
import crc32c

from dyadic_jax.wire import layouts

SECRET_BYTES = 32
_CONTEXT = "dyadic-jax bridge wire v3 {}"
_TAG_END = layouts.TAG_OFFSET + layouts.TAG_BYTES


class Tagger:
  """Computes the tag of a frame (`frame` any bytes-like object)."""
  authenticated = False

  def tag(self, frame: layouts.Buffer) -> bytes:
    raise NotImplementedError


class Crc32cTag(Tagger):
  """CRC32C of the tagged bytes (no authentication)."""

  def tag(self, frame: layouts.Buffer) -> bytes:
    view = memoryview(frame)
    crc = crc32c.crc32c(view[:layouts.TAG_OFFSET])
    crc = crc32c.crc32c(view[_TAG_END:], crc)
    return crc.to_bytes(4, "little") + bytes(layouts.TAG_BYTES - 4)


class Blake3Tag(Tagger):
  """Keyed BLAKE3 of the tagged bytes, truncated to 128 bits."""
  authenticated = True

  def __init__(self, key: bytes) -> None:
    if len(key) != 32:
      raise ValueError(f"Blake3Tag: key of {len(key)} bytes, need 32")
    self._key = bytes(key)

  def tag(self, frame: layouts.Buffer) -> bytes:
    view = memoryview(frame)
    # One thread: on the 2-core machines measured, blake3's thread pool
    # (max_threads=AUTO) was never faster and made a 10 MB tag take either
    # 4 or 8 ms (bench_bridge `blake3_threads`).
    h = blake3.blake3(view[:layouts.TAG_OFFSET], key=self._key)
    h.update(view[_TAG_END:])
    return h.digest(layouts.TAG_BYTES)


def seal(frame: bytearray | memoryview, tagger: Tagger) -> None:
  """Writes the tag of a writable frame (a bytearray or memoryview)."""
  view = memoryview(frame).cast("B")
  view[layouts.TAG_OFFSET:_TAG_END] = tagger.tag(view)


def check(frame: layouts.Buffer, tagger: Tagger) -> bool:
  """True when the frame's tag is the one `tagger` computes (constant time)."""
  view = memoryview(frame).cast("B")
  if len(view) < layouts.HEADER_BYTES:
    return False
  return hmac.compare_digest(bytes(view[layouts.TAG_OFFSET:_TAG_END]),
                             tagger.tag(view))


def tag_of(frame: layouts.Buffer) -> bytes:
  """The tag bytes a frame carries."""
  return bytes(memoryview(frame).cast("B")[layouts.TAG_OFFSET:_TAG_END])


class Keys(typing.NamedTuple):
  """One side's taggers: what it seals with, what it checks with."""
  send: Tagger
  recv: Tagger

  @property
  def authenticated(self) -> bool:
    return self.send.authenticated


VERIFIER, WORKER = "verifier", "worker"
_V2W, _W2V = "v->w", "w->v"


def _derive(purpose: str, material: bytes) -> bytes:
  return blake3.blake3(material, derive_key_context=_CONTEXT.format(
      purpose)).digest(32)


def _keys(role: str, v2w: Tagger, w2v: Tagger) -> Keys:
  if role == VERIFIER:
    return Keys(v2w, w2v)
  if role == WORKER:
    return Keys(w2v, v2w)
  raise ValueError(f"auth: role {role!r} is neither {VERIFIER!r} nor "
                   f"{WORKER!r}")


def _check_secret(secret: bytes | None) -> None:
  if secret is not None and len(secret) != SECRET_BYTES:
    raise ValueError(f"auth: the deployment secret has {len(secret)} bytes, "
                     f"need {SECRET_BYTES}")


def hello_keys(secret: bytes | None, role: str) -> Keys:
  """Keys of the HELLO exchange's unkeyed part (verifier HELLO, refusals).

  secret: the deployment secret (32 bytes), or None: `--insecure`.
  """
  _check_secret(secret)
  if secret is None:
    return _keys(role, Crc32cTag(), Crc32cTag())
  return _keys(role, Blake3Tag(_derive("hello " + _V2W, secret)),
               Blake3Tag(_derive("hello " + _W2V, secret)))


def session_keys(secret: bytes | None, session: int, nonce_v: bytes,
                 nonce_w: bytes, role: str) -> Keys:
  """Keys of one session: from the secret and both HELLO nonces."""
  _check_secret(secret)
  if secret is None:
    return _keys(role, Crc32cTag(), Crc32cTag())
  material = (bytes(secret) + int(session).to_bytes(8, "little")
              + bytes(nonce_v) + bytes(nonce_w))
  return _keys(role, Blake3Tag(_derive("session " + _V2W, material)),
               Blake3Tag(_derive("session " + _W2V, material)))


def refusal_keys(secret: bytes | None, refused_tag: bytes, role: str) -> Keys:
  """Keys of a worker's refusal (RESET REFUSED) of one frame: from the
  secret and the refused frame's own tag.

  A worker that knows no session still holds the secret, so its refusal
  can be authentic; keying it by the tag of the frame it refuses binds it
  to that frame: the verifier accepts it only for the HELLO or STEP it
  sent itself (a refusal of a frame someone else made up, or sent to
  another worker, fails).
  """
  _check_secret(secret)
  if secret is None:
    return _keys(role, Crc32cTag(), Crc32cTag())
  material = bytes(secret) + bytes(refused_tag)
  return _keys(role, Blake3Tag(_derive("refusal " + _V2W, material)),
               Blake3Tag(_derive("refusal " + _W2V, material)))
