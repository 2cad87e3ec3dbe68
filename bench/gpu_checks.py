"""The checks that bench/gpu_check.py runs, one function each.

Each takes the run's Context and returns a dict of what it measured; a dict with `"pass": False`
is a failed check, an exception an errored one, `Skip` one that cannot run here (the reason is
recorded). The sizes come from the Context, so the CPU dry run runs the same code on tiny shapes.
"""
from __future__ import annotations

import importlib
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from actors.draft_worker import DraftWorker
from actors.messages import AdmitItem, VerifyItem
from actors.model.attention import get_backend
from actors.model.llama import decoder_from_tensors
from actors.model.loader import load_model
from actors.model.runner import ModelRunner
from actors.model.split_attention import SplitBackend
from actors.model.timing import finish_queued_work, time_passes
from actors.target_group import TargetShard
from actors.target_worker import TargetWorker
from actors.worker import LocalWorker
from bench.gpu_models import RandomModel, Shape, build, save
from bench.greedy_agreement import decode, divergence_at, measure_agreement, oracle_drafter
from speculators.keyed import keyed_sample, keyed_uniform
from speculators.proposers.base import DraftRequest, TreeInput
from speculators.proposers.draft_model import DraftModelProposer
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree, chain_parents
from speculators.verify import verify

BACKENDS = ("sdpa", "split")
TREE_SIZES = (1, 4, 16, 32, 64)
BATCHES = (1, 8)
LOGITS_TOLERANCE = {torch.bfloat16: 0.05, torch.float32: 1e-4}
"""Largest |ours - transformers| allowed, relative to transformers' largest |logit|. The argmax must
also agree wherever transformers' top two logits are further apart than twice the row's error."""


class Skip(Exception):
    """The check cannot run on this machine; the message says why."""


@dataclass(frozen=True)
class Sizes:
    prompt: int
    agreement_prompts: int
    agreement_tokens: int
    context: int
    repeats: int
    new_tokens: int
    depths: tuple[int, ...]
    sampling_trials: int


GPU_SIZES = Sizes(prompt=128, agreement_prompts=8, agreement_tokens=48, context=256, repeats=5, new_tokens=128,
                  depths=(4, 8), sampling_trials=3000)
DRY_RUN_SIZES = Sizes(prompt=16, agreement_prompts=2, agreement_tokens=8, context=16, repeats=1, new_tokens=16,
                      depths=(4,), sampling_trials=1000)


@dataclass
class Context:
    device: torch.device
    dtype: torch.dtype
    shapes: dict[str, Shape]
    sizes: Sizes
    workdir: Path
    _models: dict[str, RandomModel] = field(default_factory=dict)

    def model(self, key: str) -> RandomModel:
        """The random model of shape `key`, built once per run (seeded by its key)."""
        if key not in self._models:
            self._models[key] = build(self.shapes[key], self.device, self.dtype, seed=sorted(self.shapes).index(key))
        return self._models[key]

    def prompt(self, length: int, seed: int = 0) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(self.shapes["1b"].vocab_size, (length,), generator=generator).tolist()


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def environment(ctx: Context) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(ctx.device), "dtype": str(ctx.dtype).removeprefix("torch."),
            "split_prefix_kernel": SplitBackend().prefix_kernel, "ray_importable": _importable("ray"),
            "vllm_flash_attn_importable": _importable("vllm_flash_attn"),
            "shapes": {key: {"name": s.name, "parameters": s.parameters()} for key, s in ctx.shapes.items()},
            "eagle3_head": "none in the code base at this commit: the draft check runs a draft model only"}
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def _our_logits(model: RandomModel, prompt: list[int]) -> torch.Tensor:
    runner = ModelRunner(model.decoder, 1, len(prompt) + 1)
    runner.add("logits")
    return runner.forward([TreeInput("logits", prompt, chain_parents(len(prompt)))])[0]


