"""kvtc calibrations: per-model PCA bases of pre-RoPE, query-weighted keys and of sensitivity-weighted values.

A calibration is computed once per model from calibration text (never the text a codec is evaluated on) and
saved as a safetensors file.  Its SHA-256 (of the file's bytes) is its name: containers record it in their
config, and a decoder looks it up, in order, among the calibrations registered in this process
(:func:`register_calibration`), the folders of ``$KVCODEC_CALIBRATIONS`` (``os.pathsep``-separated) and the
cache folder (:func:`cache_dir`); never in the working directory unless a caller names it.  A file found by
its hash is checked against it before use.  A ``KVStore`` keeps the calibrations its chunks need beside them.

Features.  Layers are pooled in groups (layers of one kind: shape, rotary setting, window); a token's feature vector in a group
is the concatenation of its layers' ``[heads, dim]`` keys (or values).  Keys are first rotated back to
position 0 (the rotary embedding undone), then centred and multiplied by a weight per channel:

* keys: the RMS of the calibration queries that read the channel's rotary pair (summed over the query heads
  sharing the KV head), times the attention's logit scale (``self_attn.scaling``: ``head_dim ** -0.5`` in Llama,
  ``query_pre_attn_scalar ** -0.5`` in Gemma), so a unit of error is a unit of attention-logit error.  The queries
  are taken as the attention multiplies them: after its own query norm where it has one (Gemma 3's ``q_norm``
  rescales each head to a learned RMS, so the projection's raw output would misjudge them);
* values: the norm of the output projection's column that the channel feeds (summed the same way), over the RMS
  of the residual stream entering the layer, so a unit of error is a unit of error after the next layer's
  RMS normalization.  (Layer 0's values are tiny but its residual stream is too: this keeps them.)  Where the
  block transforms the attention's output before adding it to the residual stream (Gemma normalizes it: an
  RMSNorm with a learned gain), each row of the output projection is first multiplied by that transform's
  measured gain on its hidden channel (the least-squares slope of its output on its input over the calibration
  tokens: ``gain / RMS(attention output)`` for a norm; see ``_AttentionTaps``).  So Gemma's values, which reach
  ~136 in some layers but are divided by their own output's RMS before they count, are weighted by what reaches
  the residual stream, not by their raw size; a Llama block (nothing between the projection and the residual
  add) keeps a gain of 1, and the same weights as before.

Nothing here is specific to one model: rotary settings, head counts and sizes, logit scale, query norm and the
output transform are read from the model's config and modules, or measured on the calibration text.  Layers
with a sliding window (``layer_types``) hold other tokens than full layers, so they are never grouped with them;
during calibration they keep every token (their windowed cache would give a quarter of the rows).

The bases are the eigenvectors of the weighted features' covariance, largest first, truncated where a
component's standard deviation falls below a fraction of the finest level's step (such a component quantizes
to zero at every level).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from kvcodec.codecs.kvtc.rope import Rotary
from kvcodec.errors import CorruptDataError, InvalidInputError, KVCodecError, LimitExceededError
from kvcodec.files import write_atomically

FORMAT = "kvcodec-kvtc-calibration-1"
SUFFIX = ".kvtc"
ENV_PATH = "KVCODEC_CALIBRATIONS"
# Calibration texts: every machine has them, and none is one of the default evaluation texts
# (kvcodec.texts.DEFAULT_EVAL_TEXTS) or a version of one.
DEFAULT_CALIBRATION_TEXTS = ("license:GFDL-1.3", "license:LGPL-2.1", "license:Apache-2.0", "license:Artistic")
SEGMENT_TOKENS = 2048
SINK_TOKENS = 1  # left out of the statistics: kvtc stores them exactly
# A component whose std is below this fraction of the finest step rounds to zero at every level
# (|c| >= step/2 needs a 3.3-sigma excursion), so the basis drops it.
TRUNCATE_FRACTION = 0.15
WEIGHT_FLOOR = 1e-3
# Larger than any calibration a model of up to ~10B parameters needs with its layers pooled (SmolLM2's, all
# 30 layers in one group, is 85 MB), small enough that a file of junk cannot exhaust a serving machine's memory.
MAX_FILE_BYTES = 4 << 30
# Calibrations a decoder found by their hash stay loaded for the next chunk that names them; a process decoding
# containers of many models keeps only the most recently used few.
MAX_FOUND = 4


class MissingCalibrationError(KVCodecError):
    """A container names a kvtc calibration that is not found in the search path."""


@dataclass
class GroupBasis:
    """One layer group's transform for keys or for values: features ``F``, components ``K``."""

    mean: torch.Tensor  # [F] float32, in the feature's own units
    weight: torch.Tensor  # [F] float32
    basis: torch.Tensor  # [F, K] float16, orthonormal columns, largest variance first
    variance: torch.Tensor  # [K] float32, each component's variance on the calibration text

    @property
    def components(self) -> int:
        return self.basis.shape[1]

    @property
    def rows32(self) -> torch.Tensor:
        """The basis transposed ``[K, F]``, float32 and contiguous (converted once): a decode takes the rows of
        the components live in its chunk, a cheap row copy; an encode multiplies by its transpose view."""
        if getattr(self, "_rows32", None) is None:
            self._rows32 = self.basis.float().T.contiguous()
        return self._rows32


