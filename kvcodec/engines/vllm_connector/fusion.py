"""Segment fusion in vLLM's worker: a prompt's stored segments fused, with selective recompute, straight into the
request's paged blocks (the model-generic half is :mod:`kvcodec.blend.fusion`).

:func:`fuse_into_blocks` loads the segments (:class:`~kvcodec.blend.fusion.SegmentLoads`), has
:func:`kvcodec.blend.fusion.recompute` run the selected tokens through vLLM's own decoder layers (its embedding,
norms, QKV projection, rotary embedding, output projection and MLP: each layer's ``forward``), and writes the fused
context into the blocks.  Only each layer's ``Attention`` module is stood in for while it runs
(:class:`_FusedAttention`): vLLM's reads the step's attention metadata and paged memory, while a selection attends to
the fused context, which lives in dense tensors until it is written.  vLLM then computes the rest of the prompt
(the question) over those blocks as over any loaded prefix.

Supported: Llama's architecture (SmolLM2), every layer full attention with a neox-style rotary embedding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from kvcodec.blend.fusion import (FusionReport, RecomputeSchedule, SegmentLoads, query_blocks, recompute,
                                  token_changes)
from kvcodec.blend.segments import SegmentStore
from kvcodec.errors import UnsupportedError
from kvcodec.layouts.sinks import PagedSink
from kvcodec.positions import Rotary

# vLLM model classes whose decoder layers this runner has been checked against (share 1 gives vLLM's own prefill:
# tests/engines/test_vllm_segments.py).
SUPPORTED_MODEL_TYPES = ("llama",)
# rotary embeddings whose cos/sin are the plain rotation kvcodec.positions.Rotary moves keys by
PLAIN_ROTARY = ("RotaryEmbedding", "Llama3RotaryEmbedding")


def check_supported(model: Any) -> None:
    """Raise :class:`UnsupportedError` for a vLLM model :func:`fuse_into_blocks` cannot run correctly."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(f"segment fusion in vLLM runs on {', '.join(SUPPORTED_MODEL_TYPES)} models; this is "
                               f"a {kind!r} model")
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("qkv_proj", "rotary_emb", "attn", "o_proj")):
            raise UnsupportedError(f"segment fusion does not know vLLM's {type(layer).__name__} layers")
        if getattr(attn.attn, "sliding_window", None) is not None:
            raise UnsupportedError("segment fusion does not handle sliding-window layers yet")
        emb = attn.rotary_emb
        if type(emb).__name__ not in PLAIN_ROTARY or not getattr(emb, "is_neox_style", False):
            raise UnsupportedError(f"segment fusion moves keys by a plain neox-style rotation, not vLLM's "
                                   f"{type(emb).__name__}")


def model_rotary(model: Any) -> list[Rotary]:
    """Each layer's rotary setting, as vLLM's rotary embedding computes its angles."""
    out = []
    for layer in model.model.layers:
        emb = layer.self_attn.rotary_emb
        out.append(Rotary(emb._compute_inv_freq(emb.base).detach().double().cpu().numpy()))
    return out


class _FusedAttention(torch.nn.Module):
    """Stands in for one layer's vLLM ``Attention`` (same call: flattened ``q``, ``k``, ``v`` of the selected
    tokens) while the runner computes that layer."""

    def __init__(self, runner: _Runner, index: int, measure: bool) -> None:
        super().__init__()
        self.runner, self.index, self.measure = runner, index, measure

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return self.runner.attend(self.index, self.measure, query, key, value)


class _Runner:
    """vLLM's decoder layers over a selection of the fused context (a :class:`~kvcodec.blend.fusion.LayerRunner`):
    the selected tokens' hidden states and residuals, and the context ``loads`` holds, into which each layer's new
    keys and values are written."""

    def __init__(self, model: Any, loads: SegmentLoads) -> None:
        self.inner, self.loads = model.model, loads
        self.ids = torch.tensor(loads.token_ids)
        self.changes: torch.Tensor | None = None

    def start(self, selected: torch.Tensor) -> None:
        self.sel = selected
        self.hidden, self.residual = self.inner.embed_tokens(self.ids[selected]), None
        self.blocks = query_blocks(selected, self.hidden.dtype)

    def layer(self, index: int, measure: bool) -> torch.Tensor | None:
        layer = self.inner.layers[index]
        attn = layer.self_attn
        original, self.scale = attn.attn, float(attn.scaling)
        attn.attn = _FusedAttention(self, index, measure)
        try:
            self.hidden, self.residual = layer(self.sel, self.hidden, self.residual)
        finally:
            attn.attn = original
        return self.changes if measure else None

    def attend(self, index: int, measure: bool, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> torch.Tensor:
        keys, values = self.loads.layers[index]  # [H, N, D]
        heads, n = keys.shape[0], len(self.sel)
        k = key.reshape(n, heads, -1).transpose(0, 1)
        v = value.reshape(n, heads, -1).transpose(0, 1)
        if measure:
            self.changes = token_changes(keys[:, self.sel], k, values[:, self.sel], v)
        keys[:, self.sel] = k.to(keys.dtype)
        values[:, self.sel] = v.to(values.dtype)
        q = query.reshape(n, -1, keys.shape[2]).transpose(0, 1)  # [Hq, n, D]
        out = torch.empty(q.shape[0], n, values.shape[2], dtype=query.dtype)
        for blk in self.blocks:
            out[:, blk.start:blk.stop] = F.scaled_dot_product_attention(
                q[None, :, blk.start:blk.stop], keys[None, :, :blk.end].to(q.dtype),
                values[None, :, :blk.end].to(q.dtype), attn_mask=blk.mask, is_causal=blk.mask is None,
                scale=self.scale, enable_gqa=True)[0]
        return out.transpose(0, 1).reshape(n, -1)

    def narrow(self, keep: torch.Tensor) -> None:
        self.sel, self.hidden = self.sel[keep], self.hidden[keep]
        self.residual = None if self.residual is None else self.residual[keep]
        self.blocks = query_blocks(self.sel, self.hidden.dtype)


@dataclass
class BlockFusion:
    """What :func:`fuse_into_blocks` did: its report and the tokens written into the blocks."""

    report: FusionReport
    written: int


def fuse_into_blocks(model: Any, store: SegmentStore, segments: Sequence[Sequence[int]], sink: PagedSink,
                     end: int, *, schedule: RecomputeSchedule, recompute_tps: float | None = None) -> BlockFusion:
    """Fuse the prompt ``anchor + segments`` from ``store`` with ``model`` (vLLM's, CPU) and write its first
    ``end`` tokens' KV into ``sink`` (the request's blocks).  ``recompute_tps`` (vLLM's prefill speed here,
    tokens/s) stops a segment's load where computing its rest is sooner, and stands in for the loading controller's
    cost per token-layer until the fusion measured its own."""
    check_supported(model)
    t0 = time.perf_counter()
    layers = len(model.model.layers)
    # vLLM runs the step under inference mode; the loads write the context from a thread of their own, which
    # may not write into tensors made under it
    with torch.inference_mode(False), torch.no_grad():
        loads = SegmentLoads(store, segments, store.store.shape, model_rotary(model), dtype=sink.layers[0].dtype,
                             recompute_tps=recompute_tps, schedule=schedule).start()
        done = recompute(_Runner(model, loads), loads, schedule, layers, recompute_tps)
        context = loads.context()
    end = min(end, context.num_tokens)
    for i, (k, v) in enumerate(context.layers):
        sink.write(i, 0, k[:, :end], v[:, :end])
    return BlockFusion(FusionReport.of(context, done, first_token_s=time.perf_counter() - t0), end)
