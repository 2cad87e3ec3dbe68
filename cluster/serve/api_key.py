"""Where a replica's API key comes from: the config, an environment variable, or a file (a mounted
Kubernetes Secret). The key is held as a SecretStr, so no repr, log line or error shows it."""
from __future__ import annotations

import os
from pathlib import Path

from pydantic import SecretStr


class ApiKeyUnavailable(RuntimeError):
    """A configured key source is missing or empty: refuse to start rather than serve without a key."""


def resolve_api_key(value: SecretStr | None, env: str | None, file: str | None) -> SecretStr | None:
    """The key from the one source configured (None: no key, the server is open)."""
    given = [name for name, source in (("api_key", value), ("api_key_env", env), ("api_key_file", file)) if source]
    if len(given) > 1:
        raise ApiKeyUnavailable(f"give at most one of api_key, api_key_env and api_key_file (got {', '.join(given)})")
    if value is not None:
        key = value.get_secret_value()
    elif env:
        if env not in os.environ:
            raise ApiKeyUnavailable(f"api_key_env names {env!r}, which is not set in this process's environment")
        key = os.environ[env]
    elif file:
        try:
            key = Path(file).read_text()
        except OSError as error:
            raise ApiKeyUnavailable(f"api_key_file {file!r} cannot be read ({type(error).__name__})") from None
    else:
        return None
    key = key.strip()
    if not key:
        raise ApiKeyUnavailable(f"the API key from {given[0]} is empty")
    return SecretStr(key)
