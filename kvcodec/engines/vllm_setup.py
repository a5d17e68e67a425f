"""What the vLLM connector works out once at start-up from vLLM's configuration: its store and tiers, the identity
of the caches it keys (model, KV dtype, parallel rank), the cachegen profile of the served model, and the paged
layout of the KV memory vLLM hands it.

Kept apart from :mod:`kvcodec.engines.vllm_connector` (the per-step protocol) and importable without vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from typing import Any

import torch

from kvcodec.engines.auto_calibration import (calibrate_in_background, ensure_model_calibration, load_served_model,
                                              needs_first_calibration, ready_variants, wants_calibration)
from kvcodec.errors import InvalidInputError, UnsupportedError
from kvcodec.layouts.paged import CPU, FLASH, GPU, PagedLayout
from kvcodec.profiles import find_profile, find_profile_for_config, register_profile
from kvcodec.store import KVStore, MemoryTier, PlacementPolicy, StorageTier
from kvcodec.store.auth import SECRET_ENV, check_secret, secret_from_env
from kvcodec.store.keys import CacheIdentity, model_digest
from kvcodec.store.urls import default_disk_folder, tier_from_url



def engine_logger(name: str) -> logging.Logger:
    """A logger whose lines appear in vLLM's own output, with its format, when vLLM is installed."""
    return logging.getLogger(("vllm." if importlib.util.find_spec("vllm") else "") + name)


log = engine_logger(__name__)

# vLLM's CPU attention kernels whose cache layout is PagedLayout CPU (keys transposed per block and head); the
# others ("amx" tile-packs the keys, "neon", "vsx", "vxe", "rvv" were never checked) are refused at start-up.
CPU_ISAS_KNOWN = ("vec", "vec16")
# vLLM's GPU backends that split a (num_blocks, H, block_size, 2*D) layer into keys and values with
# kv_cache.transpose(1, 2).split(head_size, dim=-1): PagedLayout GPU.
GPU_SPLIT_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")


# --- tiers and the store ---------------------------------------------------------------------------

def make_tier(spec: str, *, redis_timeout_s: float = 0.5) -> StorageTier:
    """One tier from a tier URL (:mod:`kvcodec.store.urls`: ``cpu[:SIZE]``, ``gpu[:SIZE]``, ``disk[:FOLDER][?...]``,
    ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?...]``, ``rediss://...``); a bare ``disk`` is the private
    per-user folder ``~/.cache/kvcodec/vllm``."""
    return tier_from_url(spec, timeout_s=redis_timeout_s, disk_folder=default_disk_folder("vllm"))


def build_store(extra: dict[str, Any] | None, model: str, *, identity: CacheIdentity | None = None) -> KVStore:
    """The store a connector uses, from ``kv_connector_extra_config``.  Warns when no tier can be shared between
    vLLM's scheduler and worker processes (only ``cpu`` / ``gpu`` tiers): then nothing saved is ever found.
    ``identity`` (:func:`cache_identity`) is what the engine's caches depend on; ``extra``'s ``namespace`` is added
    to it.  The secret that authenticates stored values comes from ``$KVCODEC_STORE_SECRET`` or the file named by
    ``secret_file`` (never from the configuration itself, which vLLM logs).
    With codec ``kvtc`` and its calibration ``"auto"``, a model (``model``: the folder vLLM serves) with no
    calibration installed is calibrated here, once (``calibration_options`` for kvtc's ``calibrate``)."""
    extra = dict(extra or {})
    if "secret" in extra:
        raise InvalidInputError(f"put the store secret in ${SECRET_ENV} or a file named by \"secret_file\", not in "
                                "kv_connector_extra_config, which vLLM writes to its log")
    timeout = float(extra.get("redis_timeout_s", 0.5))
    specs = list(extra.get("tiers") or ["cpu", "disk"])
    if extra.get("redis_url") and not any(s.startswith(("redis://", "rediss://")) for s in specs):
        specs.append(extra["redis_url"])
    tiers = [make_tier(s, redis_timeout_s=timeout) for s in specs]
    # private (in-process) tiers are caches; every other tier is shared between the scheduler and workers
    shared = [t.name for t in tiers if not isinstance(t, MemoryTier)]
    if not shared:
        log.warning("kvcodec connector: tiers %s are private to each process, and vLLM runs its scheduler and its "
                    "workers in different processes: the scheduler will never find what a worker saved. Add a "
                    "shared tier (\"disk:<folder>\" or \"redis://host:port\") to \"tiers\".", specs)
    name, codec, options = str(extra.get("model", model)), extra.get("codec", "cachegen"), extra.get("codec_options")
    load = lambda: load_served_model(model, log.info)  # noqa: E731
    when = extra.get("calibrate", "background")
    if when not in ("background", "now"):
        raise InvalidInputError(f"calibrate must be \"background\" or \"now\", not {when!r}")
    later = when == "background" and needs_first_calibration(codec, options, name)
    if wants_calibration(codec, options) and not later:
        ensure_model_calibration(name, load, log.info, extra.get("calibration_options"))
    identity = dataclasses.replace(identity or cache_identity(model), namespace=str(extra.get("namespace", "")))
    serving = (ready_variants(codec) or extra.get("fallback_codec", "cachegen")) if later else codec
    store = KVStore(tiers, model=name, codec=serving,
                    codec_options=None if later else options, chunk_tokens=int(extra.get("chunk_tokens", 256)),
                    hash=extra.get("hash", "sha256"), policy=PlacementPolicy(shared=shared), identity=identity,
                    secret=_secret(extra))
    if later:
        log.info("kvtc: no calibration of %s installed; serving with %s while it is made in the background", name,
                 store.codec.codec_id)
        calibrate_in_background(store, load, log.info, options, extra.get("calibration_options"), codec)
    return store