def logits_vs_transformers(ctx: Context) -> dict:
    """Our decoder against transformers' LlamaForCausalLM on the same weights, both backends."""
    results, passed = {}, True
    tolerance = LOGITS_TOLERANCE.get(ctx.dtype, 1e-4)
    prompt = ctx.prompt(ctx.sizes.prompt)
    for key in ("1b", "8b"):
        model = ctx.model(key)
        with torch.inference_mode():
            expected = model.reference(torch.tensor([prompt], device=ctx.device)).logits[0].float()
        for backend in BACKENDS:
            model.decoder.backend = get_backend(backend)
            ours = _our_logits(model, prompt)
            error = (ours - expected).abs()
            relative = float(error.max() / expected.abs().max())
            same = ours.argmax(-1) == expected.argmax(-1)
            top2 = torch.topk(expected, 2).values
            clear = top2[:, 0] - top2[:, 1] > 2 * error.max(-1).values  # rounding cannot swap these
            results[f"{key}/{backend}"] = {"relative_max_diff": relative, "top1_agreement": float(same.float().mean()),
                                           "clear_positions": int(clear.sum()),
                                           "top1_agreement_where_clear":
                                               float(same[clear].float().mean()) if clear.any() else None}
            passed &= relative <= tolerance and bool(same[clear].all())
        model.decoder.backend = get_backend("sdpa")
    return {"pass": passed, "tolerance": tolerance, "results": results}


def greedy_losslessness(ctx: Context) -> dict:
    """Oracle-drafted chains and trees against plain decoding, in the run's dtype; every divergence
    must be a near-tie of a float32 (float64 in the dry run) copy of the same weights."""
    model = ctx.model("1b").decoder
    wider = torch.float64 if ctx.dtype == torch.float32 else torch.float32
    full = decoder_from_tensors(model.config, {n: p.to(wider) for n, p in model.named_parameters()})
    prompts = [ctx.prompt(32, seed) for seed in range(ctx.sizes.agreement_prompts)]
    results, passed = {}, True
    for backend in BACKENDS:
        model.backend = get_backend(backend)
        for width in (1, 3):
            agreement = measure_agreement(model, full, prompts, ctx.sizes.agreement_tokens, depth=4, width=width)
            summary = agreement.as_dict()
            results[f"{backend}/{'chain' if width == 1 else f'tree-width-{width}'}"] = summary
            passed &= summary["all_at_near_ties"]
    model.backend = get_backend("sdpa")
    return {"pass": passed, "results": results}


def _verifier_first_tokens(ctx: Context, p: torch.Tensor, q: torch.Tensor, trials: int) -> torch.Tensor:
    """How often each token comes first out of the sampled verifier, for one drafted child of q."""
    params = SamplingParams(temperature=1.0, seed=0, rule="rejection")
    verify_generator = params.generator(0, ctx.device)
    draft_generator = torch.Generator().manual_seed(1)
    logits = p.log().expand(2, -1)
    counts = torch.zeros(len(p), dtype=torch.long)
    for _ in range(trials):
        child = int(torch.multinomial(q, 1, generator=draft_generator))
        tree = DraftTree.chain(0, [child], torch.stack([torch.zeros_like(q), q]))
        counts[verify(tree, logits, params, verify_generator).new_tokens[0]] += 1
    return counts


def sampling_with_a_device_generator(ctx: Context) -> dict:
    """The rejection rule (unseeded requests; seeded here to repeat). The sampled verifier on the
    device with a device generator and draft rows from the CPU: its first tokens follow the target's
    p (chi-square); then a draft model and the target on the same device draft and verify a sampled
    request end to end."""
    from scipy.stats import chisquare

    torch.manual_seed(0)
    p = torch.randn(12, device=ctx.device).softmax(-1).double()
    q = torch.randn(12).softmax(-1).double()
    counts = _verifier_first_tokens(ctx, p, q, ctx.sizes.sampling_trials)
    expected = p.cpu().numpy()
    pvalue = float(chisquare(counts.numpy(), expected / expected.sum() * int(counts.sum())).pvalue)
    target, draft = ctx.model("1b").decoder, ctx.model("draft").decoder
    worker = TargetWorker(target, 1, 256)
    proposer = DraftModelProposer(ModelRunner(draft, 1, 256), width=2)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=3, rule="rejection")
    tokens = ctx.prompt(16)
    worker.start([AdmitItem(request_id="sampled", tokens=tokens, sampling=sampling)])
    tree_devices = set()
    for _ in range(4):
        tree = proposer.propose([DraftRequest(request_id="sampled", token_ids=tokens, num_speculative_tokens=3, max_nodes=6,
                                              sampling=sampling)])[0]
        tree_devices.add(str(tree.draft_probs.device) if tree.draft_probs is not None else "none")
        tokens = tokens + worker.verify([VerifyItem("sampled", tree)]).results[0].new_tokens
        proposer.on_accept("sampled", tokens)
    worker.finish("sampled")
    passed = pvalue > 1e-4 and tree_devices <= {"cpu", "none"}
    return {"pass": passed, "chi_square_pvalue": pvalue, "trials": int(counts.sum()),
            "generator_device": str(SamplingParams(1.0, seed=0).generator(0, ctx.device).device),
            "draft_probs_devices": sorted(tree_devices), "tokens_generated": len(tokens) - 16}


