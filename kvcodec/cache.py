"""The KV data model: an ordered list of layers, each a keys and a values tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from kvcodec.errors import InvalidInputError
from kvcodec.formats.v1 import DTYPES, ROPE_STATES, LayerShape
from kvcodec.layouts import dump, hf, lmcache, paged

if TYPE_CHECKING:
    from os import PathLike

SUPPORTED_DTYPES = {getattr(torch, name): name for name in DTYPES}


@dataclass(repr=False)
class KVLayer:
    """One layer: ``keys`` is ``[heads, tokens, key_dim]``, ``values`` is ``[heads, tokens, value_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def shape(self) -> LayerShape:
        h, t, dk = self.keys.shape
        return LayerShape(h, t, dk, self.values.shape[2])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.keys, self.values))

    def __repr__(self) -> str:
        s = self.shape
        dtype = SUPPORTED_DTYPES.get(self.keys.dtype, str(self.keys.dtype))
        return (f"KVLayer(heads={s.heads}, tokens={s.tokens}, key_dim={s.key_dim}, value_dim={s.value_dim}, "
                f"dtype={dtype}, device={self.keys.device})")


class KVCache:
    """A model's KV cache for one sequence.

    Layers are ordered; every tensor is ``[num_kv_heads, tokens, head_dim]`` and all
    share one dtype (float32, float16 or bfloat16) and device.  Token counts may
    differ between layers: a layer with fewer tokens (a sliding window) holds the
    last tokens of the sequence.  Head counts and head sizes may differ too.

    Metadata is optional: ``model`` (an id), ``token_ids`` (the prompt the cache
    was computed from), ``rope`` (``"pre"`` or ``"post"``: whether keys are stored
    before or after the rotary embedding) and ``positions`` (the position id of
    each token of the longest layer).
    """

    def __init__(
        self,
        layers: Sequence[KVLayer | tuple[torch.Tensor, torch.Tensor]],
        *,
        model: str | None = None,
        token_ids: Sequence[int] | None = None,
        rope: str | None = None,
        positions: Sequence[int] | None = None,
    ) -> None:
        self.layers: list[KVLayer] = [l if isinstance(l, KVLayer) else KVLayer(*l) for l in layers]
        self.model = model
        self.token_ids = None if token_ids is None else [int(t) for t in token_ids]
        self.rope = rope
        self.positions = None if positions is None else [int(p) for p in positions]
        self._validate()

    @classmethod
    def from_tensors(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], **meta: Any) -> KVCache:
        """Build from parallel lists of per-layer key and value tensors."""
        if len(keys) != len(values):
            raise InvalidInputError(f"{len(keys)} key tensors but {len(values)} value tensors")
        return cls(list(zip(keys, values)), **meta)

    def _validate(self) -> None:
        if not self.layers:
            raise InvalidInputError("a KVCache needs at least one layer")
        if not all(isinstance(t, torch.Tensor) for layer in self.layers for t in layer):
            raise InvalidInputError("keys and values must be torch tensors")
        dtype, device = self.layers[0].keys.dtype, self.layers[0].keys.device
        if dtype not in SUPPORTED_DTYPES:
            raise InvalidInputError(f"dtype {dtype} is not supported; use one of {list(DTYPES)}")
        for i, layer in enumerate(self.layers):
            k, v = layer.keys, layer.values
            if k.dim() != 3 or v.dim() != 3:
                raise InvalidInputError(f"layer {i}: tensors must be [heads, tokens, head_dim], got {tuple(k.shape)} and {tuple(v.shape)}")
            if k.shape[:2] != v.shape[:2]:
                raise InvalidInputError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} differ in heads or tokens")
            if k.shape[0] == 0 or k.shape[2] == 0 or v.shape[2] == 0:
                raise InvalidInputError(f"layer {i}: heads and head_dim must be positive")
            if k.dtype != dtype or v.dtype != dtype:
                raise InvalidInputError(f"layer {i}: all tensors must share dtype {dtype}")
            if k.device != device or v.device != device:
                raise InvalidInputError(f"layer {i}: all tensors must be on device {device}")
        if self.rope not in (None, *ROPE_STATES):
            raise InvalidInputError(f"rope must be None, 'pre' or 'post', not {self.rope!r}")
        for name in ("token_ids", "positions"):
            seq = getattr(self, name)
            if seq is not None and len(seq) != self.num_tokens:
                raise InvalidInputError(f"{len(seq)} {name} for {self.num_tokens} tokens")

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].keys.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].keys.device

    @property
    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(keys, values)`` of every layer."""
        return [(l.keys, l.values) for l in self.layers]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        """Tokens of the longest layer (the sequence length)."""
        return max(l.keys.shape[1] for l in self.layers)

    @property
    def shapes(self) -> list[LayerShape]:
        return [l.shape for l in self.layers]

    @property
    def num_elements(self) -> int:
        return sum(s.elements for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.num_elements * self.dtype.itemsize

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata that is set, as stored in a container header."""
        items = {"model": self.model, "token_ids": self.token_ids, "rope": self.rope, "positions": self.positions}
        return {k: v for k, v in items.items() if v is not None}

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A copy on another device and/or in another dtype, metadata kept."""
        return KVCache([(l.keys.to(device=device, dtype=dtype), l.values.to(device=device, dtype=dtype)) for l in self.layers],
                       **self.meta)

    def equal(self, other: KVCache) -> bool:
        """True when shapes, dtype and every bit of every tensor are identical (NaNs compare by bits)."""
        if self.shapes != other.shapes or self.dtype != other.dtype:
            return False
        return all(same_bits(a, b) for x, y in zip(self.layers, other.layers) for a, b in zip(x, y))

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, tokens={self.num_tokens}, dtype={SUPPORTED_DTYPES[self.dtype]}, "
                f"heads={self.layers[0].keys.shape[0]}, head_dim={self.layers[0].keys.shape[2]}, model={self.model!r})")

    # Conversions live in kvcodec.layouts, which deal in tensors only; these methods are the discoverable entry
    # points and make the caches.

    @classmethod
    def from_hf(cls, cache: Any, *, batch_index: int = 0, **meta: Any) -> KVCache:
        """From a transformers ``DynamicCache`` (``cache.layers[i].keys``, ``[B, H, T, D]``)."""
        return cls(hf.hf_pairs(cache, batch_index=batch_index), **meta)

    def to_hf(self, config: Any = None) -> Any:
        """To a transformers ``DynamicCache`` with batch size 1."""
        return hf.to_hf(self.pairs, self.num_tokens, config=config)

    def save_safetensors(self, path: str | PathLike[str]) -> None:
        """Write a safetensors dump: ``layers.{i}.keys``, ``layers.{i}.values`` and string metadata."""
        dump.save_safetensors(self.pairs, self.meta, path)

    @classmethod
    def load_safetensors(cls, path: str | PathLike[str]) -> KVCache:
        """Read a dump written by :meth:`save_safetensors`."""
        layers, meta = dump.read_safetensors(path)
        return cls(layers, **meta)

    def to_paged(self, block_size: int = 16, num_blocks: int | None = None,
                 layout: Any = "flash") -> tuple[list[torch.Tensor], torch.Tensor]:
        """To vLLM's paged layout (``"flash"``: per layer ``(2, num_blocks, block_size, H, D)``; ``"cpu"``: its CPU
        backend's, see :class:`kvcodec.layouts.paged.PagedLayout`) plus a block table."""
        return paged.to_paged(self.pairs, block_size=block_size, num_blocks=num_blocks, layout=layout)

    @classmethod
    def from_paged(cls, kv_caches: Sequence[torch.Tensor], block_table: torch.Tensor, num_tokens: int,
                   layout: Any = "flash", **meta: Any) -> KVCache:
        """From vLLM's paged layout (``"flash"`` or ``"cpu"``) and the block table of one sequence."""
        return cls(paged.paged_pairs(kv_caches, block_table, num_tokens, layout), **meta)

    def to_lmcache(self) -> torch.Tensor:
        """To LMCache's chunk layout ``[2, L, T, H*D]``."""
        return lmcache.to_lmcache(self.pairs)

    @classmethod
    def from_lmcache(cls, chunk: torch.Tensor, num_heads: int, **meta: Any) -> KVCache:
        """From LMCache's chunk layout ``[2, L, T, H*D]``."""
        return cls(lmcache.lmcache_pairs(chunk, num_heads), **meta)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    return bool(torch.equal(a.contiguous().view(int_type).cpu(), b.contiguous().view(int_type).cpu()))
