"""Segments: the KV of a token run (a retrieved document, a system text) stored apart from any prefix, so that it
can be reused wherever the run sits in a later prompt (:mod:`kvcodec.blend.fusion` puts segments together).

A segment's KV is computed once, after a fixed ``anchor`` (a few token ids, the same for every segment of a
:class:`SegmentStore`) at positions ``len(anchor) .. len(anchor) + n - 1``, and stored through the store's own write
and load path (:meth:`KVStore.put`, :meth:`KVStore.prefix_load`): the same codecs and variant lists, checks, trust
model, bounds and telemetry as prefix chunks.  Only the key differs: its chain is seeded by
:class:`~kvcodec.store.keys.SegmentDomain` (the store's seed, the anchor) and runs over the segment's own tokens,
so the segment is found whatever precedes it in a prompt, and prefix chunks and segments never share a key.

Why an anchor, and why the model's BOS token by default (:func:`default_anchor`): the first token of a sequence
becomes an attention sink (large, atypical keys that most heads attend to).  A document computed at position 0
alone would make its own first token that sink, and every later token's KV would be computed attending to it;
inside a real prompt the sink is the prompt's first token and the document's first token is ordinary.  Computed
after the BOS token that starts every prompt (SmolLM2's ``<|im_start|>``, which opens its chat template), a
segment's tokens see the same sink they will see in the prompt, and a segment placed first after the BOS (a system
text) is stored exactly as a full prefill computes it.  Keys are moved to their positions in the prompt by a
rotation (:func:`kvcodec.positions.reposition`), which RoPE makes exact, so the position a segment was computed at
does not matter beyond the sink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.errors import InvalidInputError
from kvcodec.layouts.sinks import DenseSink
from kvcodec.store.keys import SegmentDomain
from kvcodec.store.load import LoadResult
from kvcodec.store.store import KVStore


def default_anchor(config: Any) -> tuple[int, ...]:
    """The anchor segments of a model are computed after: its BOS token id (``config.bos_token_id``), or none."""
    bos = getattr(config, "bos_token_id", None)
    return () if bos is None else (int(bos),)


@dataclass
class LoadedSegment:
    """What :meth:`SegmentStore.load` found: ``kv`` holds the first ``loaded`` of ``tokens`` tokens (None when
    none loaded), keys after RoPE at the positions the segment was computed at; ``load`` is the store's report."""

    tokens: int
    loaded: int
    kv: KVCache | None
    load: LoadResult


class SegmentStore:
    """Segments of one model in a :class:`KVStore`, computed after ``anchor`` (token ids)."""

    def __init__(self, store: KVStore, anchor: Sequence[int] = ()) -> None:
        if not store.save_partial:
            raise InvalidInputError("segments need a store that saves partial chunks (save_partial=True): a segment "
                                    "ends where its document ends, not on a chunk boundary")
        self.store = store
        self.domain = SegmentDomain(tuple(int(t) for t in anchor))

    @property
    def anchor(self) -> tuple[int, ...]:
        return self.domain.anchor

    def positions(self, num_tokens: int) -> range:
        """The positions a segment of ``num_tokens`` tokens is computed and stored at."""
        return range(len(self.anchor), len(self.anchor) + num_tokens)

    def put(self, token_ids: Sequence[int], kv: KVCache, *, pace: Callable[[], object] | None = None) -> int:
        """Store ``kv``, the segment ``token_ids``'s KV computed after the anchor (keys after RoPE, at
        :meth:`positions`), in the chunks the store lacks; returns the chunks written (``pace``: as
        :meth:`KVStore.put <kvcodec.store.KVStore.put>`'s)."""
        token_ids = _tokens(token_ids)
        if kv.num_tokens != len(token_ids) or any(l.keys.shape[1] != len(token_ids) for l in kv.layers):
            raise InvalidInputError(f"the segment has {len(token_ids)} tokens and every layer of its KV must hold "
                                    f"them all, not {[l.keys.shape[1] for l in kv.layers]}")
        if kv.rope != "post":
            raise InvalidInputError(f"a segment's KV has keys after RoPE (rope='post'), not rope={kv.rope!r}")
        where = list(self.positions(len(token_ids)))
        if kv.positions is not None and kv.positions != where:
            raise InvalidInputError(f"a segment's KV is computed at positions {where[0]}..{where[-1]} (after the "
                                    f"{len(self.anchor)}-token anchor), not at {kv.positions[0]}..{kv.positions[-1]}")
        kv = KVCache(kv.layers, model=kv.model, rope="post", positions=where)
        return self.store.put(token_ids, kv, salt=self.domain, pace=pace)

    def stored_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of segment ``token_ids`` are stored (in any variant)."""
        return self.store.lookup(_tokens(token_ids), salt=self.domain).num_tokens

    def load(self, token_ids: Sequence[int], *, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None, recompute_tps: float | None = None) -> LoadedSegment:
        """Load segment ``token_ids`` through the store's load path: its stored chunks up to the first missing or
        bad one (a bad one is evicted), decoded; with ``recompute_tps`` (the engine's prefill speed, tokens/s),
        also up to where the engine recomputing the rest would be sooner than loading it."""
        token_ids = _tokens(token_ids)
        sink = DenseSink(device=device, dtype=dtype)
        result = self.store.prefix_load(token_ids, sink, salt=self.domain, device=device,
                                        recompute_tps=recompute_tps).start().finish()
        n = result.loaded_end
        kv = None
        if n:  # a layer may hold more: a chunk that failed after some of its layers were written
            kv = KVCache([(l.keys[:, :n], l.values[:, :n]) for l in sink.cache().layers], model=self.store.model,
                         rope="post", positions=self.positions(n))
        return LoadedSegment(len(token_ids), n, kv, result)

    def load_estimates(self, segments: Sequence[Sequence[int]]) -> list[float | None]:
        """The seconds the store estimates loading each of ``segments`` takes (:meth:`KVStore.load_estimates`;
        None where none of it is stored)."""
        return self.store.load_estimates([_tokens(s) for s in segments], salt=self.domain)

    def evict(self, token_ids: Sequence[int]) -> int:
        """Delete segment ``token_ids``'s chunks from every tier; returns deletions."""
        return self.store.evict(_tokens(token_ids), salt=self.domain)


def _tokens(token_ids: Sequence[int]) -> list[int]:
    ids = [int(t) for t in token_ids]
    if not ids:
        raise InvalidInputError("a segment holds at least one token")
    return ids