def keyed_sampling_on_the_device(ctx: Context) -> dict:
    """Seeded requests' keyed noise made on the device (integer hash ops, no generator, no host
    round trip) is bit for bit the CPU's; its samples follow p (chi-square over seeds); and a
    draft model's sampled tree verified on the device gives plain decoding's tokens."""
    from scipy.stats import chisquare

    same_noise = bool(torch.equal(keyed_uniform(7, 123, 50_000, ctx.device).cpu(), keyed_uniform(7, 123, 50_000)))
    torch.manual_seed(0)
    p = torch.randn(12, device=ctx.device).softmax(-1).double()
    trials = ctx.sizes.sampling_trials
    counts = torch.bincount(torch.tensor([keyed_sample(p, seed, 5) for seed in range(trials)]), minlength=12)
    expected = p.cpu().numpy()
    pvalue = float(chisquare(counts.numpy(), expected / expected.sum() * trials).pvalue)
    target, draft = ctx.model("1b").decoder, ctx.model("draft").decoder
    sampling, prompt, new = SamplingParams(temperature=0.8, top_p=0.95, seed=3), ctx.prompt(16), 24
    outputs = {}
    for drafting in (False, True):
        worker = TargetWorker(target, 1, 256)
        proposer = DraftModelProposer(ModelRunner(draft, 1, 256), width=2)
        tokens, accepted = list(prompt), 0
        worker.start([AdmitItem(request_id="keyed", tokens=tokens, sampling=sampling)])
        while len(tokens) < len(prompt) + new:
            tree = (proposer.propose([DraftRequest(request_id="keyed", token_ids=tokens, num_speculative_tokens=3, max_nodes=6,
                                                   sampling=sampling)])[0] if drafting
                    else DraftTree.root_only(tokens[-1]))
            result = worker.verify([VerifyItem("keyed", tree)]).results[0]
            tokens, accepted = tokens + result.new_tokens, accepted + len(result.accepted_tokens)
            proposer.on_accept("keyed", tokens)
        worker.finish("keyed")
        outputs[drafting] = (tokens[len(prompt):len(prompt) + new], accepted)
    identical = outputs[True][0] == outputs[False][0]
    return {"pass": same_noise and pvalue > 1e-4 and identical, "noise_equals_cpu": same_noise,
            "chi_square_pvalue": pvalue, "trials": trials, "identical_to_plain": identical,
            "drafted_tokens_accepted": outputs[True][1]}


def verification_cost(ctx: Context) -> dict:
    """A pass over trees of each size, relative to one decode step at the same batch (chains
    stand in for trees: a pass costs the same for any tree shape of that many tokens)."""
    shapes = [(size * batch, batch) for batch in BATCHES for size in TREE_SIZES]
    results = {}
    for key in ("1b", "8b"):
        decoder = ctx.model(key).decoder
        for backend in BACKENDS:
            decoder.backend = get_backend(backend)
            runner = ModelRunner(decoder, max(BATCHES), ctx.sizes.context + max(TREE_SIZES) + 1)
            seconds = dict(zip(shapes, time_passes(runner, shapes, ctx.sizes.context, ctx.sizes.repeats)))
            results[f"{key}/{backend}"] = {
                f"batch {batch}": {str(size): {"ms": 1e3 * seconds[(size * batch, batch)],
                                               "relative": seconds[(size * batch, batch)] / seconds[(batch, batch)]}
                                   for size in TREE_SIZES}
                for batch in BATCHES}
            del runner
        decoder.backend = get_backend("sdpa")
    return {"context": ctx.sizes.context, "results": results}


