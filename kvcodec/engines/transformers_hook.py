"""A transformers hook: save prompt KV through a :class:`~kvcodec.store.KVStore`, and continue later
requests that share the prefix from the store, decoding layer by layer while the model runs.

>>> hook = TransformersKVHook(load_model("smollm2"), store)
>>> out = hook.generate(prompt_ids, max_new_tokens=32)   # prefill, saves the prompt's KV
>>> out = hook.generate(prompt_ids + more, max_new_tokens=32)  # loads the shared prefix, prefills only the rest

How the overlap works: :class:`LayerwiseLoader` fetches the prefix's chunks (bytes, checksums
verified, nothing decoded) and ``start_load()`` starts a thread that decodes layer 0 of every
chunk, then layer 1, and so on.  :class:`StreamedCache` is a transformers ``DynamicCache`` whose
layer ``i`` calls ``wait_for_layer(i)`` the first time the model writes to it, so the model runs
layer ``i`` while later layers are still being decoded.  A load that fails (a chunk that does not
decode) raises :class:`LoadError` inside the forward; :meth:`TransformersKVHook.generate` then
evicts the prefix and recomputes it, so no store fault reaches the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvcodec.errors import CorruptDataError, KVCodecError
from kvcodec.engines.auto_calibration import ensure_model_calibration, wants_calibration
from kvcodec.reader import Reader, iter_chunk_layers
from kvcodec.store import FetchedChunk, KVStore, StorageTier

log = logging.getLogger(__name__)


class LoadError(KVCodecError):
    """A stored prefix could not be decoded; the caller recomputes it."""


class LayerwiseLoader:
    """Decodes the first ``num_tokens`` tokens of fetched chunks, one layer at a time, in a background thread.

    ``max_bytes(tokens)`` bounds each chunk's decode (a store's :meth:`~kvcodec.store.KVStore.max_bytes`); chunks
    must agree in their layers' shapes and dtype.  A chunk that does not open ends the prefix before it;
    :attr:`failed` names the chunk that failed to open or decode, and why."""

    def __init__(self, chunks: Sequence[FetchedChunk], num_tokens: int | None = None, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 max_bytes: Callable[[int], int | None] = lambda tokens: None) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.failed: tuple[FetchedChunk, BaseException] | None = None
        self.readers: list[Reader] = []
        for c in chunks:
            try:
                r = Reader(c.data, max_bytes(c.end - c.start))
            except Exception as e:
                self.failed = (c, e)
                break
            first = (self.readers[0] if self.readers else r).header
            if [(s.heads, s.key_dim, s.value_dim) for s in first.layers] != \
                    [(s.heads, s.key_dim, s.value_dim) for s in r.header.layers] or first.dtype != r.header.dtype:
                r.close()
                self.failed = (c, CorruptDataError(f"chunk {c.key} holds layers of other shapes or dtype than the first"))
                break
            self.readers.append(r)
        self.chunks = list(chunks)[: len(self.readers)]
        total = sum(c.end - c.start for c in self.chunks)
        self.num_tokens = total if num_tokens is None else min(num_tokens, total)
        self.num_layers = len(self.readers[0].header.layers) if self.readers else 0
        self._done = [threading.Event() for _ in range(self.num_layers)]
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.layer_ready_s: list[float] = [0.0] * self.num_layers
        self._t0 = 0.0

    def start_load(self) -> LayerwiseLoader:
        if self._thread is None:
            self._t0 = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="kvcodec-layer-loader", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            sources = [iter_chunk_layers(r, 0, device=self.device) for r in self.readers]
            for i in range(self.num_layers):
                ks, vs = [], []
                for chunk, source in zip(self.chunks, sources):
                    try:
                        layer = next(source)
                    except Exception as e:
                        self.failed = (chunk, e)
                        raise
                    ks.append(layer.keys)
                    vs.append(layer.values)
                k = torch.cat(ks, 1)[:, : self.num_tokens]
                v = torch.cat(vs, 1)[:, : self.num_tokens]
                if self.dtype is not None:
                    k, v = k.to(self.dtype), v.to(self.dtype)
                self._layers[i] = (k, v)
                self.layer_ready_s[i] = time.perf_counter() - self._t0
                self._done[i].set()
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits
            self._error = e
            for ev in self._done:
                ev.set()
        finally:
            for r in self.readers:
                r.close()

    def wait_for_layer(self, i: int, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[H, num_tokens, D]`` of layer ``i``, once decoded."""
        self.start_load()
        if not self._done[i].wait(timeout):
            raise LoadError(f"layer {i} was not decoded within {timeout} s")
        got = self._layers[i]
        if got is None:
            raise LoadError(f"decoding layer {i} of the stored prefix failed: {self._error}") from self._error
        return got

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def _streamed_layer_class():
    from transformers.cache_utils import DynamicLayer

    class StreamedLayer(DynamicLayer):
        """A full-attention layer whose stored prefix arrives from a :class:`LayerwiseLoader`."""

        supports_early_init = False

        def __init__(self, loader: LayerwiseLoader, index: int) -> None:
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


