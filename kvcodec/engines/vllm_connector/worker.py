"""The connector's worker side: vLLM's paged KV memory, each step's loads into it and saves out of it.

Loads go through the store's one load path (:meth:`~kvcodec.store.KVStore.prefix_load`): chunk ``i+1`` is fetched
while chunk ``i`` decodes layer by layer straight into vLLM's blocks through the block table, and
``wait_layer(l)`` returns once layer ``l`` of every load is in.  Whatever stops a load (a chunk missing, damaged,
of another shape, not decodable, or left to vLLM because recomputing is sooner) is never raised into vLLM: the
blocks from its first unloaded token on are reported by :meth:`WorkerSide.load_errors` and vLLM recomputes them.
Saves gather each layer's prompt tokens out of the paged memory during the forward pass; the store's ``put``
runs behind it (:mod:`.saves`), and :meth:`WorkerSide.report` tells the scheduler side which saves have run, and
what the store measured, for its lookups (vLLM's worker metadata).  A save waits, before each chunk, while a step
with loads runs: a load is a request's first token, a save is not.  Loads finish within the forward pass.

A load of segments is a fusion (:mod:`.fusion`): it runs in ``start_loads``, before vLLM's forward pass, with the
model :mod:`.model` recorded, and writes the fused context into the request's blocks; what stops it is a load error
of its blocks, as for a prefix load.  A save of a segment stores the prompt after the anchor under the segment's
own key.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvcodec.blend.fusion import RecomputeSchedule
from kvcodec.blend.segments import SegmentStore
from kvcodec.cache import KVCache
from kvcodec.engines.store_setup import time_decodes
from kvcodec.engines.vllm_connector.fusion import fuse_into_blocks
from kvcodec.engines.vllm_connector.metadata import KVCodecConnectorMetadata, LoadSpec, SaveSpec, WorkerReport
from kvcodec.engines.vllm_connector.model import worker_model
from kvcodec.engines.vllm_connector.requests import segment_spans
from kvcodec.engines.vllm_connector.saves import BackgroundSaves
from kvcodec.engines.vllm_connector.setup import detect_layout, engine_logger
from kvcodec.errors import UnsupportedError
from kvcodec.layouts.paged import FLASH, read_paged, slot_mapping
from kvcodec.store import ChunkShape, KVStore, PagedSink, PrefixLoad
from kvcodec.store.telemetry import Estimates, RateEstimator

log = engine_logger(__name__)


def layer_order(names: Sequence[str]) -> list[str]:
    """vLLM's layer names in model order (by their first number), or as given when they carry none."""
    nums = [re.findall(r"\d+", n) for n in names]
    if all(nums) and len({int(n[0]) for n in nums}) == len(names):
        return sorted(names, key=lambda n: int(re.findall(r"\d+", n)[0]))
    return list(names)