def _timed(run: Callable[[], object], device: torch.device) -> tuple[object, float]:
    finish_queued_work(device)
    began = time.perf_counter()
    out = run()
    finish_queued_work(device)
    return out, time.perf_counter() - began


def tokens_per_second(ctx: Context) -> dict:
    """Plain decoding against an oracle drafter (always right): the most tokens per second the
    engine's verification turns perfect acceptance into, batch 1."""
    results = {}
    new = ctx.sizes.new_tokens
    prompt = ctx.prompt(ctx.sizes.prompt)
    for key in ("1b", "8b"):
        worker = TargetWorker(ctx.model(key).decoder, 1, len(prompt) + new + max(ctx.sizes.depths) + 2)
        decode(worker, prompt, 4)  # warm-up
        plain, plain_s = _timed(lambda: decode(worker, prompt, new), ctx.device)
        row = {"plain": {"tokens_per_s": new / plain_s, "passes": plain.passes}}
        for depth in ctx.sizes.depths:
            drafter = oracle_drafter(len(prompt), plain.tokens, depth)
            oracle, seconds = _timed(lambda: decode(worker, prompt, new, drafter), ctx.device)
            row[f"oracle depth {depth}"] = {"tokens_per_s": new / seconds, "passes": oracle.passes,
                                            "tokens_per_pass": new / oracle.passes, "speedup": plain_s / seconds,
                                            "same_tokens_as_plain": oracle.tokens == plain.tokens}
        results[key] = row
    return {"new_tokens": new, "results": results}


def draft_step(ctx: Context) -> dict:
    """What a draft model's step costs at batch 1 and 8: catching up on one committed token, then
    drafting a depth-4 chain (greedy), as every engine step asks of it; batch 1 also with CUDA
    graphs (one-sequence passes only)."""
    decoder = ctx.model("draft").decoder
    results = {}
    for batch, graphs in [(batch, False) for batch in BATCHES] + [(1, True)]:
        runner = ModelRunner(decoder, max(BATCHES), ctx.sizes.prompt + 8 + max(TREE_SIZES), cuda_graphs=graphs)
        proposer = DraftModelProposer(runner, width=1)
        requests = [DraftRequest(request_id=f"r{i}", token_ids=ctx.prompt(ctx.sizes.prompt, i), num_speculative_tokens=4,
                                 max_nodes=4) for i in range(batch)]
        proposer.propose(requests)  # warm-up; also fills the draft's cache with the prompts
        samples = []
        for _ in range(max(ctx.sizes.repeats, 1)):
            for request in requests:  # back to all but the last token, which the step then catches up on
                proposer.on_accept(request.request_id, request.token_ids[:-1])
            _, seconds = _timed(lambda proposer=proposer: proposer.propose(requests), ctx.device)
            samples.append(seconds)
        label = f"batch {batch}" + (", cuda graphs" if graphs else "")
        results[label] = {"ms_per_proposal": 1e3 * min(samples), "ms_per_depth": 1e3 * min(samples) / 4,
                          "graphed_sizes": runner.graphed_sizes}
        del proposer, runner
    return {"draft": ctx.shapes["draft"].name, "results": results}


