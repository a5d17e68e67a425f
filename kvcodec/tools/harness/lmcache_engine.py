"""A real ``LMCacheEngine`` on the CPU, for the tests and the benchmark: LMCache's own engine, storage manager,
local CPU backend and remote backends, with a GPU connector that copies between a CPU tensor and LMCache's memory
objects (there is no GPU, and a serving engine's paged memory is not what is under test here).

The KV is one tensor ``[2, L, T, H*D]`` (LMCache's ``KV_2LTD`` layout for the whole prompt), passed to
``store``/``retrieve`` as ``kvcaches=``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.metadata import LMCacheMetadata

MODEL = "SmolLM2-135M-Instruct"
_names = itertools.count()


class CPUTensorConnector(MockGPUConnector):
    """LMCache's mock GPU connector, made to move data: chunk ``[start, end)`` of ``kvcaches`` to and from a memory
    object's ``[2, L, end - start, H*D]`` tensor."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)


def kvcodec_plugin_config(url: str, **more: Any) -> dict[str, Any]:
    """docs/engines.md's LMCache configuration for kvcodec's remote storage plugin, with ``url`` as its settings."""
    return {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 1, "remote_serde": "naive",
            "remote_storage_plugins": ["kvcodec"],
            "extra_config": {"remote_storage_plugin.kvcodec.module_path": "kvcodec.engines.lmcache_plugin",
                             "remote_storage_plugin.kvcodec.class_name": "KVCodecConnectorAdapter",
                             "remote_storage_plugin.kvcodec.url": url},
            **more}


def local_disk_config(folder: str, **more: Any) -> dict[str, Any]:
    """LMCache's own local disk backend (what the plugin is compared with in bench/lmcache_io.py)."""
    return {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 1, "local_disk": f"file://{folder}",
            "max_local_disk_size": 4, **more}


def _writes_in_flight(backend: Any) -> bool:
    tasks = getattr(backend, "put_tasks", None) or getattr(getattr(backend, "disk_worker", None), "put_tasks", None)
    return bool(tasks)


class CPUEngine:
    """An ``LMCacheEngine`` built by ``LMCacheEngineBuilder`` on the CPU for a model of ``kv_shape``
    ``(L, 2, chunk_size, H, D)``; :meth:`close` destroys it (a new one shares nothing but the storage)."""

    def __init__(self, config: dict[str, Any], *, layers: int, heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, model: str = MODEL) -> None:
        cfg = LMCacheEngineConfig.from_dict(config)
        shape = (layers, 2, cfg.chunk_size, heads, head_dim)
        self.metadata = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=dtype, kv_shape=shape, role="worker")
        self.name = f"kvcodec-test-{next(_names)}"
        self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
            self.name, cfg, self.metadata, CPUTensorConnector(shape), mock_up_broadcast_fn,
            mock_up_broadcast_object_fn)
        self.engine.post_init()

    def store(self, tokens: list[int], kv: torch.Tensor) -> None:
        self.engine.store(torch.tensor(tokens), kvcaches=kv)

    def lookup(self, tokens: list[int]) -> int:
        return int(self.engine.lookup(torch.tensor(tokens)))

    def retrieve(self, tokens: list[int], like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The retrieved KV (NaN where nothing came back) and how many tokens LMCache says it retrieved."""
        out = torch.full_like(like, float("nan"))
        mask = self.engine.retrieve(torch.tensor(tokens), kvcaches=out)
        return out, int(torch.as_tensor(mask).sum())

    def remote_connector(self) -> Any:
        """kvcodec's connector inside LMCache's remote backend (under LMCache's instrumented wrapper)."""
        backends = self.engine.storage_manager.storage_backends
        remote = next(b for name, b in backends.items() if name.startswith("RemoteBackend"))
        return remote.connection.getWrappedConnector()

    def settle(self, timeout_s: float = 120) -> None:
        """Wait until LMCache's remote and local disk backends have no writes in flight."""
        backends = list(self.engine.storage_manager.storage_backends.values())
        deadline = time.monotonic() + timeout_s
        while any(_writes_in_flight(b) for b in backends) and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        # LMCache 0.5.6 frees its CPU memory pool before it closes its remote backends, so a put still in flight
        # would read freed memory (a segfault): destroy only once they are done.
        self.settle()
        LMCacheEngineBuilder.destroy(self.name)

    def __enter__(self) -> CPUEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
