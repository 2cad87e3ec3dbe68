"""Head checkpoints in the public layouts, read and written.

Read (the layout is recognised from config.json and the tensor names):
- `eagle3`, vLLM `speculators` format: config.json with `speculators_model_type: "eagle3"`,
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`,
  `eagle_aux_hidden_state_layer_ids`, `speculators_config`; tensors `fc.weight`, `layers.0.*`,
  `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optionally `embed_tokens.weight`. A config without
  `norm_before_residual` is read as vLLM reads it (true).
- `eagle3`, the EAGLE repository's layout: a Llama config with `draft_vocab_size` and tensors under
  `midlayer.` instead of `layers.0.` (norm after the residual, as that code does).
- `eagle` (EAGLE-1/2): a one-layer Llama config, `fc.weight` [H, 2H] (+ bias), `layers.0.*`; the
  target's LM head scores its output.
- `dflash`, z-lab's DFlash block drafters (what vLLM and SGLang load; see speculators/heads/dflash.py):
  a Qwen3-style config with `dflash_config: {mask_token_id, target_layer_ids}`, `block_size`,
  `num_target_layers`; tensors `fc.weight`, `hidden_norm.weight`, `layers.{i}.*`, `norm.weight`; and
  this project's extension, a draft vocabulary (`draft_vocab_size`, `lm_head.weight`, `d2t`).
  DFlash-2 drafters (candidate selector, dynamic convolutions) and sliding-window or causal blocks
  are refused by name.
- `medusa`, vLLM's format: `model_type: "medusa"`, `blocks.{k}.layers.{j}.*`, `lm_heads.{k}.weight`
  (one shared with `original_lm_head`), optional `token_map`; and the Medusa repository's layout
  (`medusa_num_heads`, `medusa_head.{k}.{j}.linear.*`, `medusa_head.{k}.{num_layers}.weight`).
EAGLE-3 aux layers default to vLLM's choice, (2, L // 2, L - 3) of an L-layer target.

Written: EAGLE-3 heads in the `speculators` format, Medusa heads in vLLM's, DFlash drafters in z-lab's, so a head trained here
serves in vLLM and any head read here can be rewritten in those formats (`specserve convert-head`);
EAGLE-1/2 heads in their own layout with safetensors weights.

Weights are read from safetensors only. A head whose weights are PyTorch pickles (`*.bin`, `*.pt`,
as EAGLE-1/2 and some Medusa heads are published) is refused with an error that names
`specserve convert-head`, which reads such files on request (`allow_pickle`) with
`torch.load(weights_only=True)`, accepting only a flat mapping of names to tensors, and writes
safetensors.
"""
from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config

from speculators.heads.dflash import DFlashDrafter
from speculators.heads.eagle import EagleHead
from speculators.heads.medusa import MedusaHeads

WEIGHTS = "model.safetensors"
LAYER_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
              "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings")
"""Written in `transformer_layer_config` even at their defaults, so readers need not know them."""


@dataclass
class HeadCheckpoint:
    kind: str
    """'eagle3', 'eagle' (EAGLE-1/2), 'medusa' or 'dflash'."""
    module: EagleHead | MedusaHeads | DFlashDrafter
    verifier: str | None = None
    """The target it was trained for, as its config names it."""
    medusa_choices: list[list[int]] | None = None
    speculative_tokens: int | None = None
    extra: dict = field(default_factory=dict)


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    return 2, num_target_layers // 2, num_target_layers - 3


class PickledWeights(ValueError):
    """A head whose weights are PyTorch pickles, or a pickle that is not just tensors."""


PICKLES = ("*.bin", "*.pt", "*.pth")


