"""A vLLM v1 KV connector that keeps prompt KV in a :class:`~kvcodec.store.KVStore`, compressed by a kvcodec codec.

Load it with::

    vllm serve <model> --kv-transfer-config '{"kv_connector": "KVCodecConnector",
        "kv_connector_module_path": "kvcodec.engines.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"codec": "cachegen", "codec_options": {}, "chunk_tokens": 256,
                                      "tiers": ["cpu:2147483648", "disk:/var/cache/kvcodec", "redis://127.0.0.1:6379/0"]}}'

``kv_connector_extra_config`` keys (all optional):

- ``codec`` (default ``cachegen``) and ``codec_options`` (a dict of the codec's settings); or a list of variants,
  smallest first, each a spec with its options (``["kvtc:level=0", "cachegen", "raw"]``): every chunk is saved in
  each, and each load picks per chunk the one that loads soonest over the link as measured, or stops where vLLM
  recomputing the rest is sooner (:mod:`kvcodec.store.plan`; kvtc variants need the model's calibration installed);
- ``chunk_tokens`` (default 256): tokens per stored chunk; ``hash`` (``sha256`` or ``xxh3-128``);
- ``tiers``: fastest first, each a tier URL (:mod:`kvcodec.store.urls`): ``cpu[:SIZE]`` (default 1 GiB),
  ``gpu[:SIZE]``, ``disk[:FOLDER][?capacity=SIZE&shared=true]`` (default 10 GiB; a bare ``disk`` is the private
  ``~/.cache/kvcodec/vllm``, and a folder another user owns or may write is refused unless ``shared=true``),
  ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?ttl=SECONDS&prefix=P&timeout=S]`` or ``rediss://...`` (TLS,
  ``ssl_ca_certs=PATH``...) (default ``["cpu", "disk"]``); ``redis_url`` adds a Redis tier; ``redis_timeout_s``
  (default 0.5);
- ``model``: the model id in the keys (default ``model_config.model``, the path or name vLLM was given);
- ``namespace``: a deployment or tenant whose caches are kept apart from every other's (it leads every key);
  ``secret_file``: a file holding the secret that authenticates stored values (default ``$KVCODEC_STORE_SECRET``;
  never the secret itself here, since vLLM logs this configuration);
- ``calibration_options``: for ``codec`` ``kvtc`` with its calibration ``"auto"`` (the default), the settings of
  the calibration made when none is installed for the model (:func:`kvcodec.tools.kvtc_calibration.calibrate`'s options, e.g.
  ``{"max_tokens": 4096}``): the connector then loads the served folder with transformers on the CPU, calibrates
  it once into the cache folder and says so in the log; later starts find it installed.  ``calibrate``:
  ``"background"`` (default: vLLM serves at once, saving and loading with ``fallback_codec``, default
  ``cachegen``, until the calibration is installed, then with kvtc) or ``"now"`` (the engine's start waits for it).

vLLM runs the scheduler-side and worker-side connector in different processes, each with its own
store object.  A ``cpu`` / ``gpu`` tier is private to its process, so every chunk is also written to
every disk and Redis tier (the store's placement policy treats them as shared) and the scheduler's
``lookup`` finds it there; tiers with no shared one among them log a warning at start-up.

At start-up (:mod:`kvcodec.engines.vllm_setup`) the connector finds the channel profile that ``cachegen`` and
``kvfetcher`` use from the model's HuggingFace config (its architecture and shape, not its path), and the paged
layout of the KV memory from vLLM's attention backend: its CPU backend's ``(num_blocks, H, block_size, 2*D)`` with
keys transposed per block (isa ``vec``/``vec16``), its GPU backends' ``(num_blocks, H, block_size, 2*D)`` split
into keys and values, or ``(2, num_blocks, block_size, H, D)``.  Any other layout (the CPU backend's AMX kernels
pack keys into tiles) stops vLLM's start-up with an error naming it.

What it does:

- scheduler side: ``get_num_new_matched_tokens`` looks the prompt up in the store (chained chunk
  hashes, :mod:`kvcodec.store.keys`), rounds the hit down to whole vLLM blocks, keeps at least one
  prompt token for vLLM to compute, and subtracts what vLLM already has.  ``update_state_after_alloc``
  records the load, ``build_connector_meta`` turns loads and (once a prompt's prefill completes)
  saves into :class:`KVCodecConnectorMetadata` with the request's block table.
- worker side: ``start_load_kv`` starts a :class:`~kvcodec.store.PrefixLoad` per request: the store's one load
  path, which fetches chunk ``i+1`` while it decodes chunk ``i`` layer by layer straight into vLLM's paged tensors
  through the block table (``Codec.decode_layer_paged``: cachegen's Triton kernel on a GPU, the codec's CPU decode
  and a scatter on a CPU; a chunk reaching past the tokens to load is decoded densely and only its part inside is
  written, so blocks vLLM already holds are never touched).  ``wait_for_layer_load(layer)`` returns once that layer
  of every chunk is in.  A chunk that is missing, not of the paged memory's shape or does not decode or write is
  never raised into vLLM: the blocks from its first token on are reported by ``get_block_ids_with_load_errors()``
  so vLLM recomputes them, and a bad chunk is evicted (a fault of this machine leaves it stored).
- keys: the store's chains are seeded by the served model's identity (its folder's ``config.json``, the KV dtype,
  this process's tensor- and pipeline-parallel rank; :func:`kvcodec.engines.vllm_setup.vllm_identity`) and each
  request's ``cache_salt``.  Requests with a LoRA adapter or multimodal inputs are neither loaded nor saved.
  ``save_kv_layer`` gathers each layer's prompt tokens out of the paged tensor (``read_paged``),
  ``wait_for_save`` assembles them into a :class:`~kvcodec.cache.KVCache` and ``put``s it (only chunks
  not stored yet are encoded).  Loads and saves finish within the forward pass, so ``get_finished``
  reports nothing asynchronous and ``request_finished`` never holds blocks.

When vLLM is importable the class subclasses its ``KVConnectorBase_V1``; otherwise small stand-ins of
the same protocol are used.  ``tests/engines/test_vllm.py`` runs it inside vLLM's CPU build (0.32.0);
``tests/test_vllm_connector.py`` drives it with stand-ins on GPU-style layouts no CPU engine produces.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcodec.cache import KVCache
from kvcodec.engines.vllm_setup import (  # noqa: F401 (make_tier: part of this module's interface)
    build_store,
    detect_layout,
    engine_logger,
    make_tier,
    use_profile_of_config,
    vllm_identity,
)
from kvcodec.layouts.paged import FLASH, read_paged, slot_mapping
from kvcodec.adapt import BandwidthEstimator
from kvcodec.store import ChunkShape, KVStore, PagedSink, PrefixLoad
from kvcodec.store.plan import LoadPlanner

log = engine_logger(__name__)

try:  # pragma: no cover - vLLM is not installed in the CPU test environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _ConnectorBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _MetadataBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
    )
    HAVE_VLLM = True
except Exception:  # ImportError, or a vLLM that fails to import without a GPU
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's enum of the same name."""

        SCHEDULER = 0
        WORKER = 1

    class _MetadataBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorMetadata``."""

    class _ConnectorBase:  # type: ignore[no-redef]
        """Stand-in for the parts of vLLM's ``KVConnectorBase_V1`` this connector uses."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            if self._kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def shutdown(self) -> None:
            return None


