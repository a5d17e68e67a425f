"""kvtc calibrations: per-model PCA bases of pre-RoPE, query-weighted keys and of sensitivity-weighted values.

A calibration is computed once per model from calibration text (never the text a codec is evaluated on) and
saved as a safetensors file.  Its SHA-256 (of the file's bytes) is its name: containers record it in their
config, and a decoder looks it up, in order, among the calibrations registered in this process
(:func:`register_calibration`), the folders of ``$KVCODEC_CALIBRATIONS`` (``os.pathsep``-separated) and the
cache folder (:func:`cache_dir`); never in the working directory unless a caller names it.  A file named
``<hash>.kvtc`` is found by its name; failing that, every other ``*.kvtc`` file there by its content (each hashed
once per process).  A file is checked against the hash before use.  A ``KVStore`` keeps the calibrations its chunks need beside them.

An encoder finds the calibration of a model by the model's identity (:func:`kvcodec.store.identity.model_identity`,
a digest of its configuration and weights), which the file records beside the model's name for humans and under
which it is installed; calibrations made before identities were recorded are found by the model's name.

Features.  Layers are pooled in groups (consecutive layers of one kind: shape, rotary setting, window; by default
the fewest groups of at most 4096 features, see :func:`kvcodec.codecs.kvtc.fit.default_groups`); a token's feature vector in a group is the concatenation of
its layers' ``[heads, dim]`` keys (or values).  Keys are first rotated back to
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

The bases are the eigenvectors of the weighted features' covariance (streamed moments), largest first, truncated
where a component's standard deviation falls below the codec's default ``min_std`` times the finest level's step
(format 2): the file holds what a decoder can use at the finest level, no more.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kvcodec.positions import Rotary
from kvcodec.errors import CorruptDataError, LimitExceededError, MissingCalibrationError
from kvcodec.files import write_atomically

FORMAT = "kvcodec-kvtc-calibration-2"
# Format 1 files (every component above a lower floor, all-layer groups) have the same layout and still load:
# the codec counts the components it codes from their variances, so containers written with them decode as before.
READABLE_FORMATS = (FORMAT, "kvcodec-kvtc-calibration-1")
SUFFIX = ".kvtc"
ENV_PATH = "KVCODEC_CALIBRATIONS"
# Larger than any calibration a model of up to ~70B parameters needs (at most the KV width per token × 4096 × 4
# bytes with the default grouping: 0.5 GB for Llama-3-8B, 1.3 GB for a 70B with 80 layers of 8 × 128; format 1's
# all-layer SmolLM2 file was 85 MB), small enough that a file of junk cannot exhaust a serving machine's memory.
MAX_FILE_BYTES = 4 << 30
# Calibrations a decoder found by their hash stay loaded for the next chunk that names them; a process decoding
# containers of many models keeps only the most recently used few.
MAX_FOUND = 4


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
    """Everything ``kvtc`` needs for one model: layer groups, their bases, the layers' rotary settings.

    ``model`` names the model for humans; ``model_digest`` is its identity (empty in calibrations made before
    identities were recorded): the name it is installed and found under (:func:`calibration_for_model`)."""

    model: str
    layers: list[LayerInfo]
    groups: list[list[int]]
    keys: list[GroupBasis]
    values: list[GroupBasis]
    settings: dict[str, Any] = field(default_factory=dict)
    model_digest: str = ""
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
            meta = {"format": FORMAT, "model": self.model, "layout": json.dumps(layout, sort_keys=True)}
            if self.model_digest:  # absent, a file has the bytes it had before identities were recorded
                meta["model_digest"] = self.model_digest
            self._bytes = _sorted_header(save(tensors, metadata=meta))
        return self._bytes

    @property
    def digest(self) -> str:
        """SHA-256 of the file's bytes: the name containers record.  Hashed once per byte form: every chunk's
        decode looks its calibration up by it (SmolLM2's 73 MB took 0.1-0.25 s to hash, twice per lookup)."""
        data = self.to_bytes()
        if getattr(self, "_digest_of", None) is not data:
            self._digest_of, self._digest = data, hashlib.sha256(data).hexdigest()
        return self._digest

    @property
    def model_key(self) -> str:
        """The name this calibration is installed and found under: the model's identity, else (a calibration made
        before identities were recorded) the model's name."""
        return self.model_digest or self.model

    def of_model(self, model_digest: str) -> Calibration:
        """This calibration recorded as that of the model whose identity is ``model_digest`` (another file, so
        another digest)."""
        return dataclasses.replace(self, model_digest=model_digest, _bytes=None)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the calibration file (atomically); returns its digest."""
        write_atomically(path, self.to_bytes())
        return self.digest

    @classmethod
    def from_bytes(cls, data: bytes, expect_digest: str | None = None) -> Calibration:
        """The calibration in ``data``; ``CorruptDataError`` for anything that is not one (bytes that do not hash to
        ``expect_digest``, or that do but hold no well-formed calibration: a file made to match a name)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        if expect_digest is not None and hashlib.sha256(data).hexdigest() != expect_digest:
            raise CorruptDataError(f"kvtc calibration {expect_digest[:16]}... does not match its hash")
        try:
            tensors = load(data)
            meta = _safetensors_metadata(data)
            if meta.get("format") not in READABLE_FORMATS:
                raise ValueError(f"format {meta.get('format')!r} (this kvcodec reads {', '.join(READABLE_FORMATS)})")
            layout = json.loads(meta["layout"])
            layers = []
            for i, (h, dk, dv, scaling) in enumerate(layout["layers"]):
                inv = tensors.get(f"rotary.{i}.inv_freq")
                layers.append(LayerInfo(h, dk, dv, None if inv is None else Rotary(inv.numpy(), float(scaling))))
            groups = [list(g) for g in layout["groups"]]
            bases = {kind: [GroupBasis(tensors[f"{kind}.{g}.mean"], tensors[f"{kind}.{g}.weight"],
                                       tensors[f"{kind}.{g}.basis"], tensors[f"{kind}.{g}.variance"])
                            for g in range(len(groups))] for kind in ("keys", "values")}
            cal = cls(str(meta.get("model", "")), layers, groups, bases["keys"], bases["values"],
                      layout.get("settings", {}), str(meta.get("model_digest", "")), data)
            cal._check()
        except (SafetensorError, KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
            raise CorruptDataError(f"not a kvtc calibration file: {type(e).__name__}: {e}") from None
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
        if not all(type(l) is int for l in seen) or sorted(seen) != list(range(len(self.layers))):
            raise CorruptDataError("kvtc calibration's groups do not cover its layers once each")
        for g, layers in enumerate(self.groups):
            for kind, dim in (("keys", "key_dim"), ("values", "value_dim")):
                b = getattr(self, kind)[g]
                f = sum(self.layers[l].heads * getattr(self.layers[l], dim) for l in layers)
                if b.mean.shape != (f,) or b.weight.shape != (f,) or b.basis.dim() != 2 or b.basis.shape[0] != f \
                        or b.variance.shape != (b.basis.shape[1],) or not bool(torch.all(b.weight > 0)):
                    raise CorruptDataError(f"kvtc calibration's {kind} basis of group {g} has the wrong shape")

    @property
    def basis_bytes(self) -> int:
        return sum(b.basis.numel() * 2 for b in self.keys + self.values)


def _sorted_header(data: bytes) -> bytes:
    """A safetensors file with its JSON header's keys in sorted order.  safetensors (0.8) writes the metadata map
    in an order that changes from process to process, and a calibration is named by the hash of its bytes: the same
    calibration must give the same bytes in every process.  Padded with spaces to 8 bytes, as safetensors pads."""
    n = int.from_bytes(data[:8], "little")
    raw = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


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
# The SHA-256 of each calibration file of the search path hashed by content in this process, by path, with the
# size and modification time it had then: a file is hashed once, unless it changes.
_hashed: dict[str, tuple[int, int, str]] = {}


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
    """Make a calibration (or a calibration file) findable by its hash and its model in this process, its bases
    ready to code with.

    Registering is what a serving process does at start (the engine hooks, on opening their store), so the bases'
    one-time conversion (:attr:`GroupBasis.rows32`, 146 MB of float32 rows for SmolLM2) happens here rather than in a
    request: a fresh process's first decode of a 256-token SmolLM2 chunk took 0.33-0.36 s with it, 0.17 s without
    (the next ones 0.11 s)."""
    if not isinstance(cal, Calibration):
        cal = Calibration.load(cal)
    for basis in cal.keys + cal.values:
        basis.rows32  # noqa: B018 - converted now (see above)
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
    """Copy ``cal`` into ``folder`` (default: the cache folder) as ``<hash>.kvtc`` and record it there as the
    calibration of its model (under :attr:`Calibration.model_key`); returns the path."""
    folder = folder or cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, cal.digest + SUFFIX)
    if not os.path.exists(path):
        cal.save(path)
    write_atomically(os.path.join(folder, _model_file(cal.model_key)), (cal.digest + "\n").encode())
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
    folders = search_dirs(paths)
    named = [os.path.join(folder, digest + SUFFIX) for folder in folders]
    # a generator: the other files are hashed only when no file named by the digest loads
    for path in itertools.chain((p for p in named if os.path.isfile(p)), _files_hashing_to(digest, folders)):
        try:
            return _remember_found(Calibration.load(path, digest))
        except (CorruptDataError, LimitExceededError) as e:
            passed_over.append(f"{path}: {e}")
    raise MissingCalibrationError(
        f"kvtc calibration {digest} is not available. Get the file from whoever wrote the container (or run "
        f"`kvcodec calibrate --model MODEL -o FILE` with the same model and settings) and put it (any name ending "
        f"{SUFFIX}) in {cache_dir()} or a folder of ${ENV_PATH}, or register it with "
        f"kvcodec.codecs.kvtc.register_calibration(FILE)"
        + "".join(f"; passed over {p}" for p in passed_over))


def _files_hashing_to(digest: str, folders: Sequence[str]) -> Iterator[str]:
    """The ``*.kvtc`` files of ``folders`` not named ``<digest>.kvtc`` whose bytes hash to ``digest`` (a calibration
    copied in under the name it was made with).  Each file is hashed once per process (again only if its size or
    modification time changes); one larger than :data:`MAX_FILE_BYTES` is never read."""
    for folder in folders:
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(SUFFIX) and n != digest + SUFFIX)
        except OSError:  # no such folder: nothing installed there
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                    continue
                known = _hashed.get(path)
                if known is None or known[:2] != (st.st_size, st.st_mtime_ns):
                    known = _hashed[path] = (st.st_size, st.st_mtime_ns, _file_sha256(path))
            except OSError:  # removed or unreadable meanwhile: not a calibration this process can use
                continue
            if known[2] == digest:
                yield path


def _file_sha256(path: str) -> str:
    """SHA-256 of the file's first MAX_FILE_BYTES + 1 bytes (a file grown past the limit since it was measured
    hashes to no calibration's name, and is not read further)."""
    h, left = hashlib.sha256(), MAX_FILE_BYTES + 1
    with open(path, "rb") as f:
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def calibration_for_model(model: str | None, paths: Sequence[str | os.PathLike[str]] = ()) -> Calibration | None:
    """The calibration an encoder uses for caches of ``model`` (a model identity, or a model's name): the last
    registered in this process whose identity or name it is, else the one installed under it in the search path
    (a name finds only calibrations made before identities were recorded: names are ambiguous)."""
    if not model:
        return None
    with _lock:
        known = list(_registered.values())
    for cal in reversed(known):
        if model in (cal.model_digest, cal.model):
            return cal
    for folder in search_dirs(paths):
        marker = os.path.join(folder, _model_file(model))
        if os.path.isfile(marker):
            with open(marker) as f:
                return find_calibration(f.read().strip(), [folder])
    return None
