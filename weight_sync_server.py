"""The server side of the weight sync (weight_sync.py has the protocol and the trainer side): the gloo
weight-transfer engine that vLLM ships no CPU form of, and the worker extension that gets it imported.

vllm_server.py starts every server with `--worker-extension-cls weight_sync_server.GlooWorkerExtension`:
vLLM imports this module in each worker for that class before it loads the model, and the import
registers the `gloo` engine, which vLLM then creates at model load. It mirrors vLLM's NCCL engine: the
same update payload (names, dtypes, shapes), the same layerwise reload; the pieces are cut as the
trainer cuts them (weight_sync.plan_buckets). Only a server imports this module (it imports vLLM).
"""

import json
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from weight_sync import DEFAULT_BUCKET_BYTES, PIECE_BYTES, gloo_group, plan_buckets


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # rank of this server's first worker (the trainer is rank 0)
    world_size: int  # trainer + every worker of every server
    timeout_s: float = 300.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    # Same payload as vLLM's NCCL engine, so the trainer builds one dict for both backends.
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:  # as vLLM's NCCL update info: a short list would load a subset silently
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names and "
                f"{len(self.shapes)} shapes: one of each per tensor"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives the trainer's (rank 0's) broadcast pieces and loads them with `load_weights`, inside
    vLLM's layerwise reload, exactly as the NCCL engine does."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.store = None
        self.group = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        # The last sync's seconds in start, update (of which waiting on broadcasts: wait) and finish.
        self.seconds: dict[str, float] = {}
        # Receive buffers of the first pieces (up to `bucket_bytes`), kept from one sync to the next:
        # a fresh buffer costs a page fault per 4 KiB as gloo writes it, more than the copy itself
        # (105 MB: ~70 ms of faults against ~25 ms of copying, here). Free again once a sync has
        # finished, since the layerwise reload has copied every tensor out of them by then.
        self.buffers: list[torch.Tensor] = []

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        pc = self.parallel_config
        # The same rank arithmetic as vLLM's NCCL engine (worker_init_process_group).
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.buffers = []  # a receive the old group left posted may yet write them
        # vLLM pins this thread to its OMP core(s), and gloo's threads, made now, would inherit that:
        # the receive would then share one core with the load it is meant to overlap. They get every
        # core of the server instead (those of the engine process that started this worker).
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, os.sched_getaffinity(os.getppid()) | pinned)
        try:
            self.store, self.group = gloo_group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                init_info.timeout_s,
            )
        finally:
            os.sched_setaffinity(0, pinned)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        t0 = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self.seconds = {"start": time.perf_counter() - t0}

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        _repack_cpu_embedding_gemms(self.model)
        self.seconds["finish"] = time.perf_counter() - t0

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(); nothing is asynchronous here.
        t0 = time.perf_counter()
        self.seconds["wait"] = 0.0
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # A failed update (the trainer died or timed out, a payload this model cannot load, no group):
            # start_weight_update left every layer on meta tensors. Put every layer back on real tensors
            # (layers never reached keep their old weights) so the server can still serve once resumed;
            # the trainer has dropped this server, so the mixed weights never feed training.
            self.buffers = []  # a broadcast still posted into one may yet write them
            # Leave the group: the trainer's broadcasts to us then fail at once ("connection closed")
            # instead of waiting out the transfer timeout for receives we will never post; it re-joins us.
            self.group = self.store = None
            try:
                self.finish_weight_update()
            except Exception:  # noqa: BLE001 - the transfer error is the one to report
                pass
            raise
        self.seconds["update"] = time.perf_counter() - t0

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine")
        self.model.load_weights(self._received(update_info))

    def _received(self, update_info: GlooUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor once its broadcast has landed. The broadcasts of the pieces after it (up to
        `bucket_bytes` of them, at least one) are posted before it is handed on, so gloo's threads
        receive them while `load_weights` loads this one."""
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(update_info.shapes, dtypes)]
        pieces = plan_buckets(update_info.shapes, dtypes, PIECE_BYTES)
        piece_bytes = [sum(sizes[i] for i in piece) for piece in pieces]
        if [b.numel() for b in self.buffers] != piece_bytes[: len(self.buffers)]:
            self.buffers = []  # another model's payload
        posted: deque = deque()  # (buffer, its broadcast) of each posted piece, in the order sent
        ahead = 0  # bytes posted after the piece being loaded
        for k in range(len(pieces)):
            if not posted:
                ahead += self._post_piece(posted, k, piece_bytes[k])
            buf, work = posted.popleft()
            ahead -= buf.numel()
            nxt = k + 1 + len(posted)
            while nxt < len(pieces) and (not posted or ahead + piece_bytes[nxt] <= self.bucket_bytes):
                ahead += self._post_piece(posted, nxt, piece_bytes[nxt])
                nxt += 1
            t0 = time.perf_counter()
            work.wait()
            self.seconds["wait"] = self.seconds.get("wait", 0.0) + time.perf_counter() - t0
            # Views of `buf`: the layerwise loader may hold them until their layer is complete.
            for i, chunk in zip(pieces[k], buf.split([sizes[i] for i in pieces[k]])):
                yield update_info.names[i], chunk.view(dtypes[i]).view(update_info.shapes[i])

    def _post_piece(self, posted: deque, k: int, num_bytes: int) -> int:
        if k < len(self.buffers):
            buf = self.buffers[k]
        else:
            buf = torch.empty(num_bytes, dtype=torch.uint8)
            kept = sum(b.numel() for b in self.buffers)
            if k == len(self.buffers) and kept + num_bytes <= self.bucket_bytes:
                self.buffers.append(buf)
        posted.append((buf, self.group.broadcast(buf, 0)))
        return num_bytes

    def shutdown(self) -> None:
        self.group = None
        self.buffers = []
        self.store = None


try:
    WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)
except ValueError:  # already registered (module imported twice under different names)
    pass


def _repack_cpu_embedding_gemms(model: torch.nn.Module) -> None:
    """Rebuild the CPU GEMM handle of every embedding-method layer (embed_tokens, lm_head).

    vLLM's CPU backend pre-packs linear weights at load (`dispatch_cpu_unquantized_gemm`: oneDNN or
    sgl handles holding their own copy). The layerwise reload re-runs that packing for each layer that
    received weights — but with tied embeddings the checkpoint has no `lm_head.weight`, so the lm_head
    layer receives nothing, keeps its handle, and computes logits from the OLD embedding (measured:
    logprobs off by far more than 1e-3 after a sync). Re-dispatching is cheap and leaves the weight in
    place (`remove_weight=False` for embedding layers).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod) and hasattr(
            module, "cpu_linear"
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


class GlooWorkerExtension:
    """Named by `--worker-extension-cls` so every vLLM worker imports this module (and so registers the
    gloo engine) before it loads the model. The engine does all the work of a sync; the two methods
    here are for `bench/bench_weight_sync.py`, through the dev-mode `/collective_rpc`."""

    def weight_sync_seconds(self) -> dict:
        """The worker's side of the last sync (`GlooWeightTransferEngine.seconds`)."""
        return dict(self.weight_transfer_engine.seconds)

    def time_vllm_reload(self, payload: str) -> dict:
        """Seconds of vLLM's own reload of tensors already in this process, outside the protocol: random
        tensors of the JSON `payload`'s names, dtypes and shapes (a sync's update_info) loaded with
        `load_weights` inside the layerwise reload, which a sync needs too (it re-runs each layer's
        CPU GEMM packing: without it the packed copies keep the old weights). Leaves the server holding
        those random weights: sync after it."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        info = json.loads(payload)
        tensors = [
            (name, torch.randn(shape).to(getattr(torch, dtype)) * 0.02)
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"])
        ]
        engine = self.weight_transfer_engine
        with set_current_vllm_config(self.vllm_config):
            t0 = time.perf_counter()
            initialize_layerwise_reload(engine.model)
            t1 = time.perf_counter()
            engine.model.load_weights(iter(tensors))
            t2 = time.perf_counter()
            finalize_layerwise_reload(engine.model, engine.model_config)
            _repack_cpu_embedding_gemms(engine.model)
            t3 = time.perf_counter()
        return {"start": t1 - t0, "load": t2 - t1, "finish": t3 - t2, "total": t3 - t0}
