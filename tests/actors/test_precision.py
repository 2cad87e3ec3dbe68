"""dtype auto: bfloat16 only where the hardware multiplies it natively."""
import pytest

from actors.model import precision
from cluster.engine.config import EngineConfig


@pytest.mark.parametrize("native, exact, expected",
                         [(True, True, "bfloat16"), (False, True, "float32"), (True, False, "float32")])
def test_auto_gives_a_cpu_bfloat16_only_where_it_is_native_and_exact(monkeypatch, native, exact, expected):
    monkeypatch.setattr(precision, "cpu_has_bfloat16", lambda: native)
    monkeypatch.setattr(precision, "cpu_bfloat16_is_exact", lambda: exact)
    assert precision.resolve_dtype("auto", "cpu") == expected
    assert precision.resolve_dtype("auto", "cuda") == "bfloat16"
    assert precision.resolve_dtype("float16", "cpu") == "float16"  # a dtype named is kept


def test_the_engine_config_holds_the_resolved_dtype_so_every_actor_reads_one_answer(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bfloat16", lambda: True)
    monkeypatch.setattr(precision, "cpu_bfloat16_is_exact", lambda: True)
    assert EngineConfig().dtype == "bfloat16"  # auto, the default
    assert EngineConfig(dtype="float32").dtype == "float32"
