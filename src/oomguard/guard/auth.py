"""Optional client API keys with roles (pure: headers in, identity out).

With no keys configured (the default) the gateway authenticates nobody and honours no priority
from clients: a priority is a claim on other clients' capacity, so it must come from a key
whose role allows it. With keys configured, every generation request must carry one
(``Authorization: Bearer KEY`` or ``x-api-key: KEY``, as the OpenAI and Anthropic clients send
them); ``role: priority`` keys may set ``x-priority`` (or the body's ``priority``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from oomguard.guard.config import ApiKeyConfig
from oomguard.guard.openai_body import ApiError


@dataclass(frozen=True)
class ClientIdentity:
    """Who sent a request: the key's name (``anonymous`` without keys) and its role."""

    name: str
    may_set_priority: bool


ANONYMOUS = ClientIdentity("anonymous", may_set_priority=False)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class ApiKeys:
    """The configured keys, compared by SHA-256 digest in constant time."""

    def __init__(self, keys: Sequence[ApiKeyConfig]) -> None:
        self._keys: list[tuple[bytes, ClientIdentity]] = []
        for k in keys:
            digest = _digest(k.key) if k.key is not None else bytes.fromhex(k.key_sha256 or "")
            self._keys.append((digest, ClientIdentity(k.name, k.role == "priority")))

    @property
    def enabled(self) -> bool:
        """Whether clients must present a key."""
        return bool(self._keys)

    def identify(self, headers: Mapping[str, str]) -> ClientIdentity:
        """The client behind ``headers``; raises ApiError(401) for a missing or unknown key."""
        if not self._keys:
            return ANONYMOUS
        presented = _presented_key(headers)
        if presented is None:
            raise ApiError(
                401,
                "this gateway needs an API key: send 'Authorization: Bearer KEY'",
                type_="authentication_error",
                code="missing_api_key",
            )
        digest = _digest(presented)
        found: ClientIdentity | None = None
        for known, identity in self._keys:
            if hmac.compare_digest(known, digest):
                found = identity
        if found is None:
            raise ApiError(
                401,
                "the API key is not known to this gateway; check the key you send",
                type_="authentication_error",
                code="invalid_api_key",
            )
        return found


def _presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None