def _secret(extra: dict[str, Any]) -> bytes | None:
    path = extra.get("secret_file")
    if path is None:
        return secret_from_env()
    try:
        with open(path, "rb") as f:
            return check_secret(f.read(4096).strip())
    except OSError as e:
        raise InvalidInputError(f"secret_file {path!r} cannot be read: {e}") from None


# --- what the caches depend on ---------------------------------------------------------------------

def cache_identity(model: str, *, kv_dtype: str = "", hf_config: Any = None, revision: str | None = None,
                   tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> CacheIdentity:
    """The :class:`~kvcodec.store.keys.CacheIdentity` of caches of ``model`` (the folder or name vLLM serves).

    The model digest hashes the folder's ``config.json`` when ``model`` is a folder (any process can read it, so a
    test or a bench computes the same keys as the engine), else ``hf_config``, and the weights ``revision``."""
    config = hf_config
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            config = json.loads(f.read(1 << 20))
    return CacheIdentity(model_digest=model_digest(config, revision) if config is not None or revision else "",
                         kv_dtype=kv_dtype, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)


def _ranks(vllm_config: Any, is_worker: bool) -> tuple[int, int, int, int]:
    """``(tp_rank, tp_size, pp_rank, pp_size)`` of this process; the scheduler keys as rank 0 of stage 0 (its
    lookups answer for that rank: another rank missing its chunk reports a load error and recomputes)."""
    pc = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if not is_worker:
        return 0, tp_size, 0, pp_size
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), tp_size, int(get_pp_group().rank_in_group), pp_size
    except Exception:  # no vLLM, or its groups are not set up in this process: the global rank says it
        rank = int(getattr(pc, "rank", 0) or 0)
        return rank % tp_size, tp_size, rank // tp_size % pp_size, pp_size


def vllm_identity(vllm_config: Any, is_worker: bool) -> CacheIdentity:
    """What the caches of this vLLM process depend on: the served model's configuration and revision, the KV
    cache dtype (``cache_dtype``, or the model's dtype when it is ``auto``) and the parallel rank."""
    mc, cc = getattr(vllm_config, "model_config", None), getattr(vllm_config, "cache_config", None)
    kv_dtype = str(getattr(cc, "cache_dtype", None) or "auto")
    if kv_dtype == "auto":
        kv_dtype = str(getattr(mc, "dtype", "") or "").removeprefix("torch.")
    tp_rank, tp_size, pp_rank, pp_size = _ranks(vllm_config, is_worker)
    return cache_identity(str(getattr(mc, "model", None) or "unknown-model"), kv_dtype=kv_dtype,
                          hf_config=getattr(mc, "hf_config", None), revision=getattr(mc, "revision", None),
                          tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)


# --- the model's profile -------------------------------------------------------------------------------

def use_profile_of_config(model_id: str, hf_config: Any) -> str | None:
    """Make the profile measured on a model of ``hf_config``'s signature the one for caches of ``model_id`` (what
    cachegen and kvfetcher look up); returns the profile's own model name, or None when there is none.

    vLLM knows a model by a path or a served name, which rarely matches a shipped profile's file name, but it
    always has the HuggingFace config (:func:`kvcodec.profiles.model_signature`)."""
    own = find_profile(model_id)
    if own is not None:
        return own.model
    prof = find_profile_for_config(hf_config) if hf_config is not None else None
    if prof is None:
        return None
    register_profile(dataclasses.replace(prof, model=model_id))
    return prof.model


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
