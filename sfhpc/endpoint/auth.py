"""The run's bearer token: a fresh secret per run that the endpoint demands on every route and that the
run's own HTTP agents send (``api_key`` of the ``openai`` client).

Loopback is not a boundary on a shared node: every user logged in there can reach 127.0.0.1. So a run
gives its endpoint a token of its own even when it listens on loopback only; agents in the rank's own
process go through the in-process client and need none.
"""

from __future__ import annotations

import hmac
import secrets

TOKEN_BYTES = 32  # 256 random bits, URL-safe text of 43 characters


def new_run_token() -> str:
    """A new random bearer token (from the OS's cryptographic source)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries `token` (compared in constant time)."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())
