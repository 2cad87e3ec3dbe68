"""Shared fixtures: tiny random Llama-family models built in the test, and the default model."""
from __future__ import annotations

import functools
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.model.config import DecoderConfig
from actors.model.llama import LlamaDecoder

# The suite is dominated by tiny matrices, where a second thread only adds synchronisation; one
# thread also keeps it steady when something else is using the machine's other core.
torch.set_num_threads(1)


def tiny_hf_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_pair(seed: int = 0, dtype=torch.float64, **overrides) -> tuple[LlamaDecoder, LlamaForCausalLM]:
    """Our decoder and transformers' reference with the same random weights."""
    torch.manual_seed(seed)
    hf_config = tiny_hf_config(**overrides)
    reference = LlamaForCausalLM(hf_config).to(dtype).eval()
    ours = LlamaDecoder(DecoderConfig.from_hf(hf_config)).to(dtype)
    ours.load_state_dict(reference.state_dict(), strict=False)
    return ours, reference


class IdTokenizer:
    """Enough of a tokenizer for the engine: token ids printed as words."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def wait_until_loop_idle(loop, seconds: float = 10.0) -> None:
    """Until an EngineLoop holds no request and its engine has no work (an aborted request has left),
    or `seconds` pass; the caller asserts which."""
    deadline = time.monotonic() + seconds
    while (loop.load or loop.engine.has_work) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture(scope="session", autouse=True)
def cost_curves_in_a_temporary_folder(tmp_path_factory):
    """Curves measured by tests (tiny models in temporary folders) stay out of the user's cache.
    Set in the environment, so that Ray workers started by the tests inherit it."""
    import os

    os.environ["SPECSERVE_COST_CURVES"] = str(tmp_path_factory.mktemp("cost-curves"))


SHARED_RAY = "shared_ray"


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected, and after --lf / --ff reorder
def pytest_collection_modifyitems(items):
    """The modules on the shared Ray (those whose tests ask for it, directly or through a fixture) run
    last, one after another in their usual order: Ray starts once for all of them, lives from the
    first to the end of the session, and is never running when a module starts a cluster of its own."""
    shared = {item.path for item in items if SHARED_RAY in item.fixturenames}
    items[:] = [item for item in items if item.path not in shared] + [item for item in items if item.path in shared]


RAY_USE = re.compile(r"^\s*import ray\b|\b(ray_four_gpus|shared_serve|local_ray|serve_on_local_ray)\b", re.MULTILINE)
"""What a module that starts or joins a Ray cluster says: it imports ray, or asks for a cluster of
tests/cluster/ray_fixtures.py."""


def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist (`-n 2`, pyproject's addopts), one worker runs every module that uses Ray,
    in their order above, while the other takes the rest one test at a time (in-process tests, one
    torch thread each): two Ray clusters at once on a 2-core machine would only fight over it."""
    from xdist.scheduler import LoadScopeScheduling

    class RayModulesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if _uses_ray(path) else nodeid

    return RayModulesOnOneWorker(config, log)


@functools.cache
def _uses_ray(path: str) -> bool:
    return RAY_USE.search(Path(path).read_text()) is not None


@pytest.fixture(scope="session")
def shared_ray():
    """One local Ray (2 CPUs, 4 fake GPUs) for every module that asks for it (through `ray_four_gpus`,
    which also waits for it to be idle), instead of one started per module (seconds each)."""
    from tests.cluster.ray_fixtures import local_ray

    with local_ray(num_gpus=4):
        yield


@pytest.fixture(scope="session")
def shared_serve_ports(shared_ray):
    """(HTTP port, gRPC port) of the one Serve instance on the shared Ray, started by the first module
    that deploys to it (through `shared_serve`, which deletes each module's applications)."""
    from tests.cluster.ray_fixtures import free_port, serve_started

    http_port, grpc_port = free_port(), free_port()
    with serve_started(grpc_port, {"host": "127.0.0.1", "port": http_port}):
        yield http_port, grpc_port


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_pair()


@pytest.fixture(scope="session")
def default_model_path():
    from actors.model.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


DEFAULT_MODEL_CPU_CURVE = [(1, 0.0447), (2, 0.0436), (4, 0.0636), (8, 0.0847), (16, 0.1110), (32, 0.1543), (64, 0.2539)]
"""(tokens, seconds) of one-sequence verification passes of the default target, measured on the
2-core CPU the suite runs on (2026-12-03, as `measure` measures them)."""


@pytest.fixture(scope="session")
def default_model_cost_curve(default_model_path):
    """The default target's cost curve, given where this process's one-sequence engines (build_engine
    as the command line and `bench specbench` build it) read theirs: they plan on it instead of
    measuring one (seconds on a CPU). The planner's drafting is what their tests run, not the timing."""
    import json

    from cluster.engine.build import cost_key_of
    from cluster.engine.config import EngineConfig
    from cluster.engine.cost import CostCurve, CostPoint, curves_folder

    curve = CostCurve([CostPoint(tokens, 1, seconds) for tokens, seconds in DEFAULT_MODEL_CPU_CURVE])
    key = cost_key_of(EngineConfig(model=str(default_model_path), max_sequences=1))
    (curves_folder() / f"{key}.json").write_text(json.dumps(curve.to_json()))
    return curve


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_path):
    """A tiny random Llama saved as a Hugging Face directory (with the default model's tokenizer,
    which only decodes text here), for code paths that load models by path: Ray actors."""
    _, reference = tiny_pair(dtype=torch.float32)
    return _with_default_tokenizer(reference, tmp_path_factory.mktemp("tiny-llama"), default_model_path)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, default_model_path):
    """A tiny random Llama over the default model's whole vocabulary, with its tokenizer and chat
    template: commands that encode text (specserve train) run end to end on it in seconds."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(default_model_path).vocab_size
    _, reference = tiny_pair(dtype=torch.float32, vocab_size=vocab)
    return _with_default_tokenizer(reference, tmp_path_factory.mktemp("tiny-chat-llama"), default_model_path)


def _with_default_tokenizer(reference: LlamaForCausalLM, path, default_model_path):
    import shutil

    reference.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (default_model_path / name).exists():
            shutil.copy(default_model_path / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_heads(tiny_model, tmp_path_factory):
    """(EAGLE-3 head, Medusa heads, their held-out figures) trained for seconds on the tiny target's
    own answers, the way `specserve train` trains: drafts of theirs get accepted. Loaded from
    tests/data/tiny-heads when they were trained from this target with these settings."""
    from tests.speculators.heads_fixtures import tiny_heads

    return tiny_heads(tiny_model[0], tmp_path_factory.mktemp("tiny-heads"))


@pytest.fixture(scope="session")
def tiny_dflash(tiny_model, tmp_path_factory):
    """(DFlash drafter, its held-out figures) trained for half a minute on the tiny target's answers."""
    from tests.speculators.heads_fixtures import trained_tiny_dflash

    return trained_tiny_dflash(tiny_model[0], tmp_path_factory.mktemp("tiny-dflash"))


@pytest.fixture(scope="session")
def self_signed_cert(tmp_path_factory):
    """(certfile, keyfile) of a certificate for localhost / 127.0.0.1, made with the openssl tool."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    path = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(path / "key.pem"), "-out", str(path / "cert.pem"), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return path / "cert.pem", path / "key.pem"
