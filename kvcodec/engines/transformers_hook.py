"""A transformers hook: save prompt KV through a :class:`~kvcodec.store.KVStore`, and continue later
requests that share the prefix from the store, decoding layer by layer while the model runs.

>>> hook = TransformersKVHook.with_store(load_model("smollm2"), ["cpu"], codec="cachegen")
>>> out = hook.generate(prompt_ids, max_new_tokens=32)   # prefill, saves the prompt's KV
>>> out = hook.generate(prompt_ids + more, max_new_tokens=32)  # loads the shared prefix, prefills only the rest

The store serves only chunks of the model's own shape (:func:`model_shape`: its layers, KV heads, head size and
the dtype the hook saves in): a value declaring any other shape is refused before anything is decoded, and
evicted.  A request is its token ids and nothing else (the hook takes no embeddings or other inputs), so the
token ids, the model identity and the store's namespace are all its KV depends on.

How the overlap works: :class:`StreamedPrefix` loads the prefix through the store's one load path
(:meth:`KVStore.prefix_load`: chunk ``i+1`` is fetched while chunk ``i`` decodes, layer by layer) into dense
tensors, and :func:`streamed_cache` is a transformers ``DynamicCache`` whose layer ``i`` waits for layer ``i`` of
the prefix the first time the model writes to it, so the model runs layer ``i`` while later layers are still
decoding.  A load that ends short raises :class:`LoadError` inside the forward: a chunk missing or not decoding
(the load evicted a chunk that was itself bad), or the load's planner stopping where recomputing the rest is
sooner than loading it (the hook measures its model's prefill speed on requests it computes in full).
:meth:`TransformersKVHook.generate` then continues from the tokens that did load and recomputes the rest, so no
store fault reaches the caller.

Segments (documents reused wherever they sit in a prompt, :mod:`kvcodec.blend`): :meth:`TransformersKVHook.put_segments`
stores them, :meth:`TransformersKVHook.fuse` puts a prompt of them together (:mod:`kvcodec.engines.transformers_fusion`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvcodec.engines.store_setup import open_store, time_decodes
from kvcodec.errors import InvalidInputError, KVCodecError
from kvcodec.store import ChunkShape, DenseSink, KVStore, LoadResult, StorageTier
from kvcodec.store.config import StoreConfig
from kvcodec.store.identity import CacheIdentity, model_identity

log = logging.getLogger(__name__)


class LoadError(KVCodecError):
    """A stored prefix could not be decoded; the caller recomputes it."""


class StreamedPrefix:
    """The first ``num_tokens`` tokens of a stored prefix, loading into dense tensors in the background
    (:meth:`KVStore.prefix_load`) while the model runs: what each layer of :func:`streamed_cache` waits for.
    ``num_layers`` is the model's; ``recompute_tps`` its prefill speed, against which the load's planner weighs
    loading the rest (None: unknown, load it all)."""

    def __init__(self, store: KVStore, token_ids: Sequence[int], num_tokens: int, num_layers: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 recompute_tps: float | None = None) -> None:
        self.num_tokens, self.num_layers = num_tokens, num_layers
        self.sink = DenseSink(device=device, dtype=dtype)
        self.load = store.prefix_load(token_ids, self.sink, end=num_tokens, device=device,
                                      recompute_tps=recompute_tps)

    def start_load(self) -> StreamedPrefix:
        self.load.start()
        return self

    def wait_for_layer(self, i: int, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[H, num_tokens, D]`` of layer ``i``, once loaded."""
        if not self.load.wait_layer(i, timeout):
            failed = next((c for c in self.load.chunks if c.status != "loaded"), None)
            raise LoadError(f"layer {i} of the stored prefix did not load"
                            + (f": chunk {failed.key} is {failed.status} ({failed.error})" if failed else ""))
        return self.sink.layer(i)

    def finish(self) -> LoadResult:
        return self.load.finish()

    def loaded_cache(self, config: Any) -> tuple[Any, int]:
        """After the load: a transformers ``DynamicCache`` holding the tokens that loaded (every chunk before the
        first that did not), and their count."""
        from transformers import DynamicCache

        n = self.finish().loaded_end
        cache = DynamicCache(config=config)
        for i in range(self.num_layers if n else 0):
            k, v = self.sink.layer(i)
            cache.update(k[None, :, :n], v[None, :, :n], i)
        return cache, n