def streamed_cache(loader: LayerwiseLoader, config: Any = None) -> Any:
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


class TransformersKVHook:
    """Runs a transformers causal LM (or a :class:`kvcodec.tools.models.LoadedModel`) with a KV store.

    ``save``: after each prefill the prompt's KV is put into the store (in the store's
    codec; ``save_dtype`` converts first, None keeps the model's dtype).
    """

    def __init__(self, model: Any, store: KVStore, *, save: bool = True, save_dtype: torch.dtype | None = None) -> None:
        self.model = getattr(model, "model", model)
        self.store, self.save, self.save_dtype = store, save, save_dtype

    @classmethod
    def with_store(cls, model: Any, tiers: Sequence[StorageTier], *, codec: str = "cachegen",
                   codec_options: dict[str, Any] | None = None, calibration_options: dict[str, Any] | None = None,
                   save: bool = True, save_dtype: torch.dtype | None = None, **store_options: Any) -> TransformersKVHook:
        """A hook over a new :class:`KVStore` on ``tiers`` for ``model`` (a :class:`kvcodec.tools.models.LoadedModel`),
        keyed by its ``model_id``; ``store_options`` as for :class:`KVStore`.  With ``codec="kvtc"`` and its
        calibration left ``"auto"``, a model with no calibration installed is calibrated now, once
        (``calibration_options`` for :func:`kvcodec.tools.kvtc_calibration.calibrate`), and the log says so."""
        if wants_calibration(codec, codec_options):
            ensure_model_calibration(model.model_id, lambda: model, log.info, calibration_options)
        store = KVStore(tiers, model=model.model_id, codec=codec, codec_options=codec_options, **store_options)
        return cls(model, store, save=save, save_dtype=save_dtype)

    def load(self, token_ids: Sequence[int]) -> tuple[LayerwiseLoader | None, list[str]]:
        """Look up the stored prefix of ``token_ids`` and start decoding it (leaving at least one
        token for the model to read, so that it has logits to continue from)."""
        try:
            chunks = self.store.fetch(token_ids)
        except Exception:  # no store fault reaches the engine
            log.warning("store fetch failed; recomputing", exc_info=True)
            return None, []
        n = min(sum(c.end - c.start for c in chunks), len(token_ids) - 1)
        if n <= 0:
            return None, []
        loader = LayerwiseLoader(chunks, n, device=self.model.device, dtype=self.model.dtype,
                                 max_bytes=self.store.max_bytes)
        if loader.failed is not None:
            self.store.discard(*loader.failed)
        if loader.num_tokens <= 0:
            return None, []
        return loader.start_load(), [c.tier for c in loader.chunks]

    @torch.no_grad()
    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 32) -> Generation:
        """Greedy generation of ``max_new_tokens`` after ``token_ids``, reusing stored prefix KV."""
        from transformers import DynamicCache

        token_ids = [int(t) for t in token_ids]
        t0 = time.perf_counter()
        loader, where = self.load(token_ids)
        recomputed = False
        cache, logits, n = None, None, 0
        if loader is not None:
            n = loader.num_tokens
            try:
                cache = streamed_cache(loader, self.model.config)
                logits = self._forward(token_ids[n:], cache)
            except LoadError:
                log.warning("loading the stored prefix failed; recomputing", exc_info=True)
                if loader.failed is not None:  # evicted only when the chunk itself is bad
                    self.store.discard(*loader.failed)
                cache, n, where, recomputed = None, 0, [], True
        if cache is None:
            cache = DynamicCache(config=self.model.config)
            logits = self._forward(token_ids, cache)
        first = time.perf_counter() - t0
        saved = self._save(token_ids, cache) if self.save else 0
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens:
            logits = self._forward([out[-1]], cache)
            out.append(int(logits[-1].argmax()))
        return Generation(out, len(token_ids), n, where, first, recomputed, saved)

    def _forward(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        out = self.model(torch.tensor([list(ids)], device=self.model.device), cache=cache, use_cache=True)
        return out.logits[0]

    def _save(self, token_ids: list[int], cache: Any) -> int:
        from kvcodec.cache import KVCache

        try:
            kv = KVCache.from_hf(cache, model=self.store.model, token_ids=token_ids, rope="post")
            if self.save_dtype is not None:
                kv = kv.to(dtype=self.save_dtype)
            return self.store.put(token_ids, kv)
        except Exception:
            log.warning("saving the prompt's KV failed", exc_info=True)
            return 0
