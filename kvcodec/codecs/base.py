"""The codec interface: what a container needs from a compression scheme."""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from kvcodec.errors import CorruptDataError, InvalidInputError, UnsupportedError
from kvcodec.formats.v1 import LayerShape
from kvcodec.threads import DEFAULT_THREADS


@dataclass(frozen=True)
class LayerContext:
    """Where a section sits: which layer of how many, its shape, dtype and device.

    ``shape.tokens`` is the number of tokens in this section (one chunk of one layer).
    ``model`` is the cache's model id, which encoders may use to look up a profile.
    ``token_start`` is the section's first token on the layer's own token axis.
    ``backend`` is one of :data:`BACKENDS`: which implementation a codec with a GPU path should run
    (``"auto"``: cachegen's Triton kernels, and kvfetcher's NVDEC decoder where PyNvVideoCodec is installed, for
    CUDA tensors; ``"nvdec"``: kvfetcher's NVDEC decoder or an error).
    ``rope`` is the cache's ``rope`` metadata and ``positions`` the position id of each of the section's tokens
    (from the ``positions`` metadata, else the token's index on the longest layer's axis).
    ``threads`` is the call's ``threads`` (:mod:`kvcodec.threads`): how many CPU threads the codec may use.  Torch
    already runs on that many during the call; a codec whose sections code outside the GIL codes that many at once.
    ``window_tokens`` is the layer's whole token count where it holds fewer tokens than the cache's longest layer
    (a sliding window, right-aligned: SPEC.md §6.3), else 0: token ``i`` of its axis is then ``window_tokens - 1 -
    i`` tokens older than the newest, and leaves the window that much sooner.
    """

    layer: int
    num_layers: int
    shape: LayerShape
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    model: str | None = None
    token_start: int = 0
    backend: str = "auto"
    rope: str | None = None
    positions: tuple[int, ...] = ()
    threads: int = DEFAULT_THREADS
    window_tokens: int = 0

    def positions_tensor(self) -> torch.Tensor:
        return torch.tensor(self.positions, dtype=torch.int64)