def _streamed_layer_class():
    from transformers.cache_utils import DynamicLayer

    class StreamedLayer(DynamicLayer):
        """A full-attention layer whose stored prefix arrives from a :class:`StreamedPrefix`."""

        supports_early_init = False

        def __init__(self, loader: StreamedPrefix, index: int) -> None:
            super().__init__()
            self.loader, self.index = loader, index

        def _load(self, like: torch.Tensor) -> None:
            k, v = self.loader.wait_for_layer(self.index)
            self.device = like.device
            self.keys = k.unsqueeze(0).to(device=like.device, dtype=like.dtype)
            self.values = v.unsqueeze(0).to(device=like.device, dtype=like.dtype)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self._load(key_states)
            return super().update(key_states, value_states, *args, **kwargs)

        def get_seq_length(self) -> int:
            return self.loader.num_tokens if not self.is_initialized else super().get_seq_length()

    return StreamedLayer


def streamed_cache(loader: StreamedPrefix, config: Any = None) -> Any:
    """A transformers ``DynamicCache`` whose layers wait for ``loader`` the first time the model uses them."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    layer_cls = _streamed_layer_class()
    if len(cache.layers) == 0:
        cache.layers = [layer_cls(loader, i) for i in range(loader.num_layers)]
    else:
        if len(cache.layers) != loader.num_layers:
            raise LoadError(f"the model has {len(cache.layers)} layers, the stored prefix {loader.num_layers}")
        if any(getattr(l, "is_sliding", False) for l in cache.layers):
            raise LoadError("sliding-window layers cannot continue from a stored prefix")
        cache.layers = [layer_cls(loader, i) for i in range(loader.num_layers)]
    return cache


@dataclass
class Generation:
    """What :meth:`TransformersKVHook.generate` did."""

    tokens: list[int]
    prompt_tokens: int
    loaded_tokens: int  # prompt tokens that came from the store
    where: list[str] = field(default_factory=list)
    first_token_s: float = 0.0
    recomputed: bool = False
    saved_chunks: int = 0
    load: LoadResult | None = None  # the stored prefix's load, chunk by chunk


def model_shape(model: Any, dtype: torch.dtype | None = None) -> ChunkShape:
    """What ``model`` (a transformers causal LM) holds per token: its layers of KV heads, keys and values of its
    head size, in ``dtype`` (None: the model's)."""
    config = getattr(model, "config", None)
    try:
        heads = config.num_key_value_heads or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
    except AttributeError as err:
        raise InvalidInputError(f"{type(model).__name__} has no decoder configuration to size its KV by: {err}") from None
    return ChunkShape(layers, heads, dim, dim, str(dtype or model.dtype).removeprefix("torch."))


class TransformersKVHook:
    """Runs a transformers causal LM (or a :class:`kvcodec.models.LoadedModel`) with a KV store.

    ``save``: after each prefill the prompt's KV is put into the store (in the store's codec; ``save_dtype``
    converts first, None keeps the model's dtype).  The store serves only chunks of :func:`model_shape` (the model
    and ``save_dtype``): a store made without a shape is given it here, one made for another shape is refused.
    """

    def __init__(self, model: Any, store: KVStore, *, save: bool = True, save_dtype: torch.dtype | None = None) -> None:
        self.model = getattr(model, "model", model)
        shape = model_shape(self.model, save_dtype)
        if store.shape is None:
            store.shape = shape
            time_decodes(store, log.info)
        elif store.shape != shape:
            raise InvalidInputError(f"the store serves chunks of {store.shape}; this model saves {shape}")
        self.store, self.save, self.save_dtype = store, save, save_dtype
        self.prefill_tps: float | None = None  # the model's prefill speed, from the last prompt computed in full
        self._segments: Any = None

    @classmethod
    def with_store(cls, model: Any, tiers: Sequence[str | StorageTier] = ("cpu",), *, model_path: str | None = None,
                   save: bool = True, save_dtype: torch.dtype | None = None, **settings: Any) -> TransformersKVHook:
        """A hook over a new store for ``model`` (a :class:`kvcodec.models.LoadedModel`, keyed by its ``model_id``).

        ``tiers``: tier URLs fastest first (or tiers already made); ``settings``: any other field of
        :class:`~kvcodec.store.config.StoreConfig` (``codec``, ``codec_options``, ``chunk_tokens``, ``namespace``,
        ``secret_file``, ``calibrate``, ...).  The keys and kvtc's calibration are bound to the model identity
        (:func:`~kvcodec.store.identity.model_identity`) of ``model_path``, the folder or weight file it was loaded
        from (None: the folder transformers records).  Unless ``calibrate="background"`` is given, a codec made
        from the model (kvtc) with no calibration of it installed is calibrated now, once, and the log says so."""
        made = [t for t in tiers if not isinstance(t, str)]
        if made and len(made) != len(tiers):
            raise InvalidInputError("'tiers' are all tier URLs or all tiers, not a mix")
        settings.setdefault("calibrate", "now")
        config, _ = StoreConfig.parse({**settings, **({} if made else {"tiers": list(tiers)})},
                                      where="TransformersKVHook.with_store")
        lm = getattr(model, "model", model)
        path = model_path or getattr(lm.config, "_name_or_path", "") or ""
        if not path:
            raise InvalidInputError("the model records no folder it was loaded from: give model_path (its folder or "
                                    "weight file), whose identity keys its caches")
        dtype = save_dtype or lm.dtype
        identity = CacheIdentity(model_digest=model_identity(os.fspath(path)),
                                 kv_dtype=str(dtype).removeprefix("torch."))
        store = open_store(config, model=model.model_id, identity=identity, log=log.info, load_model=lambda: model,
                           shape=model_shape(lm, save_dtype), tiers=made or None, hf_config=lm.config)
        return cls(model, store, save=save, save_dtype=save_dtype)

    def load(self, token_ids: Sequence[int]) -> tuple[StreamedPrefix | None, list[str]]:
        """Look up the stored prefix of ``token_ids`` and start loading it (leaving at least one token for the
        model to read, so that it has logits to continue from)."""
        try:
            found = self.store.lookup(token_ids)
        except Exception:  # no store fault reaches the engine
            log.warning("store lookup failed; recomputing", exc_info=True)
            return None, []
        n = min(found.num_tokens, len(token_ids) - 1)
        if n <= 0:
            return None, []
        prefix = StreamedPrefix(self.store, token_ids, n, self.model.config.num_hidden_layers,
                                device=self.model.device, dtype=self.model.dtype, recompute_tps=self.prefill_tps)
        return prefix.start_load(), found.where

    @torch.no_grad()
    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 32) -> Generation:
        """Greedy generation of ``max_new_tokens`` after ``token_ids``, reusing stored prefix KV."""
        from transformers import DynamicCache

        token_ids = [int(t) for t in token_ids]
        t0 = time.perf_counter()
        loader, where = self.load(token_ids)
        recomputed = False
        cache, logits, n, load = None, None, 0, None
        if loader is not None:
            n = loader.num_tokens
            try:
                cache = streamed_cache(loader, self.model.config)
                logits = self._forward(token_ids[n:], cache)
            except LoadError as err:  # a bad chunk was evicted by the load; a fault of this machine left it stored
                cache, n = loader.loaded_cache(self.model.config)
                log.info("stored prefix loaded to token %d; recomputing the rest (%s)", n, err)
                if n:
                    logits = self._forward(token_ids[n:], cache)
                else:
                    cache, where, recomputed = None, [], True
            load = loader.finish()
        if cache is None:
            cache = DynamicCache(config=self.model.config)
            t1 = time.perf_counter()
            logits = self._forward(token_ids, cache)
            self.prefill_tps = len(token_ids) / (time.perf_counter() - t1)
        first = time.perf_counter() - t0
        saved = self._save(token_ids, cache) if self.save else 0
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens:
            logits = self._forward([out[-1]], cache)
            out.append(int(logits[-1].argmax()))
        return Generation(out, len(token_ids), n, where, first, recomputed, saved, load)

    def _forward(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        out = self.model(torch.tensor([list(ids)], device=self.model.device), cache=cache, use_cache=True)
        return out.logits[0]

    def _save(self, token_ids: list[int], cache: Any) -> int:
        from kvcodec.cache import KVCache

        try:
            if self.store.lookup(token_ids).in_every_variant >= self.store.put_end(len(token_ids)):
                return 0  # stored whole: copying the prompt's KV out of the cache would write nothing
            kv = KVCache.from_hf(cache, model=self.store.model, token_ids=token_ids, rope="post")
            if self.save_dtype is not None:
                kv = kv.to(dtype=self.save_dtype)
            return self.store.put(token_ids, kv)
        except Exception:
            log.warning("saving the prompt's KV failed", exc_info=True)
            return 0

    # segments ----------------------------------------------------------------------------------
    @property
    def segments(self) -> Any:
        """The :class:`~kvcodec.blend.segments.SegmentStore` over this hook's store, anchored at the model's BOS
        token (:func:`~kvcodec.blend.segments.default_anchor`)."""
        from kvcodec.blend.segments import SegmentStore, default_anchor

        if self._segments is None:
            self._segments = SegmentStore(self.store, default_anchor(self.model.config))
        return self._segments

    def put_segments(self, segments: Sequence[Sequence[int]]) -> int:
        """Compute and store each of ``segments`` (token id lists) not stored whole yet; returns the chunks
        written."""
        from kvcodec.engines.transformers_fusion import segment_kv

        written = 0
        for seg in segments:
            if self.segments.stored_tokens(seg) < len(seg):
                t0 = time.perf_counter()
                kv = segment_kv(self.model, self.segments.anchor, seg, model_id=self.store.model,
                                dtype=self.save_dtype)
                if self.prefill_tps is None:  # a first estimate; a fusion's own first layers replace it
                    self.prefill_tps = (len(self.segments.anchor) + len(seg)) / (time.perf_counter() - t0)
                written += self.segments.put(seg, kv)
        return written

    def fuse(self, segments: Sequence[Sequence[int]], suffix: Sequence[int], *, share: float | None = None) -> Any:
        """The prompt ``anchor + segments + suffix`` with the segments' stored KV fused and ``share`` of their
        tokens recomputed (default None: the loading controller's, :func:`~kvcodec.blend.fusion.controlled_share`):
        a :class:`~kvcodec.engines.transformers_fusion.Fusion` (logits over the suffix, the prompt's cache, a
        report).  Segments not stored are computed in full, and the report says so; so is the rest of a segment
        whose load stops where computing it is sooner (at :attr:`prefill_tps`, measured on this hook's own
        prefills, segments and fusions)."""
        from kvcodec.blend.fusion import RecomputeSchedule
        from kvcodec.engines.transformers_fusion import fuse

        schedule = RecomputeSchedule(share)
        fused = fuse(self.model, self.segments, segments, suffix, schedule=schedule, shape=self.store.shape,
                     recompute_tps=self.prefill_tps)
        if fused.token_layer_s:  # the whole context through the first layers: the prefill speed at this length
            self.prefill_tps = 1.0 / (fused.token_layer_s * self.model.config.num_hidden_layers)
        return fused