# --- metadata --------------------------------------------------------------------------------------

@dataclass
class LoadSpec:
    """Load tokens ``start .. end-1`` of ``token_ids`` (the prompt up to the end of the chunk holding token
    ``end-1``) into the blocks ``block_ids``."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    salt: str | None = None


@dataclass
class SaveSpec:
    """Save the KV of ``token_ids`` (a prompt), held in the blocks ``block_ids``."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    salt: str | None = None


@dataclass
class KVCodecConnectorMetadata(_MetadataBase):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    step_tokens: int = 0  # tokens vLLM computes in this step: the worker times its prefill speed with them


# --- the connector -----------------------------------------------------------------------------

def _layer_order(names: Sequence[str]) -> list[str]:
    nums = [re.findall(r"\d+", n) for n in names]
    if all(nums) and len({int(n[0]) for n in nums}) == len(names):
        return sorted(names, key=lambda n: int(re.findall(r"\d+", n)[0]))
    return list(names)


def _first_block_ids(block_ids: Any) -> list[int]:
    """vLLM passes block ids per KV-cache group, ``([ids...],)``; take the first group."""
    if block_ids is None:
        return []
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in block_ids]


class KVCodecConnector(_ConnectorBase):
    """vLLM ``KVConnectorBase_V1`` backed by a kvcodec :class:`~kvcodec.store.KVStore` (see the module doc)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *, store: KVStore | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        model_config = getattr(vllm_config, "model_config", None)
        model = getattr(model_config, "model", None) or "unknown-model"
        self.store = store if store is not None else build_store(
            extra, str(model), identity=vllm_identity(vllm_config, role != KVConnectorRole.SCHEDULER))
        self.profile = use_profile_of_config(self.store.model, getattr(model_config, "hf_config", None))
        if self.profile is not None:
            log.info("kvcodec connector: model %s uses the channel profile of %s", self.store.model, self.profile)
        elif any(c.uses_profile for c in self.store.variants):
            log.warning("kvcodec connector: no channel profile matches model %s (see `kvcodec profile`); %s fall(s) "
                        "back to steps from the data, at lower quality", self.store.model,
                        ", ".join(c.codec_id for c in self.store.variants if c.uses_profile))
        if role == KVConnectorRole.SCHEDULER and getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            log.warning("kvcodec connector: kv_load_failure_policy is 'fail', so a stored chunk that turns out missing or "
                        "damaged fails its request; set \"kv_load_failure_policy\": \"recompute\" in "
                        "--kv-transfer-config and vLLM recomputes those blocks instead")
        self.block_size = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", None) or 16)
        self.layout = FLASH
        self.stats = {"lookups": 0, "lookup_hit_tokens": 0, "loaded_tokens": 0, "load_error_blocks": 0, "saved_chunks": 0}
        # scheduler side
        self._matched: dict[str, tuple[int, int]] = {}  # req id -> (num_computed_tokens, external tokens)
        self._need_load: dict[str, tuple[int, int]] = {}  # req id -> (start, end)
        self._unsaved: dict[str, dict[str, Any]] = {}  # req id -> prompt ids, block ids, tokens done
        self._keyed: dict[str, str | None] = {}  # req id -> its cache_salt, for requests the store can key
        self._unkeyable_logged: set[str] = set()
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_names: list[str] = []
        self._loads: list[tuple[LoadSpec, PrefixLoad]] = []
        # vLLM's prefill speed on this worker (tokens per second of steps without loads): a load stops where
        # recomputing the rest would be sooner (kvcodec.store.plan)
        self.prefill = BandwidthEstimator()
        self._step: tuple[float, int] | None = None  # start and tokens of a step without loads
        self._save_parts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose load failed in this forward pass: not saved

    # ============================== scheduler side ==============================
    def _unkeyable(self, request: Any) -> str | None:
        """Why the store cannot key ``request``'s KV by its tokens alone (a LoRA adapter or multimodal inputs change
        the KV of the same tokens), or None."""
        if getattr(request, "lora_request", None) is not None:
            return "a LoRA adapter"
        if getattr(request, "mm_features", None) or getattr(request, "mm_hashes", None) or \
                getattr(request, "mm_positions", None):
            return "multimodal inputs"
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` that the store can supply (whole blocks), and False (sync load).
        Requests whose KV depends on more than their tokens and ``cache_salt`` are neither loaded nor saved."""
        ids = list(getattr(request, "prompt_token_ids", None) or [])
        why = self._unkeyable(request)
        if why is not None:
            self._keyed.pop(request.request_id, None)
            if why not in self._unkeyable_logged:
                self._unkeyable_logged.add(why)
                log.warning("kvcodec connector: requests with %s are neither loaded from nor saved to the store (its "
                            "keys do not cover them yet); said once", why)
            return 0, False
        salt = getattr(request, "cache_salt", None)
        self._keyed[request.request_id] = salt
        if len(ids) < 2:
            return 0, False
        try:
            # the whole prompt's chunks (a stored last chunk counts), less one token that vLLM must compute
            hit = min(self.store.lookup(ids, salt=salt).num_tokens, len(ids) - 1)
        except Exception:
            log.warning("store lookup failed; treating it as a miss", exc_info=True)
            hit = 0
        hit = hit // self.block_size * self.block_size
        self.stats["lookups"] += 1
        self.stats["lookup_hit_tokens"] += hit
        ext = max(0, hit - int(num_computed_tokens))
        self._matched[request.request_id] = (int(num_computed_tokens), ext)
        return ext, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        computed, _ = self._matched.pop(rid, (0, 0))
        if num_external_tokens > 0:
            self._need_load[rid] = (computed, computed + int(num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVCodecConnectorMetadata:
        meta = KVCodecConnectorMetadata()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        meta.step_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or sum(scheduled.values()))
        for req in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            rid = req.req_id
            if rid not in self._keyed:  # not looked up here, or not keyable: neither loaded nor saved
                continue
            salt = self._keyed[rid]
            ids = [int(t) for t in (req.prompt_token_ids or [])]
            blocks = _first_block_ids(req.block_ids)
            if rid in self._need_load:
                start, end = self._need_load.pop(rid)
                # the chunks that hold tokens start..end-1, as they were stored (a chunk's key covers its tokens)
                chunk_end = min(len(ids), -(-end // self.store.chunk_tokens) * self.store.chunk_tokens)
                meta.loads.append(LoadSpec(rid, ids[:chunk_end], blocks, start, end, salt))
            done = int(getattr(req, "num_computed_tokens", 0)) + int(scheduled.get(rid, len(ids)))
            self._unsaved[rid] = {"ids": ids, "blocks": blocks, "done": done, "salt": salt}
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            new_blocks = getattr(cached, "new_block_ids", None) or []
            computed = getattr(cached, "num_computed_tokens", None) or []
            resumed = set(getattr(cached, "resumed_req_ids", None) or ())
            flags = getattr(cached, "resumed_from_preemption", None) or []  # older vLLM: one bool per request
            resumed |= {rid for rid, f in zip(getattr(cached, "req_ids", None) or [], flags) if f}
            for i, rid in enumerate(getattr(cached, "req_ids", None) or []):
                st = self._unsaved.get(rid)
                if st is None:
                    continue
                nb = _first_block_ids(new_blocks[i]) if i < len(new_blocks) else []
                st["blocks"] = nb if rid in resumed else st["blocks"] + nb
                if i < len(computed):
                    st["done"] = int(computed[i]) + int(scheduled.get(rid, 0))
        for rid in list(self._unsaved):
            st = self._unsaved[rid]
            if st["done"] >= len(st["ids"]):  # the prompt's prefill completes in this step
                ids = st["ids"]
                if not self.store.save_partial:
                    ids = ids[: len(ids) // self.store.chunk_tokens * self.store.chunk_tokens]
                if ids:
                    meta.saves.append(SaveSpec(rid, ids, st["blocks"], st["salt"]))
                del self._unsaved[rid]
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Saves finish within the forward pass, so the blocks can be freed now."""
        rid = request.request_id
        self._unsaved.pop(rid, None)
        self._need_load.pop(rid, None)
        self._matched.pop(rid, None)
        self._keyed.pop(rid, None)
        return False, None

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the layers and their paged layout; an unknown layout stops vLLM's start-up here (UnsupportedError)."""
        self.layout = detect_layout(self._vllm_config, kv_caches)
        self.kv_caches = dict(kv_caches)
        self.layer_names = _layer_order(list(kv_caches))
        first = next(iter(kv_caches.values()))
        _, self.block_size, heads, dim = self.layout.geometry(first)
        # only chunks of exactly this memory's shape are loaded, and their decodes are bounded by its size
        self.store.shape = ChunkShape(len(kv_caches), heads, dim, dim, str(first.dtype).removeprefix("torch."))
        log.info("kvcodec connector: %d layers, paged layout %r, block size %d", len(kv_caches), self.layout.name,
                 self.block_size)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM binds each step's metadata before its forward pass (a step without loads calls ``start_load_kv``
        only after it), so a step's prefill is timed from here to ``wait_for_save``."""
        super().bind_connector_metadata(connector_metadata)
        meta = self._metadata()
        timed = meta is not None and not meta.loads and meta.step_tokens >= self.block_size
        self._step = (time.perf_counter(), meta.step_tokens) if timed else None

    def _metadata(self) -> KVCodecConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVCodecConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start every request's load: chunks stream from the store straight into the paged memory
        (:class:`~kvcodec.store.PrefixLoad`), fetch overlapping decode, while vLLM runs.  With several stored
        variants a planner picks each chunk's, or leaves the rest to vLLM to recompute."""
        meta = self._metadata()
        self._loads = []
        if meta is None or not meta.loads:
            return
        layers = [self.kv_caches[name] for name in self.layer_names]
        recompute_tps = self.prefill.estimate if self.prefill.samples else None
        for spec in meta.loads:
            sink = PagedSink(layers, spec.block_ids, self.block_size, self.layout)
            load = PrefixLoad(self.store, spec.token_ids, sink, start=spec.start, end=spec.end, salt=spec.salt,
                              planner=LoadPlanner(self.store, recompute_tps=recompute_tps))
            self._loads.append((spec, load.start()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer of every load is in vLLM's memory (or its load ended short: reported later)."""
        if not self._loads or layer_name not in self.kv_caches:
            return
        index = self.layer_names.index(layer_name)
        for _, load in self._loads:
            load.wait_layer(index)

    def _finish_loads(self) -> None:
        for spec, load in self._loads:
            result = load.finish()
            self.stats["loaded_tokens"] += result.loaded_end - result.start
            loaded = [c for c in result.chunks if c.status == "loaded"]
            log.info("kvcodec connector: request %s: loaded tokens %d-%d of %d-%d in %.3f s, %d bytes, variants %s",
                     spec.req_id, result.start, result.loaded_end, spec.start, spec.end, result.seconds,
                     result.nbytes, [self.store.variants[c.variant].codec_id for c in loaded])
            if result.complete:
                continue
            first = result.loaded_end // self.block_size
            bad = {int(b) for b in spec.block_ids[first: (spec.end - 1) // self.block_size + 1]}
            why = next((f"chunk {c.key}: {c.error}" if c.error else f"chunk {c.key} is {c.status}"
                        for c in result.chunks if c.status != "loaded"), "")
            if any(c.status == "recompute" for c in result.chunks):
                log.info("kvcodec connector: request %s: recomputing tokens %d-%d is sooner than loading them "
                         "(prefill %.0f tokens/s); their %d blocks go back to vLLM", spec.req_id, result.loaded_end,
                         spec.end, self.prefill.estimate, len(bad))
            else:
                log.warning("kvcodec connector: request %s: tokens %d-%d did not load (%s); their %d blocks are "
                            "reported as load errors and vLLM recomputes them", spec.req_id, result.loaded_end,
                            spec.end, why, len(bad))
            self._load_errors |= bad
            self._failed_reqs.add(spec.req_id)
            self.stats["load_error_blocks"] += len(bad)
        self._loads = []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is None or not meta.saves:
            return
        for spec in meta.saves:
            try:
                slots = slot_mapping(torch.tensor(spec.block_ids, dtype=torch.long, device=kv_layer.device), 0,
                                     len(spec.token_ids), self.block_size)
                k, v = read_paged(kv_layer, slots, self.layout)
                self._save_parts.setdefault(spec.req_id, {})[layer_name] = (k.cpu(), v.cpu())
            except Exception:
                log.warning("gathering layer %s of request %s failed; not saved", layer_name, spec.req_id, exc_info=True)

    def wait_for_save(self) -> None:
        self._finish_loads()  # every layer's load is in place before this forward pass ends
        if self._step is not None:
            t0, tokens = self._step
            self.prefill.observe(tokens, time.perf_counter() - t0)
            self._step = None
        meta = self._metadata()
        parts, self._save_parts = self._save_parts, {}
        failed, self._failed_reqs = self._failed_reqs, set()
        if meta is None:
            return
        for spec in meta.saves:
            if spec.req_id in failed:  # part of its KV is missing; vLLM recomputes it, it is saved another time
                continue
            got = parts.get(spec.req_id, {})
            try:
                layers = []
                for name in self.layer_names:
                    if name not in got:  # a layer whose save_kv_layer was not called: read it now
                        paged = self.kv_caches[name]
                        slots = slot_mapping(torch.tensor(spec.block_ids, dtype=torch.long, device=paged.device), 0,
                                             len(spec.token_ids), self.block_size)
                        got[name] = tuple(x.cpu() for x in read_paged(paged, slots, self.layout))  # type: ignore[assignment]
                    layers.append(got[name])
                kv = KVCache(layers, model=self.store.model, token_ids=spec.token_ids, rope="post")
                # chunks the store holds anywhere (the ones just loaded, too) are not encoded again in this pass
                self.stats["saved_chunks"] += self.store.put(spec.token_ids, kv, replicate=False, salt=spec.salt)
            except Exception:
                log.warning("saving request %s failed", spec.req_id, exc_info=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose stored KV was missing or did not decode in the last forward pass (vLLM recomputes them)."""
        self._finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        try:
            self._finish_loads()
        finally:
            self.store.close()
