"""The tiny target and draft of the losslessness harness, written once per test session."""
from __future__ import annotations

import pytest

from bench.lossless.target import TinyModels


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("lossless"))
