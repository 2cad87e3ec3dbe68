"""The training loop every head shares: batches, AdamW with warm-up and cosine decay, held-out
evaluation, a progress bar, and checkpoints it resumes from.

An objective is a callable `objective(batch) -> (loss, sums)` whose `sums` add up over batches
and whose `summary(sums)` turns them into figures (loss, top-1 per depth, estimated accepted
tokens per pass). A checkpoint (`checkpoint.safetensors` in the run folder: the module's weights and
the optimizer's tensors, with the step, the config and the optimizer's other state as JSON in the
file's metadata; nothing is pickled) is written every `checkpoint_every` steps and at the end; a run
started again with the same folder continues from it, with the same batch order (seeded per epoch).
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from speculators.train.dataset import Example
from speculators.train.packing import batches, pack


@dataclass
class TrainConfig:
    epochs: float = 3.0
    batch_rows: int = 2048
    lr: float = 1e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int = 50
    seed: int = 0
    device: str = "cpu"
    autocast: bool = True
    """Matrix products in bfloat16 (weights and optimizer stay float32): several times faster on CPUs
    with AVX512-BF16 and on GPUs (figures: docs/benchmarks.md, "Measurements behind the code")."""


CHECKPOINT = "checkpoint.safetensors"
LEGACY_CHECKPOINT = "checkpoint.pt"
"""What runs before safetensors checkpoints wrote (read once, weights only, then replaced)."""


def save_checkpoint(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    config: dict | None = None) -> None:
    """`module`'s state and `optimizer`'s in one safetensors file, written whole and then renamed:
    tensors as `module.<name>` and `optimizer.<param index>.<name>`, everything else (step, config,
    param groups, non-tensor optimizer state) as JSON under the metadata key `state`."""
    tensors = {f"module.{name}": value for name, value in module.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    scalars: dict[str, dict] = {}
    for index, values in optimizer_state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    state = {"step": step, "config": config, "param_groups": optimizer_state["param_groups"], "optimizer_scalars": scalars}
    partial = path.with_name(path.name + ".partial")
    save_file({name: value.detach().to("cpu", copy=True).contiguous() for name, value in tensors.items()}, partial,
              metadata={"state": json.dumps(state)})
    partial.replace(path)


def load_checkpoint(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: str = "cpu") -> dict:
    """Restore what `save_checkpoint` wrote into `module` and `optimizer`; returns the JSON state
    (`step`, `config`)."""
    with safe_open(path, "pt") as handle:
        state = json.loads((handle.metadata() or {})["state"])
    tensors = load_file(path, device=device)
    module.load_state_dict({name.removeprefix("module."): t for name, t in tensors.items() if name.startswith("module.")})
    per_param: dict[int, dict] = {int(index): dict(values) for index, values in state["optimizer_scalars"].items()}
    for name, tensor in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            per_param.setdefault(int(index), {})[key] = tensor
    groups = [{key: tuple(value) if isinstance(value, list) and key != "params" else value for key, value in group.items()}
              for group in state["param_groups"]]  # JSON made the tuples (betas) lists
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    return state


def _add(total: dict[str, float], more: dict[str, float]) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0.0) + value


def _run(objective, examples: Sequence[Example], groups, config: TrainConfig):
    batch = pack([examples[i] for i in groups], torch.float32)
    batch = type(batch)(*(t.to(config.device) for t in vars(batch).values()))
    with torch.autocast(torch.device(config.device).type, dtype=torch.bfloat16, enabled=config.autocast):
        return objective(batch)


def evaluate(objective, examples: Sequence[Example], config: TrainConfig) -> dict[str, float]:
    """Summed metrics of the objective over `examples` (no gradients)."""
    sums: dict[str, float] = {}
    with torch.no_grad():
        for groups in batches(examples, config.batch_rows, seed=0):
            _add(sums, _run(objective, examples, groups, config)[1])
    return sums


def train(module: torch.nn.Module, objective, train_examples: Sequence[Example], held_out: Sequence[Example],
          config: TrainConfig, folder: Path, log: Callable[[str], None] = print) -> dict[str, float]:
    """Train `module` in place; returns the held-out sums at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    module.to(config.device).train()
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    plan = [group for epoch in range(math.ceil(config.epochs))
            for group in batches(train_examples, config.batch_rows, config.seed + epoch)]
    total = max(1, min(len(plan), round(config.epochs * len(plan) / math.ceil(config.epochs))))

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return config.lr * (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    step, checkpoint, legacy = 0, folder / CHECKPOINT, folder / LEGACY_CHECKPOINT
    if checkpoint.exists():
        step = load_checkpoint(checkpoint, module, optimizer, config.device)["step"]
        log(f"resuming at step {step} of {total} from {checkpoint}")
    elif legacy.exists():  # plain containers and tensors only: weights_only refuses anything else
        state = torch.load(legacy, map_location=config.device, weights_only=True)
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        log(f"resuming at step {step} of {total} from {legacy}")

    def save() -> None:
        save_checkpoint(checkpoint, module, optimizer, step, asdict(config))
        legacy.unlink(missing_ok=True)

    held: dict[str, float] = {}
    recent: dict[str, float] = {}
    bar = tqdm(total=total, initial=step, file=sys.stderr, mininterval=10, desc="training", dynamic_ncols=False)
    began = time.perf_counter()
    while step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss, sums = _run(objective, train_examples, plan[step], config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        step += 1
        _add(recent, sums)
        if step % config.eval_every == 0 or step == total:
            module.eval()
            held = evaluate(objective, held_out, config)
            module.train()
            record = {"step": step, "seconds": round(time.perf_counter() - began, 1),
                      "train": objective.summary(recent), "held_out": objective.summary(held)}
            with (folder / "metrics.jsonl").open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            log(json.dumps(record))
            recent = {}
        if step % config.checkpoint_every == 0 or step == total:
            save()
        figures = objective.summary(recent) if recent else {}
        shown = objective.summary(held) if held else {}
        bar.set_postfix(loss=f"{figures.get('loss', float('nan')):.3f}", held=f"{shown.get('loss', float('nan')):.3f}",
                        top1=f"{shown.get('top1@1', float('nan')):.3f}", accept=f"{shown.get('accept', float('nan')):.2f}",
                        refresh=False)
        bar.update(1)
    bar.close()
    module.eval()
    return held or evaluate(objective, held_out, config)