class WorkerSide:
    """A worker process's state over ``store``: the registered paged memory, the step's loads, the layers gathered
    for its saves, and vLLM's prefill speed here (tokens per second of steps without loads: a load stops where
    recomputing the rest would be sooner, :mod:`kvcodec.store.plan`), kept with the store's estimates
    (:attr:`~kvcodec.store.telemetry.Telemetry.prefill`), so that a fresh engine's first request weighs it too."""

    def __init__(self, store: KVStore, vllm_config: Any, block_size: int, anchor: Sequence[int] = ()) -> None:
        self.store, self.vllm_config, self.block_size = store, vllm_config, block_size
        self.segments = SegmentStore(store, anchor) if store.save_partial else None
        self.layout = FLASH
        self.stats = {"loaded_tokens": 0, "load_error_blocks": 0, "saved_chunks": 0, "fused_tokens": 0,
                      "saved_segments": 0}
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_names: list[str] = []
        self._step: tuple[float, int] | None = None  # start and tokens of a step without loads
        self._loads: list[tuple[LoadSpec, PrefixLoad]] = []
        self._save_parts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose load failed in this forward pass: not saved
        self.saves = BackgroundSaves()
        self._no_loads = threading.Event()  # clear from a step's loads' start to its end: saves wait meanwhile
        self._no_loads.set()
        self._reported = Estimates()  # the store's estimates as last reported to the scheduler side

    @property
    def prefill(self) -> RateEstimator:
        """vLLM's prefill speed here (the store's :attr:`~kvcodec.store.telemetry.Telemetry.prefill`; its prior is
        never planned with: a load has no recompute option until a step was timed, here or by a predecessor whose
        estimates the store restored)."""
        return self.store.telemetry.prefill

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the layers and their paged layout; an unknown layout stops vLLM's start-up here (UnsupportedError)."""
        self.layout = detect_layout(self.vllm_config, kv_caches)
        self.kv_caches = dict(kv_caches)
        self.layer_names = layer_order(list(kv_caches))
        first = next(iter(kv_caches.values()))
        _, self.block_size, heads, dim = self.layout.geometry(first)
        # only chunks of exactly this memory's shape are loaded, and their decodes are bounded by its size
        self.store.shape = ChunkShape(len(kv_caches), heads, dim, dim, str(first.dtype).removeprefix("torch."))
        time_decodes(self.store, log.info)
        log.info("kvcodec connector: %d layers, paged layout %r, block size %d", len(kv_caches), self.layout.name,
                 self.block_size)

    # -- loads -------------------------------------------------------------------------------------------
    def begin_step(self, meta: KVCodecConnectorMetadata | None) -> None:
        """vLLM binds each step's metadata before its forward pass (a step without loads calls ``start_load_kv``
        only after it), so a step's prefill is timed from here to :meth:`end_step`."""
        timed = meta is not None and not meta.loads and meta.step_tokens >= self.block_size
        self._step = (time.perf_counter(), meta.step_tokens) if timed else None

    def start_loads(self, meta: KVCodecConnectorMetadata | None) -> None:
        """Start every request's load; one that cannot start is a load error of its blocks."""
        self._loads = []
        if meta is None or not meta.loads:
            return
        self._no_loads.clear()
        layers = [self.kv_caches[name] for name in self.layer_names]
        recompute_tps = self.prefill.estimate if self.prefill.samples else None
        for spec in meta.loads:
            if spec.segments:
                self._fuse(spec, layers, recompute_tps)
                continue
            try:
                sink = PagedSink(layers, spec.block_ids, self.block_size, self.layout)
                load = self.store.prefix_load(spec.token_ids, sink, start=spec.start, end=spec.end, salt=spec.salt,
                                              recompute_tps=recompute_tps)
                self._loads.append((spec, load.start()))
            except Exception as e:
                log.warning("kvcodec connector: request %s: its load did not start", spec.req_id, exc_info=True)
                self._fail(spec, spec.start, f"its load did not start: {e}")

    def _fuse(self, spec: LoadSpec, layers: list[torch.Tensor], recompute_tps: float | None) -> None:
        """Fuse ``spec``'s segments into its blocks now, before vLLM's forward pass; what stops it is a load error
        of its blocks."""
        try:
            model = worker_model()
            if model is None or self.segments is None:
                raise UnsupportedError("this worker has no model to recompute with (vLLM's model runner was not "
                                       "seen initializing its KV cache)" if model is None else
                                       "the store does not save partial chunks")
            segments = [spec.token_ids[a:b] for a, b in segment_spans(len(self.segments.anchor), spec.segments)]
            sink = PagedSink(layers, spec.block_ids, self.block_size, self.layout)
            done = fuse_into_blocks(model, self.segments, segments, sink, spec.end,
                                    schedule=RecomputeSchedule(share=spec.share), recompute_tps=recompute_tps)
        except Exception as e:
            log.warning("kvcodec connector: request %s: its segments were not fused", spec.req_id, exc_info=True)
            self._fail(spec, spec.start, f"its fusion failed: {e}")
            return
        self.stats["fused_tokens"] += done.written
        log.info("kvcodec connector: request %s: fused %d segments into tokens 0-%d: %s", spec.req_id,
                 len(segments), done.written, done.report.summary())

    def wait_layer(self, layer_name: str) -> None:
        """Return once this layer of every load is in vLLM's memory (or its load ended short: reported later)."""
        if not self._loads or layer_name not in self.kv_caches:
            return
        index = self.layer_names.index(layer_name)
        for _, load in self._loads:
            load.wait_layer(index)

    def finish_loads(self) -> None:
        """Wait for every load of the step and record the blocks of those that ended short; each load's outcome is
        recorded, whatever another's does."""
        loads, self._loads = self._loads, []
        for spec, load in loads:
            try:
                result = load.finish()
            except Exception as e:  # a load path fault: nothing it wrote is trusted
                log.warning("kvcodec connector: request %s: its load failed", spec.req_id, exc_info=True)
                self._fail(spec, spec.start, f"its load failed: {e}")
                continue
            self.stats["loaded_tokens"] += result.loaded_end - result.start
            loaded = [c for c in result.chunks if c.status == "loaded"]
            log.info("kvcodec connector: request %s: loaded tokens %d-%d of %d-%d in %.3f s, %d bytes, variants %s, "
                     "%d bytes wasted", spec.req_id, result.start, result.loaded_end, spec.start, spec.end,
                     result.seconds, result.nbytes, [self.store.variants[c.variant].codec_id for c in loaded],
                     result.wasted_bytes)
            if result.complete:
                continue
            if any(c.status == "recompute" for c in result.chunks):
                log.info("kvcodec connector: request %s: recomputing tokens %d-%d is sooner than loading them "
                         "(prefill %.0f tokens/s); their blocks go back to vLLM", spec.req_id, result.loaded_end,
                         spec.end, self.prefill.estimate)
                self._fail(spec, result.loaded_end, None)
            else:
                why = next((f"chunk {c.key}: {c.error}" if c.error else f"chunk {c.key} is {c.status}"
                            for c in result.chunks if c.status != "loaded"), "")
                self._fail(spec, result.loaded_end, why)

    def _fail(self, spec: LoadSpec, loaded_end: int, why: str | None) -> None:
        """Tokens ``loaded_end .. spec.end-1`` did not load: their blocks are load errors (``why``: warned)."""
        bad = {int(b) for b in spec.block_ids[loaded_end // self.block_size: (spec.end - 1) // self.block_size + 1]}
        if why is not None:
            log.warning("kvcodec connector: request %s: tokens %d-%d did not load (%s); their %d blocks are reported "
                        "as load errors and vLLM recomputes them", spec.req_id, loaded_end, spec.end, why, len(bad))
        self._load_errors |= bad
        self._failed_reqs.add(spec.req_id)
        self.stats["load_error_blocks"] += len(bad)

    def load_errors(self) -> set[int]:
        """Blocks whose stored KV did not load in the last forward pass (vLLM recomputes them); reported once."""
        self.finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    # -- saves -------------------------------------------------------------------------------------------
    def _save_segment(self, spec: SaveSpec, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store ``spec``'s prompt after the anchor as a segment (its KV computed after the anchor, as segments
        are)."""
        a = len(self.segments.anchor)
        kv = KVCache([(k[:, a:], v[:, a:]) for k, v in layers], model=self.store.model, rope="post",
                     positions=range(a, len(spec.token_ids)))
        saved = self.segments.put(spec.token_ids[a:], kv, pace=self._after_loads)
        self.stats["saved_segments"] += 1
        log.info("kvcodec connector: request %s: stored tokens %d-%d as a segment (%d new chunk(s))", spec.req_id, a,
                 len(spec.token_ids), saved)

    def _gather(self, spec: SaveSpec, paged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slot_mapping(torch.tensor(spec.block_ids, dtype=torch.long, device=paged.device), 0,
                             len(spec.token_ids), self.block_size)
        k, v = read_paged(paged, slots, self.layout)
        return k.cpu(), v.cpu()

    def save_layer(self, meta: KVCodecConnectorMetadata | None, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gather this layer of every prompt the step saves."""
        for spec in meta.saves if meta is not None else ():
            try:
                self._save_parts.setdefault(spec.req_id, {})[layer_name] = self._gather(spec, kv_layer)
            except Exception:
                log.warning("gathering layer %s of request %s failed; not saved", layer_name, spec.req_id, exc_info=True)

    def end_step(self, meta: KVCodecConnectorMetadata | None) -> None:
        """The forward pass ends: every load is in place and the step's prefill speed is recorded; every prompt
        whose load did not fail has its KV copied out of vLLM's memory and its save queued behind the step (only
        chunks not stored yet are encoded)."""
        self.finish_loads()
        if self._step is not None:
            t0, tokens = self._step
            self.prefill.observe(tokens, time.perf_counter() - t0)
            self._step = None
        self._no_loads.set()
        parts, self._save_parts = self._save_parts, {}
        failed, self._failed_reqs = self._failed_reqs, set()
        for spec in meta.saves if meta is not None else ():
            if spec.req_id in failed:  # part of its KV is missing; vLLM recomputes it, it is saved another time
                self.saves.mark_ran(spec.req_id)
                continue
            got = parts.get(spec.req_id, {})
            try:
                # a layer whose save_kv_layer was not called is read now
                layers = [got[name] if name in got else self._gather(spec, self.kv_caches[name])
                          for name in self.layer_names]
            except Exception:
                log.warning("saving request %s failed", spec.req_id, exc_info=True)
                self.saves.mark_ran(spec.req_id)
                continue
            nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
            self.saves.submit(spec.req_id, nbytes, lambda spec=spec, layers=layers: self._save(spec, layers))

    def _save(self, spec: SaveSpec, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put ``spec``'s prompt (its KV ``layers``) into the store: on the saves' thread."""
        if spec.segment:
            self._save_segment(spec, layers)
            return
        kv = KVCache(layers, model=self.store.model, token_ids=spec.token_ids, rope="post")
        t0, bytes_before = time.perf_counter(), self.store.stats["put_bytes"]
        saved = self.store.put(spec.token_ids, kv, replicate=False, salt=spec.salt, pace=self._after_loads)
        self.stats["saved_chunks"] += saved
        # one line per prompt that saved something, as a load logs one; a prompt loaded whole saves nothing new,
        # and its load's line says all (issue 35: at most one line per load)
        log.log(logging.INFO if saved else logging.DEBUG, "kvcodec connector: request %s: saved %d new chunk(s) of "
                "tokens 0-%d in %.3f s, %d bytes, variants %s", spec.req_id, saved, len(spec.token_ids),
                time.perf_counter() - t0, self.store.stats["put_bytes"] - bytes_before,
                [c.codec_id for c in self.store.variants])

    def _after_loads(self) -> None:
        """A save's pace: wait while a step's loads run, but not once the saves are closing (the engine or the
        process is ending, and no step may end)."""
        while not self._no_loads.wait(0.1):
            if self.saves.closed:
                return

    def report(self) -> WorkerReport | None:
        """The saves run since the last report and the store's estimates where they changed (for the scheduler
        side), or None when neither has news."""
        ran = self.saves.take_ran()
        estimates = self.store.telemetry.estimates()
        if estimates == self._reported:
            estimates = None
        else:
            self._reported = estimates
        return WorkerReport(dict.fromkeys(ran, 1), estimates) if ran or estimates is not None else None

    def close(self) -> None:
        """Finish the step's loads and write every save queued."""
        try:
            self.finish_loads()
        finally:
            self._no_loads.set()
            self.saves.close()