@dataclass(frozen=True)
class LayerInfo:
    heads: int
    key_dim: int
    value_dim: int
    rotary: Rotary | None  # None: the model applies no rotary embedding to this layer


@dataclass
class Calibration:
    """Everything ``kvtc`` needs for one model: layer groups, their bases, the layers' rotary settings."""

    model: str
    layers: list[LayerInfo]
    groups: list[list[int]]
    keys: list[GroupBasis]
    values: list[GroupBasis]
    settings: dict[str, Any] = field(default_factory=dict)
    _bytes: bytes | None = field(default=None, repr=False)

    # --- identity and files -------------------------------------------------------------

    def to_bytes(self) -> bytes:
        if self._bytes is None:
            from safetensors.torch import save

            tensors: dict[str, torch.Tensor] = {}
            for kind, bases in (("keys", self.keys), ("values", self.values)):
                for g, b in enumerate(bases):
                    tensors |= {f"{kind}.{g}.mean": b.mean.float().contiguous(), f"{kind}.{g}.weight": b.weight.float().contiguous(),
                                f"{kind}.{g}.basis": b.basis.half().contiguous(),
                                f"{kind}.{g}.variance": b.variance.float().contiguous()}
            for i, layer in enumerate(self.layers):
                if layer.rotary is not None:
                    tensors[f"rotary.{i}.inv_freq"] = torch.from_numpy(layer.rotary.inv_freq.astype(np.float64))
            layout = {"layers": [[l.heads, l.key_dim, l.value_dim, None if l.rotary is None else l.rotary.scaling]
                                 for l in self.layers], "groups": self.groups, "settings": self.settings}
            self._bytes = save(tensors, metadata={"format": FORMAT, "model": self.model,
                                                  "layout": json.dumps(layout, sort_keys=True)})
        return self._bytes

    @property
    def digest(self) -> str:
        """SHA-256 of the file's bytes: the name containers record."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the calibration file (atomically); returns its digest."""
        write_atomically(path, self.to_bytes())
        return self.digest

    @classmethod
    def from_bytes(cls, data: bytes, expect_digest: str | None = None) -> Calibration:
        from safetensors import SafetensorError
        from safetensors.torch import load

        if expect_digest is not None and hashlib.sha256(data).hexdigest() != expect_digest:
            raise CorruptDataError(f"kvtc calibration {expect_digest[:16]}... does not match its hash")
        try:
            tensors = load(data)
            meta = _safetensors_metadata(data)
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            layout = json.loads(meta["layout"])
            layers = []
            for i, (h, dk, dv, scaling) in enumerate(layout["layers"]):
                inv = tensors.get(f"rotary.{i}.inv_freq")
                layers.append(LayerInfo(h, dk, dv, None if inv is None else Rotary(inv.numpy(), float(scaling))))
            groups = [list(g) for g in layout["groups"]]
            bases = {kind: [GroupBasis(tensors[f"{kind}.{g}.mean"], tensors[f"{kind}.{g}.weight"],
                                       tensors[f"{kind}.{g}.basis"], tensors[f"{kind}.{g}.variance"])
                            for g in range(len(groups))] for kind in ("keys", "values")}
        except (SafetensorError, KeyError, ValueError, TypeError) as e:
            raise CorruptDataError(f"not a kvtc calibration file: {e}") from None
        cal = cls(meta.get("model", ""), layers, groups, bases["keys"], bases["values"], layout.get("settings", {}), data)
        cal._check()
        return cal

    @classmethod
    def load(cls, path: str | os.PathLike[str], expect_digest: str | None = None,
             max_bytes: int | None = None) -> Calibration:
        """The calibration in file ``path``; ``LimitExceededError`` (before reading it) when the file is larger
        than ``max_bytes`` (default :data:`MAX_FILE_BYTES`), ``CorruptDataError`` when it does not hash to
        ``expect_digest``."""
        max_bytes = MAX_FILE_BYTES if max_bytes is None else max_bytes
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if len(data) > max_bytes or size > max_bytes:  # the second: grown since fstat
            raise LimitExceededError(f"kvtc calibration file {os.fspath(path)!r} is {max(size, len(data))} bytes, "
                                     f"over the limit of {max_bytes}")
        return cls.from_bytes(data, expect_digest)

    def _check(self) -> None:
        seen = [l for g in self.groups for l in g]
        if sorted(seen) != list(range(len(self.layers))):
            raise CorruptDataError("kvtc calibration's groups do not cover its layers once each")
        for g, layers in enumerate(self.groups):
            for kind, dim in (("keys", "key_dim"), ("values", "value_dim")):
                b = getattr(self, kind)[g]
                f = sum(self.layers[l].heads * getattr(self.layers[l], dim) for l in layers)
                if b.mean.shape != (f,) or b.weight.shape != (f,) or b.basis.dim() != 2 or b.basis.shape[0] != f \
                        or b.variance.shape != (b.basis.shape[1],) or not bool(torch.all(b.weight > 0)):
                    raise CorruptDataError(f"kvtc calibration's {kind} basis of group {g} has the wrong shape")

    def group_of(self, layer: int) -> int:
        for g, layers in enumerate(self.groups):
            if layer in layers:
                return g
        raise InvalidInputError(f"layer {layer} is not in the kvtc calibration of {self.model!r}")

    @property
    def basis_bytes(self) -> int:
        return sum(b.basis.numel() * 2 for b in self.keys + self.values)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("truncated header")
    return json.loads(data[8:8 + n]).get("__metadata__", {})


