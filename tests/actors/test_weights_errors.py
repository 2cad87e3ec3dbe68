"""Weights load from safetensors or GGUF only, and a truncated or malformed file says which file and why."""
import shutil

import pytest

from actors.model.loader import WeightsError, load_model, packaged_gguf, resolve_model


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    return copy


@pytest.mark.parametrize("damage", ["truncated", "header-only", "garbage"])
def test_a_damaged_safetensors_file_is_named(model_dir, damage):
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "header-only": data[:5], "garbage": b"\0" * 64}[damage])
    with pytest.raises(WeightsError, match="model.safetensors: not a readable safetensors file"):
        load_model(model_dir)


def test_other_weight_formats_are_refused(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        load_model(model_dir)


@pytest.mark.default_model
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_gguf_file_is_named(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    if damage == "truncated":
        with packaged_gguf("smollm2-135m").open("rb") as source:
            broken.write_bytes(source.read(4 << 20))
    else:
        broken.write_bytes(b"GGUF" + b"\1" * 60)
    with pytest.raises(WeightsError, match="broken.gguf: not a readable GGUF file"):
        resolve_model(broken)
    assert not list((tmp_path / "cache").glob("broken*"))  # nothing half-converted is left to load later