def cuda_graphs(ctx: Context) -> dict:
    """Plain and oracle-drafted decoding at batch 1 with CUDA graphs replayed for one-sequence
    passes, against eager passes (on a CPU the flag is off: both columns run eagerly)."""
    new, prompt = ctx.sizes.new_tokens, ctx.prompt(ctx.sizes.prompt)
    max_len = len(prompt) + new + max(TREE_SIZES) + 1  # a padded bucket writes past the tokens it runs
    results = {}
    for key in ("1b", "8b"):
        row, tokens = {}, {}
        for label, graphs in (("eager", False), ("cuda graphs", True)):
            worker = TargetWorker(ctx.model(key).decoder, 1, max_len, cuda_graphs=graphs)
            decode(worker, prompt, 4)  # warm-up
            plain, plain_s = _timed(lambda worker=worker: decode(worker, prompt, new), ctx.device)
            drafter = oracle_drafter(len(prompt), plain.tokens, 4)
            _, oracle_s = _timed(lambda worker=worker: decode(worker, prompt, new, drafter), ctx.device)
            row[label] = {"graphed_sizes": worker.runner.graphed_sizes, "plain_tokens_per_s": new / plain_s,
                          "oracle_depth_4_tokens_per_s": new / oracle_s}
            tokens[label] = plain.tokens
            del worker
        row["same_plain_tokens"] = tokens["eager"] == tokens["cuda graphs"]
        row["plain_speedup"] = row["cuda graphs"]["plain_tokens_per_s"] / row["eager"]["plain_tokens_per_s"]
        results[key] = row
    return {"new_tokens": new, "results": results}


