"""What the vLLM connector works out once at start-up from vLLM's configuration: its store (from
``kv_connector_extra_config`` through :class:`~kvcodec.store.config.StoreConfig`), the identity of the caches it
keys (the model's configuration and weights, KV dtype, parallel rank), the cachegen profile of the served model, and
the paged layout of the KV memory vLLM hands it.  Importable without vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Mapping

import torch

from kvcodec.engines.auto_calibration import load_served_model
from kvcodec.engines.store_setup import open_store
from kvcodec.errors import UnsupportedError
from kvcodec.layouts.paged import CPU, FLASH, GPU, PagedLayout
from kvcodec.store import KVStore, MemoryTier
from kvcodec.store.config import StoreConfig
from kvcodec.store.identity import CacheIdentity, model_identity
from kvcodec.store.tiers import default_disk_folder


def engine_logger(name: str) -> logging.Logger:
    """A logger whose lines appear in vLLM's own output, with its format, when vLLM is installed."""
    return logging.getLogger(("vllm." if importlib.util.find_spec("vllm") else "") + name)


log = engine_logger(__name__)

WHERE = "kv_connector_extra_config"
# The connector's tiers unless configured: a per-process cache in front of a disk folder the scheduler and the
# workers share (a bare "disk" is the private ~/.cache/kvcodec/vllm).
DEFAULT_TIERS = ("cpu", "disk")
# vLLM's CPU attention kernels whose cache layout is PagedLayout CPU (keys transposed per block and head); the
# others ("amx" tile-packs the keys, "neon", "vsx", "vxe", "rvv" were never checked) are refused at start-up.
CPU_ISAS_KNOWN = ("vec", "vec16")
# vLLM's GPU backends that split a (num_blocks, H, block_size, 2*D) layer into keys and values with
# kv_cache.transpose(1, 2).split(head_size, dim=-1): PagedLayout GPU.
GPU_SPLIT_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")


# --- the store -------------------------------------------------------------------------------------

def connector_store(extra: Mapping[str, Any] | None, model: str, identity: CacheIdentity, *,
                    hf_config: Any = None) -> KVStore:
    """The store of a connector whose ``kv_connector_extra_config`` is ``extra``, serving ``model`` (the folder or
    name vLLM was given) with caches of ``identity`` (:func:`vllm_identity`).  Every key is a
    :class:`~kvcodec.store.config.StoreConfig` setting (``tiers`` defaults to :data:`DEFAULT_TIERS`); kvtc's
    calibration policy is :func:`~kvcodec.engines.store_setup.open_store`'s.  Warns when no tier can be shared
    between vLLM's scheduler and worker processes: then nothing saved is ever found."""
    config, _ = StoreConfig.parse({"tiers": list(DEFAULT_TIERS), **(extra or {})}, where=WHERE)
    store = open_store(config, model=model, identity=identity, log=log.info,
                       load_model=lambda: load_served_model(model, log.info),
                       disk_folder=default_disk_folder("vllm"), hf_config=hf_config, model_path=model)
    if all(isinstance(t, MemoryTier) for t in store.tiers):
        log.warning("kvcodec connector: tiers %s are private to each process, and vLLM runs its scheduler and its "
                    "workers in different processes: the scheduler will never find what a worker saved. Add a "
                    "shared tier (\"disk:<folder>\" or \"redis://host:port\") to \"tiers\".", list(config.tiers))
    return store


# --- what the caches depend on ---------------------------------------------------------------------

def cache_identity(model: str, *, kv_dtype: str = "", hf_config: Any = None, revision: str | None = None,
                   tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> CacheIdentity:
    """The :class:`~kvcodec.store.identity.CacheIdentity` of caches of ``model`` (the folder or name vLLM serves):
    its :func:`~kvcodec.store.identity.model_identity` (configuration and weight files), the KV dtype and the rank.
    Any process can compute it, so a test or a bench finds the engine's keys."""
    return CacheIdentity(model_digest=model_identity(model, hf_config=hf_config, revision=revision),
                         kv_dtype=kv_dtype, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)


def parallel_sizes(vllm_config: Any) -> tuple[int, int]:
    """vLLM's ``(tensor_parallel_size, pipeline_parallel_size)``: one worker per rank of each."""
    pc = getattr(vllm_config, "parallel_config", None)
    return int(getattr(pc, "tensor_parallel_size", 1) or 1), int(getattr(pc, "pipeline_parallel_size", 1) or 1)


def _ranks(vllm_config: Any, is_worker: bool) -> tuple[int, int, int, int]:
    """``(tp_rank, tp_size, pp_rank, pp_size)`` of this process; the scheduler keys as rank 0 of stage 0 (its
    lookups answer for that rank: another rank missing its chunk reports a load error and recomputes)."""
    pc = getattr(vllm_config, "parallel_config", None)
    tp_size, pp_size = parallel_sizes(vllm_config)
    if not is_worker:
        return 0, tp_size, 0, pp_size
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), tp_size, int(get_pp_group().rank_in_group), pp_size
    except Exception:  # no vLLM, or its groups are not set up in this process: the global rank says it
        rank = int(getattr(pc, "rank", 0) or 0)
        return rank % tp_size, tp_size, rank // tp_size % pp_size, pp_size


