"""Where a replica's API keys come from, and which tenant each names.

One key (`api_key`, `api_key_env` or `api_key_file`: the config, an environment variable, a file) is
one tenant, DEFAULT_TENANT. A keys file (`api_keys_file`, a mapping key -> tenant in YAML or JSON, a
mounted Kubernetes Secret) names a tenant per key and is re-read within RELOAD_S of a change, so keys
are added and revoked without a restart. Keys are held as SHA-256 digests: no repr, log line or
error shows one, and a lookup compares digests, so its timing tells nothing about a key.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import yaml
from pydantic import SecretStr

DEFAULT_TENANT = "default"
"""The tenant of the single key."""
RELOAD_S = 1.0
"""How often a keys file is checked for a change (a stat), at most."""
log = logging.getLogger("ray.serve")


class ApiKeyUnavailable(RuntimeError):
    """A configured key source is missing, empty or malformed: refuse to start rather than serve
    without the keys."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).digest()


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten (a Secret's update swaps a symlink)."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size, status.st_ino


def read_keys_file(path: str) -> dict[str, str]:
    """key -> tenant from a keys file; ApiKeyUnavailable names the field and the entry, never a key."""
    where = f"limits.api_keys_file {path!r}"
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ApiKeyUnavailable(f"{where} cannot be read ({type(error).__name__})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:  # its message quotes the line, which may hold a key: only the position
        mark = getattr(error, "problem_mark", None)
        raise ApiKeyUnavailable(f"{where} is not a YAML or JSON mapping of key -> tenant"
                                + (f" (line {mark.line + 1})" if mark else "")) from None
    if not isinstance(data, dict) or not data:
        raise ApiKeyUnavailable(f"{where} must be a non-empty mapping of API key -> tenant name")
    tenants = {}
    for index, (key, tenant) in enumerate(data.items(), 1):
        if not isinstance(key, str) or not key.strip():
            raise ApiKeyUnavailable(f"{where}: entry {index}: the key must be a non-empty string (quote it)")
        if not isinstance(tenant, str) or not tenant.strip() or "\0" in tenant:
            raise ApiKeyUnavailable(f"{where}: entry {index}: the tenant must be a non-empty string")
        tenants[key.strip()] = tenant.strip()
    return tenants


class ApiKeys:
    """Which tenant each key names (None: not a key of this deployment)."""

    def __init__(self, tenants: dict[str, str], path: str | None = None):
        self.path = path
        self._by_digest = {_digest(key): tenant for key, tenant in tenants.items()}
        self._stamp = _stamp(path) if path else None
        self._checked = time.monotonic()

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        stamp = _stamp(path)
        keys = cls(read_keys_file(path), path)
        keys._stamp = stamp  # the file as read, so a change while reading is read again
        return keys

    def tenant_of(self, presented: str) -> str | None:
        self._reload_if_changed()
        return self._by_digest.get(_digest(presented)) if presented else None

    def _reload_if_changed(self) -> None:
        """A changed file replaces the keys; a file that no longer reads keeps the last good ones (logged)."""
        now = time.monotonic()
        if self.path is None or now - self._checked < RELOAD_S:
            return
        self._checked = now
        stamp = _stamp(self.path)
        if stamp is None or stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            tenants = read_keys_file(self.path)
        except ApiKeyUnavailable as error:
            log.warning("keeping the previous API keys: %s", error)
            return
        self._by_digest = {_digest(key): tenant for key, tenant in tenants.items()}
        log.info("limits.api_keys_file reloaded: %d keys, %d tenants", len(tenants), len(set(tenants.values())))

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._by_digest)} keys{', from ' + self.path if self.path else ''})"


def resolve_api_keys(value: SecretStr | None, env: str | None, file: str | None,
                     keys_file: str | None = None) -> ApiKeys | None:
    """The keys from the one source configured (None: no key, the server is open)."""
    given = [name for name, source in (("api_key", value), ("api_key_env", env), ("api_key_file", file),
                                       ("api_keys_file", keys_file)) if source]
    if len(given) > 1:
        raise ApiKeyUnavailable(f"give at most one of api_key, api_key_env, api_key_file and api_keys_file "
                                f"(got {', '.join(given)})")
    if keys_file:
        return ApiKeys.from_file(keys_file)
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
    return ApiKeys({key: DEFAULT_TENANT})