def read_tensors(path: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's *.safetensors files. Without them, PyTorch pickles are
    refused, unless `allow_pickle` (a conversion the user asked for): then they are read with
    `weights_only=True` and must each hold a flat mapping of names to tensors."""
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        for file in files:
            tensors.update(load_file(file))
        return tensors
    pickles = sorted(file for pattern in PICKLES for file in path.glob(pattern))
    if not pickles:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    if not allow_pickle:
        raise PickledWeights(f"{path}: weights are PyTorch pickles ({', '.join(f.name for f in pickles)}), which are not "
                             f"loaded: `specserve convert-head {path} DEST` rewrites them as safetensors")
    for file in pickles:
        tensors.update(_read_pickle(file))
    return tensors


def _read_pickle(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # what the weights-only unpickler raises for anything but tensors
        reason = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\.\s|\n\n|$)", str(error), re.DOTALL)
        reason = " ".join(reason[1].split()) if reason else "objects other than tensors"
        raise PickledWeights(f"{file}: refused, not pure tensors (weights-only read: {reason})") from None
    except Exception as error:  # noqa: BLE001 - whatever torch raises for a file that is no PyTorch save
        raise PickledWeights(f"{file}: not a readable PyTorch weights file ({type(error).__name__})") from None
    if not isinstance(state, dict):
        raise PickledWeights(f"{file}: refused, holds a {type(state).__name__}, not a mapping of names to tensors")
    odd = [name for name, value in state.items() if not (isinstance(name, str) and isinstance(value, torch.Tensor))]
    if odd:
        raise PickledWeights(f"{file}: refused, not pure tensors: {len(odd)} entries are not named tensors, "
                             f"e.g. {odd[:3]}")
    return state


def load_head(path: str | Path, num_target_layers: int | None = None, allow_pickle: bool = False) -> HeadCheckpoint:
    """A head from a checkpoint folder in any layout above; `num_target_layers` fills in EAGLE-3's
    default aux layers and EAGLE-1/2's and Medusa's final-layer input. `allow_pickle`: read
    PyTorch pickles too (tensors only), for `specserve convert-head`; never when serving."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = read_tensors(path, allow_pickle)
    if config.get("model_type") == "medusa" or "medusa_num_heads" in config:
        return _medusa(config, tensors)
    if "dflash_config" in config or any("DFlash" in name for name in config.get("architectures") or ()):
        return _dflash(path, config, tensors)
    if config.get("speculators_model_type") == "eagle3":
        return _eagle3(config, config["transformer_layer_config"], tensors, num_target_layers,
                       config.get("norm_before_residual", True))
    if config.get("speculators_model_type"):
        raise ValueError(f"{path}: speculators model type {config['speculators_model_type']!r} is not supported")
    if "draft_vocab_size" in config or any(name.startswith("midlayer.") for name in tensors):
        renamed = {name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()}
        return _eagle3(config, config, renamed, num_target_layers, config.get("norm_before_residual", False))
    if "fc.weight" in tensors:
        return _eagle1(config, tensors, num_target_layers)
    raise ValueError(f"{path}: not an EAGLE, EAGLE-3, Medusa or DFlash checkpoint this project reads")


def _layer_config(values: dict) -> LlamaConfig:
    values = {k: v for k, v in values.items() if k not in ("architectures", "model_type")}
    return LlamaConfig(**{**values, "num_hidden_layers": 1})


def _load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    expected = module.state_dict()
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"{source} checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    module.load_state_dict({name: tensors[name].to(expected[name].dtype) for name in expected})


def _verifier(config: dict) -> str | None:
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") or config.get("verifier") or config.get("base_model_name_or_path")


def _eagle3(config: dict, layer_values: dict, tensors, num_target_layers, norm_before_residual) -> HeadCheckpoint:
    layer = _layer_config(layer_values)
    aux = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not aux:
        if num_target_layers is None:
            raise ValueError("this EAGLE-3 checkpoint names no aux layers: give the target's layer count")
        aux = default_aux_layers(num_target_layers)
    head = EagleHead(layer, 3, config.get("target_hidden_size"), config.get("draft_vocab_size"), tuple(aux),
                     bool(norm_before_residual), fc_bias="fc.bias" in tensors,
                     own_embedding="embed_tokens.weight" in tensors)
    _load(head, tensors, "EAGLE-3")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return HeadCheckpoint("eagle3", head, _verifier(config), speculative_tokens=methods[0].get("speculative_tokens"))


def _eagle1(config: dict, tensors, num_target_layers) -> HeadCheckpoint:
    if num_target_layers is None:
        raise ValueError("an EAGLE-1/2 head reads the target's final layer: give the target's layer count")
    head = EagleHead(_layer_config(config), 1, aux_layers=(num_target_layers,), fc_bias="fc.bias" in tensors,
                     own_embedding="embed_tokens.weight" in tensors)
    _load(head, {k: v for k, v in tensors.items() if not k.startswith("lm_head")}, "EAGLE-1/2")
    return HeadCheckpoint("eagle", head, _verifier(config), extra={"config": config})


DFLASH_CONFIG_KEYS = ("architectures", "model_type", "auto_map", "dflash_config", "torch_dtype", "dtype",
                      "transformers_version", "_name_or_path")


def _dflash_value(config: dict, name: str, default=None):
    """A DFlash setting: under `dflash_config` in newer configs, at the top level in older ones."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def _dflash(path: Path, config: dict, tensors) -> HeadCheckpoint:
    if any(name.startswith("candidate_selector.") or "_conv." in name for name in tensors):
        raise ValueError(f"{path}: a DFlash-2 drafter (candidate selector, dynamic convolutions); only DFlash "
                         "block drafters (architectures DFlashDraftModel) are supported")
    layer_types = config.get("layer_types") or ()
    if config.get("use_sliding_window") or "sliding_attention" in layer_types or config.get("is_causal"):
        raise ValueError(f"{path}: sliding-window or causal DFlash blocks are not supported (full, non-causal "
                         "attention inside the block only)")
    layer_ids = _dflash_value(config, "target_layer_ids")
    mask_token = _dflash_value(config, "mask_token_id")
    if layer_ids is None or mask_token is None:
        raise ValueError(f"{path}: a DFlash config names dflash_config.target_layer_ids and mask_token_id")
    values = {k: v for k, v in config.items() if k not in DFLASH_CONFIG_KEYS}
    drafter = DFlashDrafter(Qwen3Config(**values), layer_ids, int(_dflash_value(config, "block_size", 16)), int(mask_token),
                            tensors["fc.weight"].shape[1] // len(layer_ids),
                            float(_dflash_value(config, "output_multiplier", 1.0)),
                            _dflash_value(config, "final_logit_softcapping"), config.get("tree_choices"),
                            config.get("draft_vocab_size"))
    _load(drafter, tensors, "DFlash")
    return HeadCheckpoint("dflash", drafter, _verifier(config), speculative_tokens=drafter.block_size - 1,
                          extra={"num_target_layers": config.get("num_target_layers", 0)})


_PUBLIC_MEDUSA = re.compile(r"^medusa_head\.(\d+)\.(\d+)\.(linear\.)?(weight|bias)$")


def _medusa(config: dict, tensors) -> HeadCheckpoint:
    tensors = {name.removeprefix("medusa_heads."): t for name, t in tensors.items()}
    if "medusa_num_heads" in config:  # the Medusa repository's layout
        layers = config.get("medusa_num_layers", 1)
        renamed = {}
        for name, tensor in tensors.items():
            match = _PUBLIC_MEDUSA.match(name)
            if match is None:
                continue
            head, index, linear, kind = int(match[1]), int(match[2]), match[3], match[4]
            renamed[f"blocks.{head}.layers.{index}.{kind}" if linear else f"lm_heads.{head}.{kind}"] = tensor
        tensors, num_heads, shared, bias = renamed, config["medusa_num_heads"], False, True
    else:
        num_heads, layers = config["num_heads"], config.get("num_hidden_layers", 1)
        shared, bias = bool(config.get("original_lm_head", False)), bool(config.get("medusa_fc_bias", False))
    lm_head = tensors["lm_heads.0.weight"]
    heads = MedusaHeads(lm_head.shape[1], config.get("vocab_size", lm_head.shape[0]), num_heads, layers,
                        lm_head.shape[0], shared, bias)
    tensors.setdefault("token_map", torch.arange(lm_head.shape[0]))
    _load(heads, tensors, "Medusa")
    return HeadCheckpoint(kind="medusa", module=heads, verifier=_verifier(config), medusa_choices=config.get("medusa_choices"))


# ---- writing ---------------------------------------------------------------------------------------

def _save(tensors: dict[str, torch.Tensor], config: dict, path: Path, dtype: torch.dtype) -> None:
    path.mkdir(parents=True, exist_ok=True)
    floats = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    save_file(floats, path / WEIGHTS)
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                 indent=2) + "\n")


def save_eagle3(head: EagleHead, path: str | Path, verifier: str, verifier_architectures: list[str],
                speculative_tokens: int = 5, dtype: torch.dtype = torch.bfloat16) -> None:
    """The `speculators` format (what vLLM serves); `norm_before_residual` is always written."""
    if head.version != 3:
        raise ValueError("only EAGLE-3 heads are written in the speculators format")
    full = head.config.to_dict()
    layer = {**head.config.to_diff_dict(), **{key: full[key] for key in LAYER_KEYS if key in full}}
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "quantization_config",
                "_name_or_path", "_model_name_or_path"):
        layer.pop(key, None)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {**layer, "num_hidden_layers": 1},
        "draft_vocab_size": head.draft_vocab_size,
        "norm_before_residual": head.norm_before_residual,
        "target_hidden_size": head.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
    }
    _save(head.state_dict(), config, Path(path), dtype)


def save_medusa(heads: MedusaHeads, path: str | Path, verifier: str, choices: list[list[int]] | None = None,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """vLLM's Medusa format, plus the tree (`medusa_choices`) this project drafts with."""
    block = heads.blocks[0]
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": len(block.layers),
        "truncated_vocab_size": heads.draft_vocab_size,
        "original_lm_head": heads.shared_lm_head,
        "medusa_fc_bias": block.layers[0].bias is not None,
        "verifier": verifier,
        **({"medusa_choices": choices} if choices else {}),
    }
    tensors = heads.state_dict()
    if heads.draft_vocab_size == heads.vocab_size:
        tensors.pop("token_map")
    _save(tensors, config, Path(path), dtype)