def vllm_identity(vllm_config: Any, is_worker: bool) -> CacheIdentity:
    """What the caches of this vLLM process depend on: the served model (configuration, weights, revision), the KV
    cache dtype (``cache_dtype``, or the model's dtype when it is ``auto``) and the parallel rank."""
    mc, cc = getattr(vllm_config, "model_config", None), getattr(vllm_config, "cache_config", None)
    kv_dtype = str(getattr(cc, "cache_dtype", None) or "auto")
    if kv_dtype == "auto":
        kv_dtype = str(getattr(mc, "dtype", "") or "").removeprefix("torch.")
    tp_rank, tp_size, pp_rank, pp_size = _ranks(vllm_config, is_worker)
    return cache_identity(served_model(vllm_config), kv_dtype=kv_dtype, hf_config=getattr(mc, "hf_config", None),
                          revision=getattr(mc, "revision", None), tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                          pp_size=pp_size)


def served_model(vllm_config: Any) -> str:
    """The folder or name vLLM serves (``model_config.model``)."""
    return str(getattr(getattr(vllm_config, "model_config", None), "model", None) or "unknown-model")


# --- the paged layout --------------------------------------------------------------------------------

def _attention_layers(vllm_config: Any, names: list[str]) -> dict[str, Any]:
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
    except ImportError:
        return {}
    return get_layers_from_vllm_config(vllm_config, Attention, names)


def _cpu_isa(vllm_config: Any, layer: Any, paged: torch.Tensor) -> str:
    """The CPU attention kernel set vLLM uses for this layer (it decides how keys sit in a block)."""
    isa = getattr(layer, "isa", None)
    if isa:
        return str(isa)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(vllm_config.model_config.dtype, int(paged.shape[2]), int(paged.shape[3]) // 2,
                             getattr(vllm_config.cache_config, "cache_dtype", None)))


def detect_layout(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> PagedLayout:
    """The :class:`~kvcodec.layouts.paged.PagedLayout` of the KV memory vLLM registered, from its attention backend;
    raises :class:`~kvcodec.errors.UnsupportedError` for a layout kvcodec does not know, before anything is read or
    written."""
    if not kv_caches:
        raise UnsupportedError("vLLM registered no KV cache layers")
    names = list(kv_caches)
    layers = _attention_layers(vllm_config, names)
    layouts = set()
    for name in names:
        paged, layer = kv_caches[name], layers.get(name)
        backend = layer.attn_backend.get_name() if layer is not None else None
        if paged.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise UnsupportedError(f"layer {name}: a {paged.dtype} KV cache (kv_cache_dtype "
                                   f"{getattr(vllm_config.cache_config, 'cache_dtype', '?')!r}); the kvcodec connector "
                                   "reads and writes float16, bfloat16 and float32 caches only")
        if backend == "CPU_ATTN":
            isa = _cpu_isa(vllm_config, layer, paged)
            if isa not in CPU_ISAS_KNOWN:
                # vLLM picks "amx" only for bfloat16 (cpu_attn.py), so another dtype runs the "vec" kernels here
                hint = (" Start vLLM with --dtype float16 (or float32): on this CPU those run vLLM's 'vec' kernels, "
                        "which the connector reads and writes." if isa == "amx" else "")
                raise UnsupportedError(
                    f"layer {name}: vLLM's CPU attention runs its {isa!r} kernels here, whose KV block layout the "
                    f"kvcodec connector does not know (it knows {list(CPU_ISAS_KNOWN)}: keys transposed per block and "
                    f"head); refusing rather than reading or writing it blindly.{hint}")
            layouts.add(CPU)
        elif paged.dim() == 5 and paged.shape[0] == 2:
            layouts.add(FLASH)
        elif backend in GPU_SPLIT_BACKENDS and paged.dim() == 4:
            layouts.add(GPU)
        else:
            raise UnsupportedError(f"layer {name}: a {tuple(paged.shape)} KV cache of attention backend {backend!r}; "
                                   "the kvcodec connector knows vLLM's CPU_ATTN (isa vec/vec16), "
                                   f"{', '.join(GPU_SPLIT_BACKENDS)} and (2, num_blocks, block_size, H, D) layers")
    if len(layouts) != 1:
        raise UnsupportedError(f"layers of different KV layouts {sorted(l.name for l in layouts)}")
    return layouts.pop()