class _IdTokenizer:
    """Enough of a tokenizer for an engine over a random model: token ids as words."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def paged_cache(ctx: Context) -> dict:
    """The paged KV cache on the device, as served: requests sharing a long prompt prefix, a cache
    with room for one and a quarter of them (requests wait for blocks, find the prefix cached, are preempted and
    resumed), prompts prefilled in chunks beside running streams, prompt lookup trees verified in
    scratch blocks. Greedy outputs must equal those of a cache with room for all, whole prompts and no
    prefix caching. Run in float32 so that a batch's different composition cannot flip a near-tie.
    Sequences end up fragmented (a shared prefix block, a neighbour's block in the way), which takes
    the device's gathered attention path."""
    from actors.model.kv_cache import KVCache
    from cluster.engine.build import local_engine
    from cluster.engine.config import SchedulerConfig
    from cluster.engine.request import GenerationRequest
    from speculators.proposers.prompt_lookup import PromptLookupProposer

    random = ctx.model("1b").decoder
    model = decoder_from_tensors(random.config, {n: p.float() for n, p in random.named_parameters()})
    prefix, new = ctx.prompt(ctx.sizes.prompt, 99), ctx.sizes.new_tokens
    prompts = [prefix + ctx.prompt(8 + 4 * i, i) for i in range(8)]
    max_len = len(prefix) + 64 + new
    position = KVCache.bytes_per_position(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim,
                                          torch.float32)
    settings = {
        "roomy": {"kv_cache_bytes": len(prompts) * max_len * position, "prefill_chunk_tokens": None,
                  "enable_prefix_caching": False},
        "tight": {"kv_cache_bytes": 5 * max_len // 4 * position, "prefill_chunk_tokens": 16, "enable_prefix_caching": True},
    }
    results, tokens = {}, {}
    for label, cache in settings.items():
        config = SchedulerConfig(max_sequences=len(prompts), max_len=max_len, block_size=16, step_token_budget=64, **cache)
        engine = local_engine(model, _IdTokenizer(), PromptLookupProposer(max_branches=3), config)
        requests = [GenerationRequest(f"{label}{i}", prompt, max_new_tokens=new) for i, prompt in enumerate(prompts)]
        outputs, seconds = _timed(lambda engine=engine: engine.generate(requests), ctx.device)
        tokens[label] = [o.token_ids for o in outputs]
        results[label] = {
            "seconds": seconds, "accepted": sum(o.stats.accepted for o in outputs),
            "cached_prompt_tokens": sum(o.stats.cached_prompt_tokens for o in outputs),
            "preemptions": sum(o.stats.preemptions for o in outputs),
        }
        del engine
    same = tokens["tight"] == tokens["roomy"]
    first = next((i for i, (a, b) in enumerate(zip(tokens["tight"], tokens["roomy"])) if a != b), None)
    exercised = results["tight"]["cached_prompt_tokens"] > 0 and results["tight"]["preemptions"] > 0
    return {"pass": same and exercised, "same_tokens": same, "first_differing_request": first,
            "prompt_tokens": [len(p) for p in prompts], "new_tokens": new, "results": results}


def _draft_proposer(path: str, dtype: str, device: str, max_len: int) -> DraftModelProposer:
    """Runs inside the draft worker (a Ray actor or this process): loads the draft from `path`."""
    return DraftModelProposer(ModelRunner(load_model(path, getattr(torch, dtype), device), 1, max_len))


def _start_ray():
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False)
    return ray, started


def shard_path(ctx: Context) -> dict:
    """A TP=1 target shard and a draft worker on the same GPU, both loading saved weights:
    through Ray (half a GPU each) when Ray imports, else the same classes in this process."""
    target_model, draft_model = ctx.model("1b"), ctx.model("draft")
    target_dir, draft_dir = save(target_model, ctx.workdir / "target"), save(draft_model, ctx.workdir / "draft")
    prompt, new = ctx.prompt(ctx.sizes.prompt), ctx.sizes.new_tokens // 2
    max_len = len(prompt) + new + 8
    dtype, device = str(ctx.dtype).removeprefix("torch."), str(ctx.device)
    plain = decode(TargetWorker(target_model.decoder, 1, max_len), prompt, new).tokens
    build_draft = partial(_draft_proposer, str(draft_dir), dtype, device, max_len)
    ray_module, started_ray = (None, False)
    if _importable("ray"):
        from actors.target_group import TargetGroup
        from actors.worker import RayActorWorker

        ray_module, started_ray = _start_ray()
        half = {"num_gpus": 0.5, "num_cpus": 0}
        target = TargetGroup(str(target_dir), 1, max_sequences=1, max_len=max_len, dtype=dtype, device=device,
                             actor_options=[half])
        draft = RayActorWorker(ray_module.remote(DraftWorker).options(**half).remote(build_draft))
        route = "ray: TargetGroup (TP=1) and a DraftWorker actor, 0.5 GPU each"
    else:
        shard = TargetShard(str(target_dir), 0, 1, max_sequences=1, max_len=max_len, dtype=dtype, device=device)
        shard.join("127.0.0.1", 0)
        target, draft = LocalWorker(shard, "target"), LocalWorker(DraftWorker(build_draft), "draft")
        route = "in-process TargetShard and DraftWorker (ray is not importable here)"
    try:
        tokens = list(prompt)
        target.submit("start", [AdmitItem(request_id="r", tokens=tokens, sampling=SamplingParams())]).result(300)
        while len(tokens) - len(prompt) < new:
            request = DraftRequest(request_id="r", token_ids=tokens, num_speculative_tokens=4, max_nodes=4)
            tree = draft.submit("propose", [request]).result(300).trees[0]
            tokens += target.submit("verify", [VerifyItem("r", tree)]).result(300).results[0].new_tokens
        generated = tokens[len(prompt): len(prompt) + new]
    finally:
        target.shutdown()
        draft.shutdown()
        if started_ray:
            ray_module.shutdown()
    result = {"route": route, "identical_to_plain": generated == plain, "new_tokens": new}
    if generated != plain:
        position = next(i for i, (a, b) in enumerate(zip(plain, generated)) if a != b)
        wider = torch.float64 if ctx.dtype == torch.float32 else torch.float32
        full = decoder_from_tensors(target_model.decoder.config,
                                    {n: p.to(wider) for n, p in target_model.decoder.named_parameters()})
        divergence = divergence_at(target_model.decoder, full, 0, [*prompt, *plain[:position]], position)
        result["divergence"] = {**vars(divergence), "near_tie": divergence.near_tie}
    result["pass"] = result["identical_to_plain"] or result["divergence"]["near_tie"]
    return result


CHECKS: dict[str, Callable[[Context], dict]] = {
    "environment": environment,
    "logits_vs_transformers": logits_vs_transformers,
    "greedy_losslessness": greedy_losslessness,
    "sampling_with_a_device_generator": sampling_with_a_device_generator,
    "keyed_sampling_on_the_device": keyed_sampling_on_the_device,
    "verification_cost": verification_cost,
    "tokens_per_second": tokens_per_second,
    "draft_step": draft_step,
    "cuda_graphs": cuda_graphs,
    "paged_cache": paged_cache,
    "shard_path": shard_path,
}