def save_dflash(drafter: DFlashDrafter, path: str | Path, verifier: str, num_target_layers: int,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """z-lab's DFlash layout, plus the static tree this project drafts with (`tree_choices`)."""
    full = drafter.config.to_dict()
    layer = {**drafter.config.to_diff_dict(), **{key: full[key] for key in LAYER_KEYS if key in full}}
    for key in DFLASH_CONFIG_KEYS:
        layer.pop(key, None)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **layer,
        "num_hidden_layers": len(drafter.layers),
        "block_size": drafter.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": list(drafter.target_layer_ids)},
        "verifier": verifier,
        **({"tree_choices": drafter.tree_choices} if drafter.tree_choices else {}),
        **({"draft_vocab_size": drafter.draft_vocab_size} if drafter.draft_vocab_size else {}),
    }
    _save(drafter.own_state(), config, Path(path), dtype)


def save_head(checkpoint: HeadCheckpoint, path: str | Path, verifier_architectures: list[str] = ("LlamaForCausalLM",),
              dtype: torch.dtype = torch.bfloat16) -> None:
    """A head read in any layout, written in this project's (and vLLM's) format; an EAGLE-1/2 head
    (which has no other format) in its own layout, with safetensors weights."""
    if checkpoint.kind == "medusa":
        save_medusa(checkpoint.module, path, checkpoint.verifier or "", checkpoint.medusa_choices, dtype)
    elif checkpoint.kind == "dflash":
        save_dflash(checkpoint.module, path, checkpoint.verifier or "", checkpoint.extra.get("num_target_layers", 0), dtype)
    elif checkpoint.kind == "eagle3":
        save_eagle3(checkpoint.module, path, checkpoint.verifier or "", list(verifier_architectures),
                    checkpoint.speculative_tokens or 5, dtype)
    elif "config" in checkpoint.extra:
        config = {k: v for k, v in checkpoint.extra["config"].items() if k not in ("torch_dtype", "dtype")}
        _save(checkpoint.module.state_dict(), config, Path(path), dtype)
    else:
        raise ValueError("this EAGLE-1/2 head was not read from a checkpoint: its config is unknown")