class Codec(abc.ABC):
    """A compression scheme for one layer of one chunk (a *section*).

    Subclasses set ``codec_id`` and ``lossless``, take their configuration as
    keyword arguments of ``__init__`` (JSON-serialisable values only), and
    implement :meth:`encode_layer`, :meth:`decode_layer` and :meth:`get_config`.
    The container calls them once per section; sections are independent.
    """

    codec_id: ClassVar[str]
    lossless: ClassVar[bool]
    backends: ClassVar[tuple[str, ...]] = ("cpu",)  # implementations a caller may force
    # A codec that codes a frame's layers together implements encode_frame/decode_frame instead of working
    # section by section; its frames hold one section (SPEC.md §6.7).
    joint_sections: ClassVar[bool] = False
    # A codec whose coding depends on the tokens' positions (kvtc undoes the rotary embedding at them): a store
    # records each chunk's absolute positions for it, which a chunk would otherwise take to start at 0.
    uses_positions: ClassVar[bool] = False
    # A codec whose steps come from a channel profile of the model (cachegen, kvfetcher): engine hooks find the
    # model's profile for it, and warn when none matches (the codec then takes its steps from the data).
    uses_profile: ClassVar[bool] = False

    @abc.abstractmethod
    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        """Encode one layer's section of a chunk (that layer's ``[H, T, Dk]`` keys and ``[H, T, Dv]`` values over the
        chunk's tokens, SPEC.md §3.3) to bytes.  The ``_layer`` methods work on one layer's section; the
        ``_layers`` ones on the sections of several layers of one chunk."""

    @abc.abstractmethod
    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a section to keys and values of ``ctx.shape`` in ``ctx.dtype`` on ``ctx.device``.

        Must raise :class:`CorruptDataError` (never allocate blindly) when ``data``
        cannot be a section of that shape.
        """

    def encode_layers(self, layers: list[tuple[torch.Tensor, torch.Tensor]], ctxs: list[LayerContext]) -> list[bytes]:
        """Encode several sections at once (the layers of one chunk); codecs with batched kernels override this."""
        return [self.encode_layer(k, v, ctx) for (k, v), ctx in zip(layers, ctxs)]

    def decode_layers(self, datas: list[bytes], ctxs: list[LayerContext]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode several sections at once; codecs with batched kernels override this."""
        return [self.decode_layer(data, ctx) for data, ctx in zip(datas, ctxs)]

    def encode_frame(self, layers: list[tuple[torch.Tensor, torch.Tensor]], ctxs: list[LayerContext]) -> bytes:
        """Joint codecs: encode the layers of a frame (those holding tokens) to one section."""
        raise NotImplementedError

    def decode_frame(self, data: bytes, ctxs: list[LayerContext], wanted: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Joint codecs: decode the ``wanted`` layers of a frame whose layers holding tokens have ``ctxs``."""
        raise NotImplementedError

    @classmethod
    def needs_model(cls, config: dict[str, Any]) -> bool:
        """Whether a codec of ``config`` resolves something made from the model itself, which an engine hook
        must make at first use when none is installed (kvtc with ``calibration="auto"``: a calibration)."""
        return False

    def rotary(self) -> Sequence[Any] | None:
        """The rotary setting of each model layer, where this codec knows it (kvtc: from its calibration), so
        that its caches' keys can be moved to new positions; None otherwise."""
        return None

    @classmethod
    def installed_rotary(cls, model: str | None) -> Sequence[Any] | None:
        """The rotary setting of each layer of ``model`` as this codec has it installed on this machine (kvtc: its
        calibration for the model), so that a cache of that model coded with any codec can have its keys moved to
        new positions; None otherwise."""
        return None

    def side_data_name(self) -> str | None:
        """The name of what this codec needs beyond a container's bytes to decode it (kvtc: its calibration, by
        hash), or None.  A store keeps it once beside the chunks under this name, so another machine sharing the
        tiers can decode them."""
        return None

    def side_data(self) -> bytes:
        """The side data :meth:`side_data_name` names, as stored."""
        raise NotImplementedError

    def has_side_data(self) -> bool:
        """Whether this machine has the side data (it need not be fetched)."""
        return True

    def install_side_data(self, data: bytes) -> None:
        """Make side data read from a store available to this process; bad data raises :class:`KVCodecError`."""
        raise NotImplementedError

    def for_cache(self, kv: Any) -> Codec:
        """The codec to encode ``kv`` with: codecs whose config depends on the cache (a calibration chosen by
        its model) resolve it here, before the header is written."""
        return self

    def decode_layer_paged(self, data: bytes, ctx: LayerContext, paged: torch.Tensor, slots: torch.Tensor,
                           layout: Any = "flash") -> None:
        """Decode a section into one layer of vLLM-style paged memory: token ``t`` of the section goes to flat slot
        ``slots[t]``.  ``layout`` (a :class:`kvcodec.layouts.paged.PagedLayout` or its name) says how the layer
        holds them: ``"flash"`` is ``(2, num_blocks, block_size, H, D)``, ``"cpu"`` vLLM's CPU backend's
        ``(num_blocks, H, block_size, 2*D)`` with keys transposed.  Codecs with a fused path override this."""
        from kvcodec.layouts.paged import check_paged_layer, write_paged

        slots = check_paged_layer(paged, ctx.shape, slots, layout)
        keys, values = self.decode_layer(data, ctx)
        write_paged(paged, keys, values, slots, layout)

    def decode_frame_paged(self, data: bytes, ctxs: list[LayerContext], paged: dict[int, torch.Tensor],
                           slots: dict[int, torch.Tensor], layout: Any = "flash") -> None:
        """Joint codecs: decode the layers of a frame named in ``paged`` (layer: its paged tensor) into paged
        memory at ``slots[layer]``, as :meth:`decode_layer_paged` does for one section.  Codecs with a fused path
        override this."""
        from kvcodec.layouts.paged import check_paged_layer, write_paged

        by_layer = {c.layer: c for c in ctxs}
        checked = {l: check_paged_layer(paged[l], by_layer[l].shape, slots[l], layout) for l in paged}
        for layer, (keys, values) in self.decode_frame(data, ctxs, set(paged)).items():
            write_paged(paged[layer], keys, values, checked[layer], layout)

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this codec with :meth:`from_config`."""

    @classmethod
    def presets(cls) -> list[dict[str, Any]]:
        """The configs a rate-distortion sweep should try, smallest first (default: the default config)."""
        return [{}]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        """Build from a config dict; unknown keys are an error that names them."""
        params = inspect.signature(cls.__init__).parameters
        unknown = sorted(set(config) - set(params) - {"self"})
        if unknown:
            raise InvalidInputError(f"codec {cls.codec_id!r} has no option(s) {unknown}; it takes {sorted(set(params) - {'self'})}")
        return cls(**config)

    @classmethod
    def from_file_config(cls, config: dict[str, Any]) -> Codec:
        """Build from a config read from a file.  A codec whose defaults changed maps configs written before
        the change here, so that old files still read as what they are."""
        return cls.from_config(config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.codec_id, repr(sorted(self.get_config().items()))))


def expect_size(data: bytes, expected: int, what: str) -> None:
    """Reject a section whose length is not exactly what its shape implies."""
    if len(data) != expected:
        raise CorruptDataError(f"{what}: section is {len(data)} bytes, its shape needs {expected}")


BACKENDS = ("auto", "cpu", "triton", "nvdec")


def check_backend(codecs: Sequence[Codec], backend: str) -> None:
    """Reject an unknown backend, or one that any of ``codecs`` does not implement."""
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {list(BACKENDS)}, not {backend!r}")
    for codec in codecs:
        if backend != "auto" and backend not in codec.backends:
            raise UnsupportedError(f"codec {codec.codec_id!r} has no {backend!r} backend; it runs on {list(codec.backends)}")