# --- the search path -------------------------------------------------------------------

# Calibrations by digest: those registered explicitly (pinned, kept until the process ends: the caller chose
# them) and those a lookup found (at most MAX_FOUND, least recently used first).
_registered: dict[str, Calibration] = {}
_pinned: set[str] = set()
_lock = threading.Lock()


def cache_dir() -> str:
    """The folder where calibrations are installed: ``$XDG_CACHE_HOME/kvcodec/calibrations`` (a relative
    ``XDG_CACHE_HOME`` is ignored, as the XDG specification says: it would name a folder of the working
    directory)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvcodec", "calibrations")


def search_dirs(extra: Sequence[str | os.PathLike[str]] = ()) -> list[str]:
    env = [p for p in os.environ.get(ENV_PATH, "").split(os.pathsep) if p]
    return [os.fspath(p) for p in extra] + env + [cache_dir()]


def register_calibration(cal: Calibration | str | os.PathLike[str]) -> Calibration:
    """Make a calibration (or a calibration file) findable by its hash and its model in this process."""
    if not isinstance(cal, Calibration):
        cal = Calibration.load(cal)
    with _lock:
        _registered[cal.digest] = cal
        _pinned.add(cal.digest)
    return cal


def _remember_found(cal: Calibration) -> Calibration:
    with _lock:
        _registered.pop(cal.digest, None)
        _registered[cal.digest] = cal
        found = [d for d in _registered if d not in _pinned]
        for digest in found[:max(0, len(found) - MAX_FOUND)]:
            del _registered[digest]
    return cal


def install(cal: Calibration, folder: str | None = None) -> str:
    """Copy ``cal`` into ``folder`` (default: the cache folder) as ``<hash>.kvtc`` and record it as the
    calibration of its model there; returns the path."""
    folder = folder or cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, cal.digest + SUFFIX)
    if not os.path.exists(path):
        cal.save(path)
    write_atomically(os.path.join(folder, _model_file(cal.model)), (cal.digest + "\n").encode())
    return path


def _model_file(model: str) -> str:
    return "model-" + hashlib.sha256(model.encode()).hexdigest()[:16] + ".txt"


def find_calibration(digest: str, paths: Sequence[str | os.PathLike[str]] = ()) -> Calibration:
    """The calibration named ``digest``, from the process registry or the search path (``paths`` first).

    A file of that name that does not hash to it, or is larger than :data:`MAX_FILE_BYTES`, is passed over (the
    search goes on) and named in the ``MissingCalibrationError`` raised when nothing else is found: it is this
    machine's fault, not the container's, so it must not read as corrupt data (a store evicts corrupt chunks
    from shared tiers, and fetches a missing calibration from them)."""
    cal = _registered.get(digest)
    if cal is not None:
        return cal if digest in _pinned else _remember_found(cal)
    passed_over = []
    for folder in search_dirs(paths):
        path = os.path.join(folder, digest + SUFFIX)
        if os.path.isfile(path):
            try:
                return _remember_found(Calibration.load(path, digest))
            except (CorruptDataError, LimitExceededError) as e:
                passed_over.append(f"{path}: {e}")
    raise MissingCalibrationError(
        f"kvtc calibration {digest} is not available. Get the file from whoever wrote the container (or run "
        f"`kvcodec calibrate --model MODEL -o FILE` with the same model and settings) and put it in "
        f"{cache_dir()} as {digest}{SUFFIX}, in a folder of ${ENV_PATH}, or register it with "
        f"kvcodec.codecs.kvtc.register_calibration(FILE)"
        + "".join(f"; passed over {p}" for p in passed_over))


def calibration_for_model(model: str | None, paths: Sequence[str | os.PathLike[str]] = ()) -> Calibration | None:
    """The calibration an encoder uses for caches of ``model``: the last registered for it, else the one
    installed for it in the search path."""
    if not model:
        return None
    with _lock:
        known = list(_registered.values())
    for cal in reversed(known):
        if cal.model == model:
            return cal
    for folder in search_dirs(paths):
        marker = os.path.join(folder, _model_file(model))
        if os.path.isfile(marker):
            with open(marker) as f:
                return find_calibration(f.read().strip(), [folder])
    return None


# --- computing one ------------------------------------------------------------------------

def model_layers(model: Any) -> list[LayerInfo]:
    """Heads, head sizes and rotary settings of a transformers decoder's attention layers.  A model whose layer
    types use different rotary settings (Gemma 3: sliding layers at theta 1e4, full layers at 1e6) keeps them on its
    rotary embedding as ``{layer_type}_inv_freq`` and ``{layer_type}_attention_scaling`` (transformers 5)."""
    cfg = model.config
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // nq
    emb = getattr(model.model, "rotary_emb", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    rope = getattr(cfg, "position_embedding_type", "rope") in ("rope", None)
    out = []
    for i in range(cfg.num_hidden_layers):
        prefix = f"{layer_types[i]}_" if i < len(layer_types) and hasattr(emb, f"{layer_types[i]}_inv_freq") else ""
        inv_freq = getattr(emb, prefix + "inv_freq", None)
        rot = None
        if rope and inv_freq is not None:
            rot = Rotary(inv_freq.detach().double().cpu().numpy(), float(getattr(emb, prefix + "attention_scaling", 1.0)))
        out.append(LayerInfo(nkv, d, d, rot))
    return out


def default_groups(layers: Sequence[LayerInfo], group_layers: int | None, window_layers: Sequence[bool] = ()) -> list[list[int]]:
    """The layers of each kind (shape, rotary, sliding window or not) in order, at most ``group_layers`` per group
    (None: as many as there are)."""
    def kind(i: int) -> tuple:
        l = layers[i]
        return (l.heads, l.key_dim, l.value_dim, None if l.rotary is None else l.rotary.inv_freq.tobytes(),
                window_layers[i] if i < len(window_layers) else False)

    kinds: dict[tuple, list[int]] = {}
    for i in range(len(layers)):
        kinds.setdefault(kind(i), []).append(i)
    size = group_layers or len(layers)
    groups = [members[j:j + size] for members in kinds.values() for j in range(0, len(members), size)]
    return sorted(groups)


@dataclass
class _Moments:
    """Running first and second moments of feature rows, in float64."""

    total: torch.Tensor | None = None
    outer: torch.Tensor | None = None
    count: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        if self.total is None:
            self.total, self.outer = x.sum(0), x.T @ x
        else:
            self.total += x.sum(0)
            self.outer += x.T @ x
        self.count += x.shape[0]


@dataclass
class Features:
    """What a model run over calibration text yields, before any grouping: per layer the feature rows of the
    keys (rotary embedding undone) and values ``[N, H * D]``, and the channel weights ``[H * D]``."""

    model: str
    layers: list[LayerInfo]
    windowed: list[bool]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_weights: list[torch.Tensor]
    value_weights: list[torch.Tensor]
    settings: dict[str, Any]


class _AttentionTaps:
    """Forward hooks on each decoder block that record what the channel weights need:

    * the queries as the attention multiplies them with the keys: the query projection's output, through the
      attention's own query norm when it has one (``q_norm``: Gemma 3, Qwen 3), ``[T, heads * dim]``;
    * the gain per hidden channel of whatever the block applies to the attention's output before adding it to the
      residual stream (Gemma's post-attention RMSNorm divides it by its RMS and multiplies by a learned weight):
      the least-squares slope of that module's output on its input, per channel (1 where the output is added as
      it is, as in Llama).  It is found as the child module whose input is the attention's output tensor itself.
    """

    def __init__(self, blocks: Any, heads: int) -> None:
        self.queries: dict[int, torch.Tensor] = {}
        self._cross: dict[int, torch.Tensor] = {}  # sum over tokens of output * input, per hidden channel
        self._square: dict[int, torch.Tensor] = {}  # sum over tokens of input ** 2
        self._attn_out: dict[int, torch.Tensor] = {}
        self._hooks = []
        for idx, block in enumerate(blocks):
            attn = block.self_attn
            norm = getattr(attn, "q_norm", None)

            def on_query(m: Any, i: Any, o: torch.Tensor, idx: int = idx, norm: Any = norm) -> None:
                q = o[0].detach()
                if norm is not None:
                    q = norm(q.reshape(q.shape[0], heads, -1))
                self.queries[idx] = q.reshape(q.shape[0], -1).float()

            def on_attention(m: Any, i: Any, o: Any, idx: int = idx) -> None:
                self._attn_out[idx] = o[0] if isinstance(o, tuple) else o

            def on_child(m: Any, i: Any, o: Any, idx: int = idx) -> None:
                if i and i[0] is self._attn_out.get(idx) and isinstance(o, torch.Tensor) and o.shape == i[0].shape:
                    x, y = i[0].detach().double().reshape(-1, o.shape[-1]), o.detach().double().reshape(-1, o.shape[-1])
                    self._cross[idx] = self._cross.get(idx, 0) + (x * y).sum(0)
                    self._square[idx] = self._square.get(idx, 0) + x.pow(2).sum(0)

            self._hooks.append(attn.q_proj.register_forward_hook(on_query))
            self._hooks.append(attn.register_forward_hook(on_attention))
            self._hooks += [child.register_forward_hook(on_child) for child in block.children() if child is not attn]

    def output_gain(self, idx: int) -> torch.Tensor:
        """Per hidden channel, how much of a change in the attention's output reaches the residual stream."""
        if idx not in self._cross:
            return torch.ones(1, dtype=torch.float64)
        return self._cross[idx] / self._square[idx].clamp_min(1e-30)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@torch.no_grad()
