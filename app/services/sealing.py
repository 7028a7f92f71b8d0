"""Sealing tenants' secrets with the node key: an AEAD from the standard library.

No AEAD is in the standard library and the project's locked dependencies have none, so this is
the textbook generic composition, encrypt-then-MAC, with HMAC-SHA256 as the only primitive:

- two keys derived from the node key (HMAC-SHA256 with distinct labels): one to encrypt, one
  to authenticate;
- encryption: CTR mode over the PRF, keystream block i = HMAC(k_enc, nonce || i), with a fresh
  random 128-bit nonce per seal (no nonce is ever reused with one key in practice);
- authentication: tag = HMAC(k_mac, format || nonce || len(aad) || aad || ciphertext), checked
  in constant time before anything is decrypted.

HMAC-SHA256 is a PRF, so CTR over it is IND-CPA and encrypt-then-MAC with an independent key
gives an AEAD (IND-CCA2, integrity of ciphertexts). The associated data binds a value to its
owner and name: a value copied to another row of the database does not open there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import stat
import time
from pathlib import Path

from app.errors import Unavailable
from app.settings import Settings

KEY_BYTES = 32
_FORMAT = b"\x01"  # the first byte of every sealed value: which construction sealed it
_NONCE = 16
_TAG = 32
_BLOCK = 32  # bytes of one SHA-256 keystream block


class Unsealable(Exception):
    """A sealed value did not open: another node key sealed it, or it was altered."""


def key_mismatch(what: str, then: str = "ask the operator") -> Unavailable:
    """The error for a sealed value this node's key does not open (503 `secrets_key_mismatch`)."""
    return Unavailable(
        f"{what} does not open with this node's secrets key: every node of a cluster must have the same "
        f"TENSORWASM_SECRETS_KEY; {then}", code="secrets_key_mismatch",
    )


class SecretBox:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"the secrets key must be {KEY_BYTES} bytes")
        self._enc = hmac.digest(key, b"tensorwasm secrets: encryption", "sha256")
        self._mac = hmac.digest(key, b"tensorwasm secrets: authentication", "sha256")

    def __repr__(self) -> str:
        return "SecretBox(<key>)"

    def _keystream(self, nonce: bytes, size: int) -> bytes:
        enc = hmac.new(self._enc, nonce, hashlib.sha256)
        blocks = []
        for i in range((size + _BLOCK - 1) // _BLOCK):
            h = enc.copy()
            h.update(i.to_bytes(8, "big"))
            blocks.append(h.digest())
        return b"".join(blocks)[:size]

    def _tag(self, nonce: bytes, aad: bytes, ciphertext: bytes) -> bytes:
        return hmac.digest(self._mac, _FORMAT + nonce + len(aad).to_bytes(8, "big") + aad + ciphertext, "sha256")

    def _xor(self, data: bytes, nonce: bytes) -> bytes:
        stream = self._keystream(nonce, len(data))
        return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")

    def seal(self, plaintext: bytes, aad: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        ciphertext = self._xor(plaintext, nonce)
        return _FORMAT + nonce + ciphertext + self._tag(nonce, aad, ciphertext)

    def open(self, sealed: bytes, aad: bytes) -> bytes:
        if len(sealed) < 1 + _NONCE + _TAG or sealed[:1] != _FORMAT:
            raise Unsealable("not a sealed value")
        nonce, ciphertext, tag = sealed[1 : 1 + _NONCE], sealed[1 + _NONCE : -_TAG], sealed[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(nonce, aad, ciphertext)):
            raise Unsealable("the value does not open with this key")
        return self._xor(ciphertext, nonce)


def parse_key(text: str) -> bytes:
    """32 bytes as 64 hex digits, or as base64 (standard or URL-safe)."""
    text = text.strip()
    try:
        if len(text) == 2 * KEY_BYTES:
            return bytes.fromhex(text)
        key = base64.urlsafe_b64decode(text.replace("+", "-").replace("/", "_") + "=" * (-len(text) % 4))
    except (ValueError, binascii.Error):
        raise ValueError("TENSORWASM_SECRETS_KEY must be 32 bytes as 64 hex digits or as base64") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"TENSORWASM_SECRETS_KEY must be 32 bytes (it decodes to {len(key)})")
    return key


class NodeKey:
    """The node's secrets key, read (or generated into the data dir, 0600) on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._box: SecretBox | None = None

    def __repr__(self) -> str:
        return "NodeKey(<key>)"

    def box(self) -> SecretBox:
        if self._box is None:
            self._box = SecretBox(self._load())
        return self._box

    def _load(self) -> bytes:
        given = self.settings.secrets_key
        if given is not None:
            return parse_key(given.get_secret_value())
        self.settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path: Path = self.settings.data_dir / "secrets_key"
        try:  # O_EXCL: of two processes of one node starting at once, one writes, both read it
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(KEY_BYTES) + "\n")
        for _ in range(100):  # the writer may not have written yet
            text = path.read_text().strip()
            if text:
                return parse_key(text)
            time.sleep(0.01)
        raise ValueError(f"{path} is empty: remove it, or set TENSORWASM_SECRETS_KEY")
