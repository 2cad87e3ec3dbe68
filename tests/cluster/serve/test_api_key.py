"""Where the API key comes from (config, environment variable, mounted Secret file), and that it never
shows in a repr, a log line or an error."""
import logging

import pytest

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
