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
* `GmacTag(key)`: AES-256-GMAC (`cryptography`, i.e. OpenSSL's AES-NI and
  carry-less multiply code), for the worker's PACKED frames of a session
  that agreed `Feature.GMAC`: three times faster than BLAKE3 on the
  2-core x86 machines measured (10.3 MB: 2.1 ms against 6.8 ms), which is
  what lets a dense batch's MAC cost about one copy of it. The nonce is
  the header's bytes [12, 24): the reserved u32, which the sealer sets to
  its count of frames sealed with that key (1, 2, ...), then the session
  id. The GCM tag covers the header's [0, 32) as the (discarded)
  ciphertext's input and [48, length) as associated data, so it binds the
  same bytes as a BLAKE3 tag. GMAC's one requirement, a nonce never used
  twice with one key for two messages, holds because each session has its
  own key per direction and the worker's session object is the only
  sealer of its PACKED frames (a cached frame is resent as the same bytes,
  never resealed); past 2^32 - 1 frames the sealer refuses to seal
  (docs/security.md).

      GMAC key, direction d = derive("session gmac " + d,
                                     secret | session | nonce_v | nonce_w)

* `Crc32cTag()`: CRC32C of the same bytes, in the first 4 bytes (little
  endian), zeros after. Detects transport corruption, authenticates
  nothing: `--insecure` sessions only.

A session's taggers are `ByKind`: its PACKED frames by GMAC when agreed,
every other frame by BLAKE3.

CRC32C is not computed on authenticated sessions: any corruption that
CRC32C would catch fails the MAC too, so it would be a second pass over
the bytes for nothing.
"""

import hmac
import typing

import blake3
import crc32c

from dyadic_jax.wire import layouts
from dyadic_jax.wire.key_sizes import SECRET_BYTES
from dyadic_jax.wire.refusals import Code, ProtocolError

_CONTEXT = "dyadic-jax bridge wire v3 {}"
_TAG_END = layouts.TAG_OFFSET + layouts.TAG_BYTES


class Tagger:
  """Computes the tag of a frame (`frame` any bytes-like object)."""
  authenticated = False

  def tag(self, frame: layouts.Buffer) -> bytes:
    raise NotImplementedError

  def prepare(self, frame: memoryview) -> None:
    """Called by `seal` before `tag`: writes what the tag's input needs
    from the sealer (nothing, but for GMAC's frame counter)."""
    del frame

  @property
  def spent(self) -> bool:
    """True when this sealer can seal no more frames (GMAC's counter's
    end): its session must end before it seals again."""
    return False


class SealsExhausted(ProtocolError):
  """A sealer asked for one frame past its counter's end (SESSION_EXHAUSTED)."""

  def __init__(self) -> None:
    super().__init__(Code.SESSION_EXHAUSTED, "2^32 - 1 frames sealed with one "
                     "key; the session must end (a new HELLO, new keys)")


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
    # The keyed state, copied for each tag: a copy costs ~0.6 us, a keyed
    # constructor ~1 us (a round seals and checks a dozen small frames).
    self._keyed = blake3.blake3(key=self._key)

  def tag(self, frame: layouts.Buffer) -> bytes:
    view = memoryview(frame)
    # One thread: on the 2-core machines measured, blake3's thread pool
    # (max_threads=AUTO) was never faster and made a 10 MB tag take either
    # 4 or 8 ms (bench_bridge `blake3_threads`).
    h = self._keyed.copy()
    h.update(view[:layouts.TAG_OFFSET])
    h.update(view[_TAG_END:])
    return h.digest(layouts.TAG_BYTES)


# The header's reserved u32 and session u64: GMAC's 96-bit nonce.
_NONCE = slice(12, 24)
_COUNTER = slice(12, 16)
_KIND = slice(6, 8)
_PACKED = int(layouts.Kind.PACKED).to_bytes(2, "little")
# cryptography's AEAD refuses more than this many bytes of associated data.
GMAC_MAX_FRAME = (1 << 31) - 1


class GmacTag(Tagger):
  """AES-256-GMAC of the tagged bytes, the nonce from the header (above)."""
  authenticated = True

  def __init__(self, key: bytes) -> None:
    if len(key) != 32:
      raise ValueError(f"GmacTag: key of {len(key)} bytes, need 32")
    # pylint: disable-next=g-import-not-at-top
    from cryptography.hazmat.primitives.ciphers import aead
    self._aead = aead.AESGCM(bytes(key))
    self._sealed = 0

  @property
  def spent(self) -> bool:
    return self._sealed >= 0xFFFFFFFF

  def prepare(self, frame: memoryview) -> None:
    if self.spent:       # the nonce would repeat under this key
      raise SealsExhausted()
    self._sealed += 1
    frame[_COUNTER] = self._sealed.to_bytes(4, "little")

  def tag(self, frame: layouts.Buffer) -> bytes:
    view = memoryview(frame).cast("B")
    if len(view) > GMAC_MAX_FRAME:
      raise ValueError(f"GmacTag: a frame of {len(view)} bytes, at most "
                       f"{GMAC_MAX_FRAME}")
    return self._aead.encrypt(bytes(view[_NONCE]),
                              bytes(view[:layouts.TAG_OFFSET]),
                              view[_TAG_END:])[-layouts.TAG_BYTES:]


class ByKind(Tagger):
  """PACKED frames by `packed`, every other frame by `other` (each read
  only: a frame's tag under either, a test's forgery)."""
  authenticated = True

  def __init__(self, other: Tagger, packed: Tagger) -> None:
    self.other, self.packed = other, packed

  def _of(self, view: memoryview) -> Tagger:
    return self.packed if view[_KIND] == _PACKED else self.other

  def prepare(self, frame: memoryview) -> None:
    self._of(frame).prepare(frame)

  @property
  def spent(self) -> bool:
    return self.other.spent or self.packed.spent

  def tag(self, frame: layouts.Buffer) -> bytes:
    view = memoryview(frame).cast("B")
    return self._of(view).tag(view)


def seal(frame: bytearray | memoryview, tagger: Tagger) -> None:
  """Writes the tag of a writable frame (a bytearray or memoryview)."""
  view = memoryview(frame).cast("B")
  tagger.prepare(view)
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
                 nonce_w: bytes, role: str, *, gmac: bool = False) -> Keys:
  """Keys of one session: from the secret and both HELLO nonces.

  gmac: the session agreed `Feature.GMAC`: its PACKED frames are tagged
  with `GmacTag` (every other frame, and the HELLO answer, with BLAKE3).
  Make a session's keys once: the sealer's frame counter lives in them.
  """
  _check_secret(secret)
  if secret is None:
    return _keys(role, Crc32cTag(), Crc32cTag())
  material = (bytes(secret) + int(session).to_bytes(8, "little")
              + bytes(nonce_v) + bytes(nonce_w))
  taggers = []
  for d in (_V2W, _W2V):
    tagger: Tagger = Blake3Tag(_derive("session " + d, material))
    if gmac:
      tagger = ByKind(tagger, GmacTag(_derive("session gmac " + d,
                                              material)))
    taggers.append(tagger)
  return _keys(role, *taggers)


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
