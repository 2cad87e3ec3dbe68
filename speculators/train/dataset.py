"""Training data of a head: token sequences (prompt + the target's response) and, for every token,
the target's hidden states at the layers heads read.

A sequence of T tokens has T - 1 rows of hidden states: row j is the target's state after token j
(the last token's is never needed: a head pairs row j with token j + 1). Stored as numbered
safetensors shards in one folder, each holding whole sequences laid end to end (`tokens` int32,
`hidden` [rows, layers x H], `lengths` and `prompt_lengths` int32 [S], `held_out` uint8 [S],
`index` int64 [S] = the prompt's index in the prompt set), plus `layers.json` naming the captured
layers in column order. A shard is written whole and then renamed, so a stopped run resumes
after the last complete shard. What is recorded is known by the prompts' token ids, not by index, so a
prompt set that changes keeps every answer to a prompt it still holds and adds only the new ones.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def work_folder(cache: Path, model: str) -> Path:
    """Where `specserve train` keeps a target's recorded data (`data/`) and runs (`runs/`)."""
    return cache / "train" / Path(model).name


@dataclass
class Example:
    index: int
    tokens: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T - 1, layers x H]
    prompt_length: int
    held_out: bool


class FeatureStore:
    def __init__(self, folder: Path, layers: Sequence[int]):
        self.folder, self.layers = folder, tuple(layers)
        folder.mkdir(parents=True, exist_ok=True)
        meta = folder / "layers.json"
        if meta.exists() and tuple(json.loads(meta.read_text())) != self.layers:
            raise ValueError(f"{folder} holds layers {json.loads(meta.read_text())}, not {list(self.layers)}")
        meta.write_text(json.dumps(list(self.layers)))

    def shards(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.safetensors"))

    def recorded(self) -> set[tuple[int, ...]]:
        """The token ids of every prompt already answered (read without the hidden states)."""
        done: set[tuple[int, ...]] = set()
        for shard in self.shards():
            with safe_open(str(shard), "pt") as data:
                tokens = data.get_tensor("tokens").tolist()
                offset = 0
                for length, prompt in zip(data.get_tensor("lengths").tolist(), data.get_tensor("prompt_lengths").tolist()):
                    done.add(tuple(tokens[offset:offset + prompt]))
                    offset += length
        return done

    def write(self, examples: Sequence[Example]) -> Path:
        path = self.folder / f"shard-{len(self.shards()):05d}.safetensors"
        tensors = {
            "tokens": torch.cat([e.tokens for e in examples]).to(torch.int32),
            "hidden": torch.cat([e.hidden for e in examples]).contiguous(),
            "lengths": torch.tensor([len(e.tokens) for e in examples], dtype=torch.int32),
            "prompt_lengths": torch.tensor([e.prompt_length for e in examples], dtype=torch.int32),
            "held_out": torch.tensor([e.held_out for e in examples], dtype=torch.uint8),
            "index": torch.tensor([e.index for e in examples], dtype=torch.int64),
        }
        partial = path.with_suffix(".partial")
        save_file(tensors, partial)
        partial.replace(path)
        return path

    def read(self, layers: Sequence[int] | None = None) -> list[Example]:
        """Every stored sequence, with the hidden-state columns of `layers` (all by default)."""
        wanted = self.layers if layers is None else tuple(layers)
        missing = set(wanted) - set(self.layers)
        if missing:
            raise ValueError(f"{self.folder} did not record layers {sorted(missing)}")
        examples = []
        for shard in self.shards():
            data = load_file(shard)
            width = data["hidden"].shape[1] // len(self.layers)
            columns = torch.cat([torch.arange(width) + self.layers.index(layer) * width for layer in wanted])
            hidden = data["hidden"].index_select(1, columns)
            offset = rows = 0
            for length, prompt, held, index in zip(data["lengths"].tolist(), data["prompt_lengths"].tolist(),
                                                   data["held_out"].tolist(), data["index"].tolist()):
                examples.append(Example(index=index, tokens=data["tokens"][offset:offset + length].long(),
                                        hidden=hidden[rows:rows + length - 1], prompt_length=prompt, held_out=bool(held)))
                offset, rows = offset + length, rows + length - 1
        return examples
