"""A tensor-parallel target on Ray: `world_size` TargetShard actors on one node, one model.

Each shard joins one torch.distributed group and wraps a TargetWorker over its slice of the
weights. Every rank runs every call; the collectives inside the forward pass make them one model.
The driver holds a `TargetGroup`, which has the engine's worker interface (`submit`).
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError  # not the builtin on Python 3.10
from dataclasses import replace
from typing import Any

import torch

from actors.draft_worker import DraftReply, DraftWorker
from actors.messages import Admission, AdmitItem, VerifyItem, VerifyReply
from actors.model.distributed import TorchDistributedComm, bind_device, init_process_group
from actors.model.llama import LlamaDecoder
from actors.model.loader import load_config, load_model, resolve_model
from actors.model.sharding import Communicator, ShardPlan
from actors.model.threads import use_cores
from actors.target_worker import CacheOptions, TargetWorker
from speculators.hidden import PendingHidden, TargetHidden
from speculators.proposers.base import DraftRequest, Proposer
from speculators.verify import VerifyResult


class TargetShard:
    """One tensor-parallel rank of a target: joins the process group, loads its slice, serves calls.

    A plain class; TargetGroup makes it a Ray actor (`ray.remote(TargetShard)`), so importing this
    module needs no running Ray. Starting takes two steps, because the rendezvous address belongs
    to rank 0's node, which is known only once the actors are placed: construct every rank, ask
    rank 0 for a free port on its node (`rendezvous_port`), then `join` every rank there. A world
    of one skips the process group: nothing to talk to.
    """

    def __init__(
        self,
        model: str,
        rank: int,
        world_size: int,
        max_sequences: int = 8,
        max_len: int = 2048,
        dtype: str = "float32",
        device: str = "cpu",
        attention_backend: str = "sdpa",
        cuda_graphs: bool = False,
        hidden_layers: Sequence[int] = (),
        hidden_dtype: str = "float32",
        build_drafter: Callable[[LlamaDecoder], Proposer] | None = None,
        cpu_threads: int | None = None,
        cache: CacheOptions = CacheOptions(),
    ):
        self.rank, self.world_size = rank, world_size
        use_cores(cpu_threads, ranks=world_size)  # the group's ranks share a node
        if build_drafter is not None and world_size > 1:
            raise ValueError("a co-located drafter needs a target of one rank (tensor parallel size 1)")
        self.device = bind_device(device)
        self._load = (model, max_sequences, max_len, dtype, attention_backend, cuda_graphs)
        self._hidden = (tuple(hidden_layers), hidden_dtype, build_drafter)
        self._cache = cache
        self.worker: TargetWorker | None = None
        self.drafter: ColocatedDrafter | None = None

    def node(self) -> tuple[str, str]:
        """(Ray node id, node address) of this rank's process."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def rendezvous_port(self) -> int:
        """A port free on this rank's node now (asked of rank 0, which listens there at the rendezvous)."""
        return _free_port()

    def join(self, master_addr: str, master_port: int) -> None:
        """Join the process group at rank 0's address, then load this rank's slice of the weights."""
        model, max_sequences, max_len, dtype, attention_backend, cuda_graphs = self._load
        hidden_layers, hidden_dtype, build_drafter = self._hidden
        path = resolve_model(model)
        comm = Communicator()
        if self.world_size > 1:
            init_process_group(self.rank, self.world_size, master_addr, master_port, self.device)
            comm = TorchDistributedComm(load_config(path), self.device)
        decoder = load_model(path, getattr(torch, dtype), self.device, ShardPlan(self.rank, self.world_size), comm,
                             attention_backend)
        if build_drafter is not None:
            self.drafter = ColocatedDrafter(DraftWorker(lambda: build_drafter(decoder), learn_in_background=True))
            hidden_layers, hidden_dtype = self.drafter.hidden_spec()
        self.worker = TargetWorker(decoder, max_sequences, max_len, cuda_graphs, hidden_layers,
                                   getattr(torch, hidden_dtype), self._cache)

    def start(self, requests: Sequence[AdmitItem], prefill: bool = True) -> Admission:
        admission = self.worker.start(requests, prefill=prefill)
        if self.drafter is not None:
            admission.hidden = self.drafter.keep_prefill(admission.hidden)
        return admission

    def block_tables(self) -> dict[str, list[int]]:
        return self.worker.runner.block_tables()

    def verify(self, batch: Sequence[VerifyItem], prefill: Sequence[tuple[str, int]] = ()) -> VerifyReply:
        reply = self.worker.verify(batch, prefill)
        if self.drafter is not None:
            self.drafter.keep_verified(batch, reply, self.worker.runner)
        return reply

    def draft(self, method: str, *args: Any) -> Any:
        """A call to the co-located drafter (ColocatedDrafter): propose, release, runs_a_model."""
        if self.drafter is None:
            raise RuntimeError("this target shard has no co-located drafter")
        return self.drafter.call(method, *args)

    def finish(self, seq_id: str) -> None:
        self.worker.finish(seq_id)
        if self.drafter is not None:
            self.drafter.drop(seq_id)

    def time_passes(self, shapes: Sequence[tuple[int, int]], context: int, repeats: int) -> list[float]:
        return self.worker.time_passes(shapes, context, repeats)

    def parameter_bytes(self) -> int:
        """Bytes of weights this rank holds: how the split is checked and memory is planned."""
        return sum(p.numel() * p.element_size() for p in self.worker.model.parameters())

    def ping(self) -> int:
        return self.rank


