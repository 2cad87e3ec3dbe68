"""Where the API keys come from (config, environment variable, mounted Secret file, a keys file naming
each key's tenant and reloaded when it changes), and that a key never shows in a repr, a log line or
an error."""
import json
import logging
import os

import pytest

from cluster.serve import api_key
from cluster.serve.api_key import ApiKeyUnavailable
from cluster.serve.service import ServiceLimits, SpecService, Unauthorized
from speculators.lookahead import LookaheadConfig

KEY = "s3cret-key-value"


def service(limits: ServiceLimits) -> SpecService:
    return SpecService([], tokenizer=None, model_id="m", method="pld", default_lookahead=LookaheadConfig(), limits=limits)


def check_only_the_key_passes(server: SpecService) -> None:
    server.authorize(f"Bearer {KEY}")
    server.authorize(KEY)
    for wrong in (None, "", "Bearer nope", f"Bearer {KEY}x", "Bearer \udcff"):
        with pytest.raises(Unauthorized) as refused:
            server.authorize(wrong)
        assert KEY not in str(refused.value)


def test_key_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv("SPECSERVE_TEST_KEY", KEY + "\n")
    check_only_the_key_passes(service(ServiceLimits(api_key_env="SPECSERVE_TEST_KEY")))


def test_key_from_a_mounted_secret_file(tmp_path):
    (tmp_path / "api-key").write_text(KEY)
    check_only_the_key_passes(service(ServiceLimits(api_key_file=str(tmp_path / "api-key"))))


def test_key_from_the_config_is_still_accepted():
    check_only_the_key_passes(service(ServiceLimits(api_key=KEY)))


@pytest.mark.parametrize("limits, message", [
    (ServiceLimits(api_key_env="SPECSERVE_UNSET_KEY"), "SPECSERVE_UNSET_KEY"),
    (ServiceLimits(api_key_file="/nonexistent/api-key"), "/nonexistent/api-key"),
    (ServiceLimits(api_key=KEY, api_key_env="X"), "at most one"),
], ids=["unset-variable", "missing-file", "two-sources"])
def test_a_named_source_that_is_missing_stops_the_start(limits, message, monkeypatch):
    monkeypatch.delenv("SPECSERVE_UNSET_KEY", raising=False)
    with pytest.raises(ApiKeyUnavailable, match=message):
        service(limits)


def test_an_empty_key_is_refused(monkeypatch):
    monkeypatch.setenv("SPECSERVE_TEST_KEY", "  ")
    with pytest.raises(ApiKeyUnavailable, match="empty"):
        service(ServiceLimits(api_key_env="SPECSERVE_TEST_KEY"))


def test_the_key_never_shows_in_reprs_dumps_or_logs(caplog):
    limits = ServiceLimits(api_key=KEY)
    caplog.set_level(logging.DEBUG)
    server = service(limits)
    with pytest.raises(Unauthorized):
        server.authorize("Bearer wrong")
    shown = [repr(limits), str(limits), limits.model_dump_json(), str(limits.model_dump()), caplog.text]
    assert all(KEY not in text for text in shown)


# ---- a keys file: one tenant per key, reloaded on change -------------------------------------------


def keys_file(path, text: str) -> str:
    path.write_text(text)
    stamp = path.stat()
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # a change the stat sees, however fast
    return str(path)


def test_each_key_of_a_keys_file_names_its_tenant(tmp_path):
    server = service(ServiceLimits(api_keys_file=keys_file(tmp_path / "keys.yaml", f"{KEY}: alice\nk-bob: bob\n"
                                                                                    "k-alice-2: alice\n")))
    assert server.authorize(f"Bearer {KEY}") == "alice" == server.authorize("k-alice-2")
    assert server.authorize("Bearer k-bob") == "bob"
    for wrong in (None, "", "Bearer alice", f"Bearer {KEY}x"):
        with pytest.raises(Unauthorized):
            server.authorize(wrong)
    assert KEY not in repr(server._api_keys)


def test_a_changed_keys_file_is_read_again_without_a_restart(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(api_key, "RELOAD_S", 0.0)
    path = tmp_path / "keys.json"
    server = service(ServiceLimits(api_keys_file=keys_file(path, json.dumps({KEY: "alice"}))))
    assert server.authorize(KEY) == "alice"
    keys_file(path, json.dumps({"k-new": "bob"}))  # KEY revoked, a new key added
    assert server.authorize("k-new") == "bob"
    with pytest.raises(Unauthorized):
        server.authorize(KEY)
    keys_file(path, "{not json: [")  # a bad rewrite keeps the last good keys, and says so
    assert server.authorize("k-new") == "bob"
    assert "keeping the previous API keys" in caplog.text and "k-new" not in caplog.text


@pytest.mark.parametrize("text, message", [
    ("[]", "non-empty mapping"),
    (f"{KEY}: ''", "entry 1: the tenant"),
    ("x: a\n1234: b", "entry 2: the key must be a non-empty string"),
    (f"{KEY}: [alice", "not a YAML or JSON mapping"),
], ids=["a-list", "empty-tenant", "number-key", "bad-yaml"])
def test_a_bad_keys_file_stops_the_start_naming_the_field(tmp_path, text, message):
    with pytest.raises(ApiKeyUnavailable, match=message) as refused:
        service(ServiceLimits(api_keys_file=keys_file(tmp_path / "keys.yaml", text)))
    assert "limits.api_keys_file" in str(refused.value) and KEY not in str(refused.value)


def test_a_keys_file_and_a_single_key_are_not_both_given(tmp_path):
    with pytest.raises(ApiKeyUnavailable, match="at most one"):
        service(ServiceLimits(api_key=KEY, api_keys_file=keys_file(tmp_path / "keys.yaml", "k: t")))