def collect_features(loaded: Any, texts: Sequence[str] = DEFAULT_CALIBRATION_TEXTS, *,
                     segment_tokens: int = SEGMENT_TOKENS, max_tokens: int | None = None, undo_rope: bool = True,
                     progress: Any = None) -> Features:
    """Run ``loaded`` (a :class:`kvcodec.models.LoadedModel`) over ``texts`` (specs for
    :func:`kvcodec.texts.load_text`) in segments of ``segment_tokens`` and gather the calibration features."""
    from transformers import DynamicCache

    from kvcodec.cache import KVCache
    from kvcodec.texts import load_text

    model = loaded.model
    cfg = model.config
    layers = model_layers(model)
    if not undo_rope:
        layers = [LayerInfo(l.heads, l.key_dim, l.value_dim, None) for l in layers]
    layer_types = getattr(cfg, "layer_types", None) or []
    windowed = [t == "sliding_attention" for t in layer_types]
    nq = cfg.num_attention_heads
    blocks = model.model.layers
    if not all(hasattr(b, "self_attn") and hasattr(b.self_attn, "q_proj") and hasattr(b.self_attn, "o_proj") for b in blocks):
        raise InvalidInputError("kvtc calibration needs attention layers with q_proj and o_proj (Llama, Qwen, Gemma, ...)")
    segments = []
    for spec in texts:
        ids = loaded.tokenize(load_text(spec))
        segments += [ids[i:i + segment_tokens] for i in range(0, len(ids), segment_tokens)
                     if len(ids) - i >= segment_tokens // 4]
    if max_tokens is not None:
        while len(segments) > 1 and sum(map(len, segments)) > max_tokens:
            segments.pop()
    if not segments:
        raise InvalidInputError("the calibration texts are too short")
    q_energy = [torch.zeros(l.heads, l.key_dim, dtype=torch.float64) for l in layers]
    resid_sq = torch.zeros(len(layers), dtype=torch.float64)
    counted = 0
    keys_pre: list[list[torch.Tensor]] = [[] for _ in layers]
    values: list[list[torch.Tensor]] = [[] for _ in layers]
    taps = _AttentionTaps(blocks, nq)
    try:
        for seg in (progress(segments, len(segments)) if progress else segments):
            # A cache without the model's config keeps every token of every layer (a sliding-window layer's own
            # cache keeps only its window): the keys and values do not depend on it, and windowed layers then
            # give as many feature rows as the others.
            cache = DynamicCache()
            out = model(torch.tensor([seg]), use_cache=True, output_hidden_states=True, **loaded._cache_arg(cache))
            kv = KVCache.from_hf(cache)
            n = len(seg)
            for i, l in enumerate(layers):
                qd = taps.queries[i][SINK_TOKENS:].double().pow(2).sum(0)
                q_energy[i] += qd.reshape(l.heads, nq // l.heads, l.key_dim).sum(1)
                resid_sq[i] += out.hidden_states[i][0, SINK_TOKENS:].double().pow(2).mean(-1).sum()
                k, v = kv.layers[i].keys.float(), kv.layers[i].values.float()
                t = k.shape[1]
                pos = torch.arange(n - t, n)
                if l.rotary is not None:
                    k = l.rotary.rotate(k, pos, inverse=True)
                keep = pos >= SINK_TOKENS
                keys_pre[i].append(k[:, keep].permute(1, 0, 2).reshape(int(keep.sum()), -1))
                values[i].append(v[:, keep].permute(1, 0, 2).reshape(int(keep.sum()), -1))
            counted += n - SINK_TOKENS
    finally:
        taps.remove()
    key_weights, value_weights = [], []
    for i, l in enumerate(layers):
        energy = q_energy[i] / counted
        half = l.rotary.dims // 2 if l.rotary is not None else 0
        if half:  # RoPE rotates energy within a pair: weight the pair by its mean
            pair = (energy[:, :half] + energy[:, half:2 * half]) / 2
            energy = torch.cat([pair, pair, energy[:, 2 * half:]], -1)
        scaling = float(getattr(blocks[i].self_attn, "scaling", l.key_dim ** -0.5))  # the logits' factor
        key_weights.append(_floored((energy.sqrt() * scaling).reshape(-1)))
        wo = blocks[i].self_attn.o_proj.weight.double() * taps.output_gain(i)[:, None]
        col = wo.pow(2).sum(0).reshape(l.heads, nq // l.heads, l.value_dim).sum(1).sqrt()
        value_weights.append(_floored((col / math.sqrt(resid_sq[i] / counted)).reshape(-1)))
    settings = {"texts": list(texts), "segment_tokens": segment_tokens, "tokens": counted, "undo_rope": undo_rope,
                "window": getattr(cfg, "sliding_window", None)}
    return Features(loaded.model_id, layers, windowed, [torch.cat(f) for f in keys_pre], [torch.cat(f) for f in values],
                    key_weights, value_weights, settings)


def _floored(weight: torch.Tensor) -> torch.Tensor:
    """Weights of at least ``WEIGHT_FLOOR`` times the layer's largest: a channel nothing reads (Gemma 3 270M's
    query norm zeroes some query channels, so their keys' weight is 0) must still be invertible; its error then
    costs next to nothing, as it should."""
    return weight.clamp_min(WEIGHT_FLOOR * float(weight.max()))


def calibrate(loaded: Any, texts: Sequence[str] = DEFAULT_CALIBRATION_TEXTS, *, group_layers: int | None = None,
              finest_steps: tuple[float, float] | None = None, segment_tokens: int = SEGMENT_TOKENS,
              max_tokens: int | None = None, undo_rope: bool = True, weight_keys: bool = True,
              weight_values: bool = True, progress: Any = None, features: Features | None = None) -> Calibration:
    """Compute a calibration of ``loaded`` from ``texts`` (see :func:`collect_features`, or pass ``features``
    already collected).

    ``group_layers`` pools that many consecutive layers per basis (None: all layers of a kind).  ``undo_rope``,
    ``weight_keys`` and ``weight_values`` switch off the design's parts, for measuring what each is worth.
    """
    f = features or collect_features(loaded, texts, segment_tokens=segment_tokens, max_tokens=max_tokens,
                                     undo_rope=undo_rope, progress=progress)
    groups = default_groups(f.layers, group_layers, f.windowed)
    key_weights = f.key_weights if weight_keys else _flat(f.key_weights, groups)  # one weight per group
    value_weights = f.value_weights if weight_values else _flat(f.value_weights, groups)
    settings = f.settings | {"group_layers": group_layers, "weight_keys": weight_keys, "weight_values": weight_values}
    return fit_calibration(f.model, f.layers, groups, f.keys, f.values, key_weights, value_weights, finest_steps,
                           settings)


def _flat(weights: list[torch.Tensor], groups: list[list[int]]) -> list[torch.Tensor]:
    out = list(weights)
    for members in groups:
        rms = float(torch.cat([weights[i] for i in members]).pow(2).mean().sqrt())
        for i in members:
            out[i] = torch.full_like(weights[i], rms)
    return out


def fit_calibration(model: str, layers: list[LayerInfo], groups: list[list[int]], keys_pre: list[torch.Tensor],
                    values: list[torch.Tensor], key_weights: list[torch.Tensor], value_weights: list[torch.Tensor],
                    finest_steps: tuple[float, float] | None = None, settings: dict[str, Any] | None = None) -> Calibration:
    """The PCA bases of each group from per-layer feature rows ``[N, H * D]`` (keys already rotated back to
    position 0) and per-layer channel weights ``[H * D]``."""
    from kvcodec.codecs.kvtc.levels import LEVELS

    if finest_steps is None:
        finest_steps = (min(k for k, _ in LEVELS.values()), min(v for _, v in LEVELS.values()))
    kb, vb = [], []
    for members in groups:
        for feats, weights, bases, finest in ((keys_pre, key_weights, kb, finest_steps[0]),
                                              (values, value_weights, vb, finest_steps[1])):
            w = torch.cat([weights[i].reshape(-1) for i in members]).double()
            x = torch.cat([feats[i] for i in members], 1).double()
            bases.append(_basis(x, w, TRUNCATE_FRACTION * finest))
    return Calibration(model, layers, groups, kb, vb, settings or {})


def _basis(x: torch.Tensor, w: torch.Tensor, min_std: float) -> GroupBasis:
    """PCA of the weighted rows of ``x`` ``[N, F]`` (float64), components with std >= ``min_std``."""
    mean = x.mean(0)
    xw = (x - mean) * w
    cov = (xw.T @ xw) / max(x.shape[0] - 1, 1)
    var, vec = torch.linalg.eigh(cov)
    var, vec = var.flip(0).clamp_min(0), vec.flip(1)
    # a deterministic sign: each component's largest entry positive
    sign = torch.sign(vec.gather(0, vec.abs().argmax(0, keepdim=True)))
    vec = vec * torch.where(sign == 0, 1.0, sign)
    keep = max(1, int((var.sqrt() >= min_std).sum()))
    return GroupBasis(mean.float(), w.float(), vec[:, :keep].half(), var[:keep].float())


def ensure_calibration(loaded: Any, log: Any = None, **options: Any) -> Calibration:
    """The calibration installed for ``loaded``'s model, or a new one computed now (with ``options`` for
    :func:`calibrate`), installed in the cache folder and announced through ``log`` (a callable taking a line):
    how tools and engine hooks that have the model get one on first use."""
    cal = calibration_for_model(loaded.model_id)
    if cal is not None:
        return register_calibration(cal)
    if log:
        log(f"kvtc: no calibration of {loaded.model_id} installed; calibrating it now (once) into {cache_dir()}")
    cal = calibrate(loaded, **options)
    path = install(cal)
    if log:
        log(f"kvtc: calibration {cal.digest} of {loaded.model_id} installed as {path}")
    return register_calibration(cal)