class ColocatedDrafter:
    """A drafter living in its target shard's process (one-GPU deployments): it shares the target's
    weights (a head's embedding and LM head), and the hidden states it reads stay in the process,
    kept here from prefill and verification until the request's next propose call instead of
    travelling to the engine and back. As in the engine (speculators/hidden.py), a request left out
    of the draft call before a verification keeps only its last rows, and rows a propose call took
    but the drafter did not use (the call raised, or the drafter did not know the request) go back."""

    def __init__(self, worker: DraftWorker):
        self.worker, self.pending = worker, PendingHidden()
        self._drafted: set[str] = set()
        """Requests in a propose call since their last verification."""

    def hidden_spec(self) -> tuple[tuple[int, ...], str]:
        return self.worker.hidden_spec()

    def keep_prefill(self, hidden: dict[str, torch.Tensor] | None) -> None:
        for seq_id, rows in (hidden or {}).items():
            self.pending.add(seq_id, 0, rows)

    def keep_verified(self, batch: Sequence[VerifyItem], reply: VerifyReply, runner) -> None:
        verified = [item.request_id for item in batch]
        for chunk in reply.prefill:  # first: a starting request's tree rows follow its last chunk's
            if chunk.hidden is not None:
                self.pending.add(chunk.seq_id, chunk.start, chunk.hidden)
                chunk.hidden = None
        self.pending.idle([item.request_id for item in batch if item.request_id not in self._drafted and not item.keep_rows])
        self._drafted.difference_update(verified)
        for item, result in zip(batch, reply.results):
            if isinstance(result, VerifyResult) and result.hidden is not None:
                root = runner.committed_length(item.request_id) - len(result.accepted_nodes)
                self.pending.add(item.request_id, root, result.hidden)
                result.hidden = None

    def call(self, method: str, *args: Any) -> Any:
        if method == "propose":
            return self._propose(args[0])
        return getattr(self.worker, method)(*args)

    def drop(self, request_id: str) -> None:
        self.pending.drop(request_id)
        self._drafted.discard(request_id)

    def _propose(self, requests: Sequence[DraftRequest]) -> DraftReply:
        taken = {r.request_id: self.pending.take(r.request_id) for r in requests}
        self._drafted.update(taken)
        try:
            reply = self.worker.propose([replace(r, hidden=taken[r.request_id]) for r in requests])
        except Exception:
            self._put_back(taken, taken)
            raise
        self._put_back(taken, reply.unknown)
        return reply

    def _put_back(self, taken: dict[str, TargetHidden | None], request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            if taken[request_id] is not None:
                self.pending.put_back(request_id, taken[request_id])


class TargetGroup:
    """Driver-side handle of a tensor-parallel target: `world_size` TargetShard actors on one node.

    `submit(method, *args)` sends the same call to every rank and returns one Future. Every rank
    must receive every call in the same order, or their collectives pair up wrongly and deadlock:
    Ray runs one caller's calls to one actor in submission order, and a lock here keeps calls from
    different threads in one order across all ranks. Calls to the shards must go through `submit`.

    `actor_options` gives each rank's Ray options (placement passes its scheduling strategy there).
    Rank 0 picks the rendezvous port on its own node; the ranks meet on 127.0.0.1 when they share
    that node (placement packs a group on one node) and at rank 0's node address otherwise.
    `hidden_layers` and `hidden_dtype`: the hidden states rank 0 returns for a drafter that reads
    them (TargetWorker). `build_drafter` (TP 1 only) puts the drafter in the shard's process, built
    over its decoder. `cpu_threads`: torch threads of each shard (None: the cores it may use).
    `cache`: the KV cache layout of every rank (blocks, block size, prefix caching).
    """

    def __init__(
        self,
        model: str,
        world_size: int = 1,
        *,
        max_sequences: int = 8,
        max_len: int = 2048,
        dtype: str = "float32",
        device: str = "cpu",
        attention_backend: str = "sdpa",
        cuda_graphs: bool = False,
        actor_options: Sequence[dict[str, Any]] | None = None,
        ready_timeout_s: float = 600.0,
        hidden_layers: Sequence[int] = (),
        hidden_dtype: str = "float32",
        build_drafter: Callable[[LlamaDecoder], Proposer] | None = None,
        cpu_threads: int | None = None,
        cache: CacheOptions = CacheOptions(),
    ):
        import ray

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        # Checked here, from config.json alone: a bad size raised inside the actors would leave
        # the other ranks waiting at the rendezvous.
        ShardPlan(0, world_size).validate(load_config(resolve_model(model)))
        options = list(actor_options) if actor_options is not None else [_default_options()] * world_size
        if len(options) != world_size:
            raise ValueError(f"{world_size} ranks need {world_size} actor option dicts, got {len(options)}")
        self.world_size = world_size
        self._order = threading.Lock()
        shard_class = ray.remote(TargetShard)
        self._shards = [
            shard_class.options(**options[rank]).remote(
                model, rank, world_size, max_sequences, max_len, dtype, device, attention_backend, cuda_graphs,
                hidden_layers, hidden_dtype, build_drafter, cpu_threads, cache,
            )
            for rank in range(world_size)
        ]
        self._join(ready_timeout_s)

    def _join(self, timeout_s: float) -> None:
        """Rendezvous every rank at rank 0's node and block until each has loaded its slice, so a
        failed start raises here and not on first use."""
        import ray

        try:
            nodes = ray.get([shard.node.remote() for shard in self._shards], timeout=timeout_s)
            port = ray.get(self._shards[0].rendezvous_port.remote(), timeout=timeout_s)
            address = "127.0.0.1" if len({node_id for node_id, _ in nodes}) == 1 else nodes[0][1]
            self.submit("join", address, port).result(timeout_s)
        except (TimeoutError, FutureTimeoutError):  # ray.get's GetTimeoutError is a TimeoutError
            self.shutdown()
            raise TimeoutError(
                f"{self.world_size} target shards not ready after {timeout_s:.0f} s (an unsatisfiable "
                f"resource request waits silently); available: {ray.available_resources()}, "
                f"cluster: {ray.cluster_resources()}"
            ) from None
        except BaseException:
            self.shutdown()
            raise

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Call `method(*args, **kwargs)` on every rank; the Future gives rank 0's result once all
        ranks are done, or the first rank's error (a failed rank can leave the others stuck in a
        collective: shut the group down and start a new one)."""
        if not self._shards:
            raise RuntimeError("the target group is shut down")
        with self._order:
            refs = [getattr(shard, method).remote(*args, **kwargs) for shard in self._shards]
        return _rank0_when_all_done([ref.future() for ref in refs])

    def parameter_bytes(self) -> list[int]:
        """Each rank's weight bytes, in rank order."""
        import ray

        return ray.get([shard.parameter_bytes.remote() for shard in self._shards])

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Whether every rank answers a ping within `timeout_s` (it waits behind calls in flight)."""
        try:
            self.submit("ping").result(timeout_s)
        except Exception:
            return False
        return True

    def shutdown(self) -> None:
        import ray

        for shard in self._shards:
            ray.kill(shard)
        self._shards = []


def _default_options() -> dict[str, Any]:
    """One GPU per rank when the cluster has GPUs; num_cpus=0 either way (a GPU actor that also
    asks for a CPU competes with everything else for the node's few CPU slots)."""
    import ray

    return {"num_cpus": 0, "num_gpus": 1} if ray.cluster_resources().get("GPU", 0) > 0 else {"num_cpus": 0}


def _free_port() -> int:
    """A TCP port free on every address of this node now, for rank 0 to listen on at the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _rank0_when_all_done(futures: list[Future]) -> Future:
    """One Future for a call on every rank: rank 0's result when all succeed, else the first error."""
    combined: Future = Future()
    remaining = len(futures)
    lock = threading.Lock()

    def on_done(done: Future) -> None:
        nonlocal remaining
        error = done.exception()
        with lock:
            if combined.done():
                return
            if error is not None:
                combined.set_exception(error)
                return
            remaining -= 1
            if remaining == 0:
                combined.set_result(futures[0].result())

    for future in futures:
        future.add_done_callback(on_done)
    return combined
