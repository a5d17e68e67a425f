"""``kvtc``: a transform codec (in the spirit of KVTC, NVIDIA, ICLR 2026) over a per-model calibration.

For each group of layers of the calibration (:mod:`.calibration`) and each chunk of tokens, a token's keys
(rotated back to position 0) and values become one feature vector each; centring, weighting and projecting on
the calibration's PCA basis gives coefficients that are quantized with one uniform step per K/V (the level's),
so that the step means the same attention-logit (keys) or normalized-output (values) error everywhere.  The
symbols are entropy coded exactly as ``cachegen``'s: one table per component per chunk from the frozen
codebook, in lanes that are independent ANS streams (constriction's format, which cachegen's Triton decode
kernel also reads).  In a sliding-window layer a token's step grows with its age in the window (``window_octaves``:
the oldest leave it first).  The first ``sink_tokens`` tokens are stored exactly.  Decoding is a matrix product with
the basis, then the rotary embedding at the tokens' positions.

A frame's layers are coded together (``joint_sections``): the frame's data is one section (SPEC.md §6.7).
"""

from __future__ import annotations

import os
import re
import struct
from typing import Any

import numpy as np
import torch

from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.entropy.lanes import decode_lane, encode_lane, table_runs
from kvcodec.codecs.entropy.sections import SectionBytes
from kvcodec.codecs.entropy.tables import NUM_TABLES, STEPS, choose_tables, step_code
from kvcodec.codecs.kvtc import gpu
from kvcodec.codecs.kvtc.calibration import (Calibration, GroupBasis, calibration_for_model, find_calibration,
                                             register_calibration)
from kvcodec.codecs.kvtc.levels import (DEFAULT_FINE_OCTAVES, DEFAULT_FINE_TOKENS, DEFAULT_LEVEL, DEFAULT_MIN_STD,
                                        DEFAULT_WINDOW_OCTAVES, LEVELS)
from kvcodec.codecs.kvtc.parts import CodedPart
from kvcodec.codecs.kvtc.quantize import quantize
from kvcodec.codecs.kvtc.rate import RETRY_FRACTION, PartPricing, PartSteps, choose_steps
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError, MissingCalibrationError
from kvcodec.formats.v1 import INDEX_ENTRY, frame_head_size
from kvcodec.layouts.paged import check_paged_layer, write_paged
from kvcodec.layouts.sinks import DenseSink, PagedSink

DEAD = 255  # table byte of a component whose symbols are all zero in the chunk: nothing else is stored for it
MAX_LANE_SYMBOLS = 1 << 16
DIGEST = re.compile(r"[0-9a-f]{64}")
OVERRIDE = struct.Struct("<IB")  # component, step code
RATE_HEAD = struct.Struct("<BBI")  # rate mode: a part's step code, lead step code, leading components on the lead
CODES_PER_OCTAVE = 8  # STEPS doubles every 8 codes
TABLES_PER_OCTAVE = 4  # a codebook table's std doubles every 4 tables
MAX_BITS = 16.0  # float16's own rate: asking for more is a mistake, not a rate
# keys' and values' steps keep the levels' ratio (3 at every level): the value code is the key code plus this
VALUE_CODE_OFFSET = int(step_code(LEVELS[DEFAULT_LEVEL][1])) - int(step_code(LEVELS[DEFAULT_LEVEL][0]))


@register_codec
class KVTC(Codec):
    """Cross-layer PCA of pre-RoPE, query-weighted keys and of weighted values; cachegen's entropy coding."""

    codec_id = "kvtc"
    lossless = False
    backends = ("cpu", "triton")  # "triton": lanes, transform and RoPE on the device (kvcodec/codecs/kvtc/gpu.py)
    joint_sections = True
    uses_positions = True

    def __init__(self, level: int | None = None, calibration: Any = "auto", sink_tokens: int = 1,
                 lane_components: int = 64, lane_tokens: int = 256, min_std: float = DEFAULT_MIN_STD,
                 bits: float | None = None, fine_tokens: int = DEFAULT_FINE_TOKENS,
                 fine_octaves: int = DEFAULT_FINE_OCTAVES, window_octaves: float = DEFAULT_WINDOW_OCTAVES) -> None:
        if bits is not None:
            if level is not None:
                raise InvalidInputError("kvtc takes a level or a rate (bits=), not both")
            if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits <= MAX_BITS:
                raise InvalidInputError(f"kvtc bits must be a number of bits per element in (0, {MAX_BITS:g}], "
                                        f"not {bits!r}")
            bits = float(bits)
        elif level is None:
            level = DEFAULT_LEVEL
        if bits is None and (not isinstance(level, int) or isinstance(level, bool) or level not in LEVELS):
            raise InvalidInputError(f"kvtc level must be one of {sorted(LEVELS)}, not {level!r}")
        self.bits = bits
        for name, v, lo, hi in (("sink_tokens", sink_tokens, 0, 1024), ("lane_components", lane_components, 1, 4096),
                                ("lane_tokens", lane_tokens, 1, MAX_LANE_SYMBOLS), ("fine_tokens", fine_tokens, 0, 1024),
                                ("fine_octaves", fine_octaves, 1, 4)):
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise InvalidInputError(f"kvtc {name} must be an integer in {lo}..{hi}, not {v!r}")
        if isinstance(min_std, bool) or not isinstance(min_std, (int, float)) or not 0 <= min_std <= 10:
            raise InvalidInputError(f"kvtc min_std must be a number in 0..10 (a fraction of the step), not {min_std!r}")
        self.min_std = float(min_std)
        if isinstance(window_octaves, bool) or not isinstance(window_octaves, (int, float)) or not 0 <= window_octaves <= 4:
            raise InvalidInputError(f"kvtc window_octaves must be a number in 0..4, not {window_octaves!r}")
        self.window_octaves = float(window_octaves)
        if lane_components * lane_tokens > MAX_LANE_SYMBOLS:
            raise InvalidInputError(f"kvtc lane_components * lane_tokens must be at most {MAX_LANE_SYMBOLS}")
        self.level, self.sink_tokens = level, sink_tokens
        self.fine_tokens, self.fine_octaves = fine_tokens, fine_octaves
        self.lane_components, self.lane_tokens = lane_components, lane_tokens
        self._cal: Calibration | None = None
        if isinstance(calibration, Calibration):
            self._cal = register_calibration(calibration)
            calibration = self._cal.digest
        elif isinstance(calibration, os.PathLike) or (isinstance(calibration, str) and calibration != "auto"
                                                       and not DIGEST.fullmatch(calibration)
                                                       and os.path.isfile(calibration)):
            # a hash always names a calibration, never a file: a container's config names one by hash, and a
            # file of that name in the working directory must not stand in for it unchecked
            self._cal = register_calibration(calibration)
            calibration = self._cal.digest
        elif isinstance(calibration, str) and (os.sep in calibration or calibration.endswith(".kvtc")) \
                and not DIGEST.fullmatch(calibration):
            raise InvalidInputError(f"kvtc calibration file {calibration} does not exist")
        elif not (isinstance(calibration, str) and (calibration == "auto" or DIGEST.fullmatch(calibration))):
            raise InvalidInputError("kvtc calibration must be 'auto', a calibration's SHA-256, a calibration file "
                                    f"or a Calibration, not {calibration!r}")
        self.calibration = calibration

    @classmethod
    def presets(cls) -> list[dict[str, Any]]:
        return [{"level": level} for level in sorted(LEVELS)]

    def get_config(self) -> dict[str, Any]:
        config = ({"level": self.level} if self.bits is None else {"bits": self.bits}) | {
            "calibration": self.calibration, "sink_tokens": self.sink_tokens,
            "lane_components": self.lane_components, "lane_tokens": self.lane_tokens}
        # 0 (every component coded; no fine tokens) is what files written before the options meant, and they name
        # neither
        return (config | ({"min_std": self.min_std} if self.min_std else {})
                | ({"fine_tokens": self.fine_tokens, "fine_octaves": self.fine_octaves} if self.fine_tokens else {})
                | ({"window_octaves": self.window_octaves} if self.window_octaves else {}))

    @classmethod
    def from_file_config(cls, config: dict[str, Any]) -> Codec:
        if not (isinstance(config.get("calibration"), str) and DIGEST.fullmatch(config["calibration"])):
            raise InvalidInputError("a kvtc container must name its calibration by SHA-256")
        # written before the options existed: every component coded, no fine tokens, no window grading
        return cls.from_config({"min_std": 0.0, "fine_tokens": 0, "window_octaves": 0.0} | config)

    def for_cache(self, kv: Any) -> KVTC:
        """This codec with its calibration resolved for ``kv`` (``"auto"``: the one installed for its model, found by
        the model's identity ``kv.model_digest`` where ``kv`` has one, else by its name ``kv.model``)."""
        if self.calibration != "auto":
            return self
        digest = getattr(kv, "model_digest", None)
        cal = calibration_for_model(digest) if digest else None
        if cal is None:
            cal = calibration_for_model(kv.model)
            if cal is not None and digest and cal.model_digest not in ("", digest):
                cal = None  # recorded for another model that has the same name
        if cal is None:
            raise InvalidInputError(
                f"kvtc needs a calibration of model {kv.model!r}" + (f" (identity {digest})" if digest else "")
                + ": run `kvcodec calibrate --model MODEL --install` (or -o FILE and pass calibration=FILE)")
        return KVTC(self.level, cal, self.sink_tokens, self.lane_components, self.lane_tokens, self.min_std, self.bits,
                    self.fine_tokens, self.fine_octaves, self.window_octaves)

    @classmethod
    def needs_model(cls, config: dict[str, Any]) -> bool:
        return config.get("calibration", "auto") == "auto"

    def rotary(self) -> list[Any]:
        return [l.rotary for l in self.calibration_data().layers]

    @classmethod
    def installed_rotary(cls, model: str | None) -> list[Any] | None:
        cal = calibration_for_model(model)
        return None if cal is None else [l.rotary for l in cal.layers]

    def side_data_name(self) -> str | None:
        return None if self.calibration == "auto" else f"kvcodec-calibration@{self.calibration}"

    def side_data(self) -> bytes:
        return self.calibration_data().to_bytes()

    def has_side_data(self) -> bool:
        try:
            self.calibration_data()
            return True
        except MissingCalibrationError:
            return False

    def install_side_data(self, data: bytes) -> None:
        register_calibration(Calibration.from_bytes(bytes(data), self.calibration))

    def calibration_data(self) -> Calibration:
        if self._cal is None:
            if self.calibration == "auto":
                raise InvalidInputError("kvtc's calibration is not resolved (encode through kvcodec.encode)")
            self._cal = find_calibration(self.calibration)
        return self._cal

    # --- the per-section interface does not apply: kvtc codes whole frames ----------------

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        return self.encode_frame([(keys, values)], [ctx])

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_frame(data, [ctx], {ctx.layer})[ctx.layer]

    # --- frames ------------------------------------------------------------------------------

    def _groups(self, ctxs: list[LayerContext]) -> list[tuple[int, list[LayerContext]]]:
        """The calibration groups the frame's layers (those holding tokens) make up, in order."""
        cal = self.calibration_data()
        by_layer = {c.layer: c for c in ctxs}
        if ctxs and ctxs[0].num_layers != len(cal.layers):
            raise InvalidInputError(f"kvtc calibration {self.calibration[:12]} is for {len(cal.layers)} layers, "
                                    f"the cache has {ctxs[0].num_layers}")
        out = []
        for g, members in enumerate(cal.groups):
            present = [by_layer[l] for l in members if l in by_layer]
            if not present:
                continue
            if len(present) != len(members) or len({(c.token_start, c.shape.tokens) for c in present}) != 1:
                raise InvalidInputError(f"kvtc codes layers {members} together: a chunk must hold all of them over "
                                        "the same tokens (use chunk_layers that keeps the calibration's groups whole)")
            for c in present:
                info = cal.layers[c.layer]
                if (c.shape.heads, c.shape.key_dim, c.shape.value_dim) != (info.heads, info.key_dim, info.value_dim):
                    raise InvalidInputError(f"layer {c.layer}'s shape does not match kvtc calibration {self.calibration[:12]}")
            out.append((g, present))
        if sum(len(p) for _, p in out) != len(ctxs):
            raise InvalidInputError("kvtc: a layer of the chunk is in no calibration group")
        return out

    def encode_frame(self, layers: list[tuple[torch.Tensor, torch.Tensor]], ctxs: list[LayerContext]) -> bytes:
        tensors = {c.layer: pair for pair, c in zip(layers, ctxs)}
        groups = [(g, self._features(g, [(tensors[c.layer], c) for c in present])) for g, present in self._groups(ctxs)]
        if self.bits is not None:
            elements = sum(c.shape.heads * c.shape.tokens * (c.shape.key_dim + c.shape.value_dim) for c in ctxs)
            # the frame's own head and its index entry count too, as every byte of a container does
            blocks = self._rate_blocks(groups, self.bits * elements / 8 - frame_head_size(len(ctxs)) - INDEX_ENTRY.size)
        else:
            cal = self.calibration_data()
            blocks = []
            for g, (kx, vx, sinks) in groups:
                fine, normal = self.fine_rows(kx, vx, self._head_dims(g))
                parts = [self._level_part(x[normal], gb, step)
                         for x, gb, step in zip((kx, vx), (cal.keys[g], cal.values[g]), LEVELS[self.level])]
                blocks.append(self._block(fine, (kx, vx), (cal.keys[g], cal.values[g]), parts, sinks))
        return b"".join([struct.pack(f"<{len(blocks)}I", *map(len, blocks))] + blocks)

    def decode_frame(self, data: bytes, ctxs: list[LayerContext], wanted: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        blocks = self.group_blocks(data, ctxs, wanted)
        if self._on_device(ctxs[0], ctxs[0].device):
            sink = DenseSink(device=ctxs[0].device, dtype=ctxs[0].dtype)
            self._decode_on_device(blocks, wanted, sink)
            return {c.layer: sink.layer(c.layer) for c in ctxs if c.layer in wanted}
        out = {}
        for g, present, block in blocks:
            out |= self._decode_group(g, present, block, wanted)
        return out

    def decode_frame_paged(self, data: bytes, ctxs: list[LayerContext], paged: dict[int, torch.Tensor],
                           slots: dict[int, torch.Tensor], layout: Any = "flash") -> None:
        """Decode the layers of a frame named in ``paged`` (layer: that layer's paged tensor) into paged memory:
        token ``t`` of layer ``l``'s section goes to flat slot ``slots[l][t]`` (see :meth:`decode_layer_paged`)."""
        by_layer = {c.layer: c for c in ctxs}
        if not paged or not set(paged) <= set(by_layer) or set(slots) != set(paged):
            raise InvalidInputError("kvtc paged decode: paged tensors and slots must name the same layers of the frame")
        slots = {l: check_paged_layer(paged[l], by_layer[l].shape, slots[l], layout) for l in paged}
        first = next(iter(paged.values()))
        if self._on_device(ctxs[0], first.device):
            # decoded in the memory's dtype: each float32 row is rounded once, as on the CPU path
            sink = DenseSink(device=first.device, dtype=first.dtype)
            self._decode_on_device(self.group_blocks(data, ctxs, set(paged)), set(paged), sink)
            decoded = {l: sink.layer(l) for l in paged}
        else:
            decoded = self.decode_frame(data, ctxs, set(paged))
        for layer, (keys, values) in decoded.items():
            on = paged[layer].device
            write_paged(paged[layer], keys.to(on), values.to(on), slots[layer], layout)

    def decode_layer_paged(self, data: bytes, ctx: LayerContext, paged: torch.Tensor, slots: torch.Tensor,
                           layout: Any = "flash") -> None:
        self.decode_frame_paged(data, [ctx], {ctx.layer: paged}, {ctx.layer: slots}, layout)

    def _on_device(self, ctx: LayerContext, dev: torch.device) -> bool:
        """Whether the Triton path decodes (``"auto"``: for CUDA tensors), as cachegen chooses its engine."""
        return ctx.backend == "triton" or (ctx.backend == "auto" and dev.type == "cuda")

    def _decode_on_device(self, blocks: list[tuple[int, list[LayerContext], memoryview]], wanted: set[int],
                          sink: DenseSink | PagedSink) -> None:
        """Decode the wanted layers of the groups ``blocks`` (:meth:`group_blocks`) on ``sink``'s device
        (:mod:`.gpu`) and write each, all its tokens at once, into ``sink``."""
        if not blocks:
            return
        cal = self.calibration_data()
        device = sink.device
        parsed = [self.parse_group(g, present, block) for g, present, block in blocks]
        launch = gpu.CoefficientLaunch(self, [p for parts, _, _ in parsed for p in parts], device)
        launch.run()
        coefficients = iter(launch.coefficients)
        exact = gpu.sink_tokens([s for _, sinks, _ in parsed for layer in sinks for s in layer], device)
        for (g, present, _), (parts, _, fine) in zip(blocks, parsed):
            spans, cover = self.spans(present, wanted)
            coded = [next(coefficients) for _ in parts]  # keys, values, then their fine parts
            feats = []
            gains = self.row_gains(present[0])
            for side in (0, 1):
                rows, mean, weight = gpu.BASES.get(cal, g, side, len(parts[side].table), device)
                feats.append(self.side_features(coded[side::2], rows, mean, weight, cover[side], fine, gains))
            keys, values = {}, {}
            for c in present:
                if c.layer in wanted:
                    keys[c.layer], values[c.layer] = (
                        f[:, span.start - at:span.stop - at].reshape(f.shape[0], c.shape.heads, d)
                        for (f, at), span, d in zip(feats, spans[c.layer], (c.shape.key_dim, c.shape.value_dim)))
            keys |= gpu.rotate(keys, {c.layer: (cal.layers[c.layer].rotary, c.positions[self._sinks(c):])
                                      for c in present if c.layer in wanted and self._rotated(c)})
            for c in present:
                pair = (next(exact), next(exact))
                if c.layer in wanted:  # [H, S, D] exact sink tokens, then the [T - S, H, D] decoded rows
                    sink.write(c.layer, 0, *(torch.cat([x, rows.transpose(0, 1)], 1)
                                             for x, rows in zip(pair, (keys[c.layer], values[c.layer]))))

    def group_blocks(self, data: bytes, ctxs: list[LayerContext],
                     wanted: set[int]) -> list[tuple[int, list[LayerContext], memoryview]]:
        """The section cut into its groups' blocks: ``(group, its layers, block)`` of each group with a wanted
        layer."""
        groups = self._groups(ctxs)
        reader = SectionBytes(memoryview(data))
        lengths = reader.take(len(groups), "<u4").astype(np.int64)
        if reader.pos + int(lengths.sum()) != len(data):
            raise CorruptDataError("kvtc section's group lengths do not add up to its length")
        out = []
        pos = reader.pos
        for (g, present), n in zip(groups, lengths):
            if any(c.layer in wanted for c in present):
                out.append((g, present, memoryview(data)[pos:pos + int(n)]))
            pos += int(n)
        return out

    # --- one group --------------------------------------------------------------------------

    def row_gains(self, ctx: LayerContext) -> torch.Tensor | None:
        """Per coded row of ``ctx``'s group (the ``T - S`` tokens after the sink tokens), the factor on its step:
        in a sliding-window layer ``2 ** (window_octaves * age / W)``, ``W`` the layer's ``window_tokens`` and
        ``age`` the token's distance from the newest (computed in binary64, rounded to float32; spec/kvtc.md,
        "Window grading").  None for layers holding every token, or with grading off.  A window's oldest tokens
        leave it first and draw less attention from the next queries, so their error costs less loss
        (:data:`~kvcodec.codecs.kvtc.levels.DEFAULT_WINDOW_OCTAVES`)."""
        if not (ctx.window_tokens and self.window_octaves):
            return None
        index = np.arange(ctx.token_start + self._sinks(ctx), ctx.token_start + ctx.shape.tokens, dtype=np.float64)
        return torch.from_numpy(np.exp2(self.window_octaves * (ctx.window_tokens - 1 - index) / ctx.window_tokens)
                                .astype(np.float32))

    def _sinks(self, ctx: LayerContext) -> int:
        return max(0, min(self.sink_tokens - ctx.token_start, ctx.shape.tokens))

    def _rotated(self, ctx: LayerContext) -> bool:
        """Whether this layer's keys carry the rotary embedding (to be undone before the transform)."""
        return ctx.rope != "pre" and self.calibration_data().layers[ctx.layer].rotary is not None

    def _features(self, g: int, items: list[tuple[tuple[torch.Tensor, torch.Tensor], LayerContext]]
                  ) -> tuple[torch.Tensor, torch.Tensor, list[bytes]]:
        """A group's key and value feature rows ``[T - S, F]`` (keys rotated back to position 0), each row's
        deviation from the basis mean divided by its :meth:`row_gains`, and its layers' sink blocks.  Fine rows are
        then chosen among the graded rows: choosing them before grading left Gemma 3 270M's KL at 0.0131 against
        0.0103 (``bits=1.0``, three evaluation texts)."""
        cal = self.calibration_data()
        ctx0 = items[0][1]
        s = self._sinks(ctx0)
        kfeat, vfeat, sinks = [], [], []
        for (k, v), ctx in items:
            k32, v32 = k.detach().cpu().float(), v.detach().cpu().float()
            if not (torch.isfinite(k32).all() and torch.isfinite(v32).all()):
                raise InvalidInputError("kvtc cannot encode non-finite values (NaN or inf)")
            sinks += [k32[:, :s].numpy().astype("<f2").tobytes(), v32[:, :s].numpy().astype("<f2").tobytes()]
            if self._rotated(ctx):
                k32 = cal.layers[ctx.layer].rotary.rotate(k32, ctx.positions_tensor(), inverse=True)
            # widths spelled out: a chunk of sink tokens only has no other tokens, and -1 cannot size an empty row
            kfeat.append(k32[:, s:].permute(1, 0, 2).reshape(k32.shape[1] - s, k32.shape[0] * k32.shape[2]))
            vfeat.append(v32[:, s:].permute(1, 0, 2).reshape(v32.shape[1] - s, v32.shape[0] * v32.shape[2]))
        kx, vx = torch.cat(kfeat, 1), torch.cat(vfeat, 1)
        gains = self.row_gains(ctx0)
        if gains is not None:
            kx, vx = ((x - gb.mean) / gains[:, None] + gb.mean for x, gb in ((kx, cal.keys[g]), (vx, cal.values[g])))
        return kx, vx, sinks

    def _coded(self, gb: GroupBasis, step: float) -> int:
        """How many leading components of ``gb`` are coded: those whose calibration std is at least ``min_std``
        steps (the basis is sorted by variance, so they lead).  A component with a smaller std rounds to zero
        nearly everywhere, so leaving it out costs about the error its quantization would leave, and saves its
        share of the matrix products, which dominate kvtc's time."""
        return int((gb.variance.sqrt() >= self.min_std * step).sum())

    def coded_components(self) -> list[tuple[int, int]]:
        """Per calibration group, how many key and value components this codec codes (see :meth:`_coded`); at a
        rate (``bits``) the steps, and so the count, are chosen per chunk: at most every component of the basis."""
        cal = self.calibration_data()
        if self.bits is not None:
            return [(k.components, v.components) for k, v in zip(cal.keys, cal.values)]
        key_step, value_step = LEVELS[self.level]
        return [(self._coded(k, key_step), self._coded(v, value_step)) for k, v in zip(cal.keys, cal.values)]

    @staticmethod
    def _project(weighted: torch.Tensor, gb: GroupBasis, start: int, stop: int) -> np.ndarray:
        """Weighted, centred feature rows ``[T, F]`` on components ``[start, stop)``: ``[stop - start, T]`` (float64)."""
        return (weighted @ gb.rows32[start:stop].T).T.numpy().astype(np.float64)

    def _level_part(self, x: torch.Tensor, gb: GroupBasis, step: float) -> tuple[bytes, np.ndarray, np.ndarray]:
        k = self._coded(gb, step)
        codes, q = quantize(self._project((x - gb.mean) * gb.weight, gb, 0, k), np.full(k, step_code(step), np.int64))
        # the first component's code is the base, every other code an override (as files have always had it)
        return self._part_bytes(q, codes, b"", codes[0] if k else 0, codes[0] if k else 0)

    def _rate_part(self, part: PartPricing, gb: GroupBasis, steps: PartSteps) -> tuple[bytes, np.ndarray, np.ndarray]:
        k = max(steps.m, self._coded(gb, float(STEPS[steps.code])))
        nominal = np.where(np.arange(k) < steps.m, steps.lead, steps.code)
        codes, q = quantize(part.coefficients(k), nominal)
        return self._part_bytes(q, codes, RATE_HEAD.pack(steps.code, steps.lead, steps.m), nominal, None)

    def _part_bytes(self, q: np.ndarray, codes: np.ndarray, head: bytes, nominal: Any,
                    base: int | None) -> tuple[bytes, np.ndarray, np.ndarray]:
        """A part from its symbols ``[K, T]`` and each component's step code: ``head``, the tables, the base code
        (level mode only), the codes that differ from ``nominal`` as overrides, then the lanes; with its tables
        and codes (a fine part's are made from them)."""
        live = np.flatnonzero(np.any(q != 0, axis=1))
        table = np.full(q.shape[0], DEAD, np.uint8)
        table[live] = choose_tables(q[live])
        base_code = b"" if base is None else struct.pack("<B", int(base))
        return head + table.tobytes() + base_code + self._coded_symbols(q, codes, nominal, table), table, codes

    def _coded_symbols(self, q: np.ndarray, codes: np.ndarray, nominal: Any, table: np.ndarray) -> bytes:
        """The overrides (the live components' codes that differ from ``nominal``), the lane lengths and the lanes."""
        lanes, lengths = [], []
        for runs in self._plan(np.flatnonzero(table != DEAD), q.shape[1], table):
            words = encode_lane([(r.gather(q), r.table) for r in runs])
            lanes.append(words.astype("<u4").tobytes())
            lengths.append(len(words))
        overrides = [OVERRIDE.pack(int(c), int(codes[c])) for c in np.flatnonzero(codes != nominal) if table[c] != DEAD]
        return (struct.pack("<I", len(overrides)) + b"".join(overrides) + np.array(lengths, "<u2").tobytes()
                + b"".join(lanes))

    # --- fine tokens --------------------------------------------------------------------------

    def fine_rows(self, keys: torch.Tensor, values: torch.Tensor, dims: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The rows (of a group's ``[T - S, F]`` key and value features; ``dims``: a head's key and value sizes)
        coded at the finer steps, and the others, both increasing.

        Attention sinks past the first token (a "the", a space: tokens that many later queries attend to and that
        add next to nothing) draw much of the attention a prefix receives, so their error weighs that much more
        than another token's.  In some layer and head their value, and in models without a key norm their key,
        is far smaller than the chunk's usual one: the rows taken are those with the smallest product of two
        ratios, a row's smallest (over the group's layers and heads) key norm to the chunk's median key norm of
        that layer and head, and the same of values (the rotation undone leaves key norms as they are).  Per
        256-token chunk the two rows this takes drew 32% of the continuation's attention on SmolLM2 and 45% on
        Gemma 3, besides the first token's, where an oracle knowing the attention takes 38% and 46%
        (bench/studies/results/kvtc_fine_tokens-*.md)."""
        rows = keys.shape[0]
        n = min(self.fine_tokens, rows)
        if not n:
            return np.zeros(0, np.int64), np.arange(rows)
        score = torch.ones(rows)
        for x, dim in zip((keys, values), dims):
            norms = x.reshape(rows, -1, dim).norm(dim=2)
            score *= (norms / norms.median(0).values.clamp_min(torch.finfo(torch.float32).tiny)).amin(1)
        # the file names a row in a u16: in a chunk of more rows, the sinks are looked for among the first 65,536
        fine = np.sort(np.argsort(score[:1 << 16].numpy(), kind="stable")[:n])
        return fine, np.setdiff1d(np.arange(rows), fine)

    def _head_dims(self, g: int) -> tuple[int, int]:
        """A head's key and value sizes in group ``g`` (one kind of layer: the same in all its layers)."""
        info = self.calibration_data().layers[self.calibration_data().groups[g][0]]
        return info.key_dim, info.value_dim

    def _fine_tables(self, table: np.ndarray) -> np.ndarray:
        """A fine part's tables: the normal part's, as many octaves wider as its steps are finer (dead stays dead)."""
        return np.where(table == DEAD, DEAD,
                        np.minimum(table.astype(np.int64) + TABLES_PER_OCTAVE * self.fine_octaves, NUM_TABLES - 1)
                        ).astype(np.uint8)

    def _fine_codes(self, codes: np.ndarray) -> np.ndarray:
        """A fine part's nominal step codes: its part's (after overrides), ``fine_octaves`` finer."""
        return np.maximum(codes - CODES_PER_OCTAVE * self.fine_octaves, 0)

    def _fine_part(self, x: torch.Tensor, gb: GroupBasis, table: np.ndarray, codes: np.ndarray) -> bytes:
        """The fine rows ``x`` on the normal part's live components, at its steps made ``fine_octaves`` finer; no
        tables (they follow from the normal part's), only overrides, lane lengths and lanes."""
        nominal = self._fine_codes(codes)
        coeff = self._project((x - gb.mean) * gb.weight, gb, 0, len(table))
        coeff[table == DEAD] = 0  # the normal tokens' dead components are dead for these too
        fine_codes, q = quantize(coeff, nominal)
        return self._coded_symbols(q, fine_codes, nominal, self._fine_tables(table))

    def _block(self, fine: np.ndarray, features: tuple[torch.Tensor, torch.Tensor],
               bases: tuple[GroupBasis, GroupBasis], parts: list[tuple[bytes, np.ndarray, np.ndarray]],
               sinks: list[bytes]) -> bytes:
        """A group's block: the fine rows' list (with fine tokens on), the keys and values parts, their fine parts,
        the sinks."""
        head = struct.pack(f"<H{len(fine)}H", len(fine), *fine) if self.fine_tokens else b""
        fine_parts = [self._fine_part(x[fine], gb, table, codes) for x, gb, (_, table, codes)
                      in zip(features, bases, parts)] if len(fine) else []
        return b"".join([head] + [p for p, _, _ in parts] + fine_parts + sinks)

    def _rate_blocks(self, groups: list[tuple[int, tuple[torch.Tensor, torch.Tensor, list[bytes]]]],
                     target: float) -> list[bytes]:
        """The groups' blocks coded at the rate asked for (:mod:`.rate`): the section's bytes (its group lengths,
        parts, fine parts and sink blocks) come within the search's resolution of ``target``, unless that is out
        of reach for this frame (then the nearest the step codes allow).  A part's fine part is priced with it."""
        cal = self.calibration_data()
        fines = [self.fine_rows(kx, vx, self._head_dims(g)) for g, (kx, vx, _) in groups]
        items = [(x[normal], x[fine], gb) for (g, (kx, vx, _)), (fine, normal) in zip(groups, fines)
                 for x, gb in ((kx, cal.keys[g]), (vx, cal.values[g]))]
        shift = CODES_PER_OCTAVE * self.fine_octaves

        def pricing(x: torch.Tensor, gb: GroupBasis, offset: int, count: Any, rider: PartPricing | None = None,
                    tables: bool = True) -> PartPricing:
            return PartPricing(lambda a, b, w=(x - gb.mean) * gb.weight: self._project(w, gb, a, b), x.shape[0],
                               gb.variance.sqrt().double().numpy(), count, offset, self.lane_components,
                               self.lane_tokens, rider, shift, tables)

        parts = []
        for i, (x, xf, gb) in enumerate(items):
            count = lambda code, gb=gb: self._coded(gb, float(STEPS[code]))  # noqa: E731
            # a fine part codes its part's components: as many as the part's (coarser) code gives
            rider = pricing(xf, gb, VALUE_CODE_OFFSET * (i % 2) - shift,
                            lambda code, count=count: count(min(code + shift, 255)), tables=False) if len(xf) else None
            parts.append(pricing(x, gb, VALUE_CODE_OFFSET * (i % 2), count, rider))
        fixed = 4 * len(groups) + sum(len(b) for _, (_, _, sinks) in groups for b in sinks)

        def code(steps: list[PartSteps]) -> list[bytes]:
            out = [self._rate_part(p, gb, st) for p, (_, _, gb), st in zip(parts, items, steps)]
            return [self._block(fine, (kx, vx), (cal.keys[g], cal.values[g]), out[2 * i:2 * i + 2], sinks)
                    for i, ((g, (kx, vx, sinks)), (fine, _)) in enumerate(zip(groups, fines))]

        steps, estimate, out_of_reach = choose_steps(parts, fixed, target)
        blocks = code(steps)
        actual = 4 * len(groups) + sum(map(len, blocks))
        if not out_of_reach and abs(actual - target) > RETRY_FRACTION * target:
            # the estimate's own error (lane flushes, the ANS coder's rounding) is nearly the same at the next
            # choice: aim that much off the target, once
            steps, _, _ = choose_steps(parts, fixed, target - (actual - estimate))
            blocks = code(steps)
        return blocks

    def _plan(self, live: np.ndarray, tokens: int, table: np.ndarray) -> list[list[Any]]:
        """Lanes of ``lane_components`` live components by ``lane_tokens`` tokens, one run per table (as cachegen's)."""
        return [table_runs("q", live[c0:c0 + self.lane_components], slice(t0, min(t0 + self.lane_tokens, tokens)),
                            min(t0 + self.lane_tokens, tokens) - t0, table)
                for c0 in range(0, len(live), self.lane_components) for t0 in range(0, tokens, self.lane_tokens)]

    def parse_group(self, g: int, present: list[LayerContext],
                    data: memoryview) -> tuple[list[CodedPart], list[list[np.ndarray]], np.ndarray]:
        """A group's block as parsed: its keys and values parts (then, with fine rows, their fine parts), per layer
        its sink keys and values (float16 ``[H, S, D]``), and its fine rows (increasing)."""
        cal = self.calibration_data()
        t, s = present[0].shape.tokens, self._sinks(present[0])
        reader = SectionBytes(data)
        fine = np.zeros(0, np.int64)
        if self.fine_tokens:
            (n,) = struct.unpack("<H", reader.take(2, "u1").tobytes())
            fine = reader.take(n, "<u2").astype(np.int64)
            if n > min(self.fine_tokens, t - s) or np.any(np.diff(fine) <= 0) or (n and fine[-1] >= t - s):
                raise CorruptDataError(f"kvtc group's {n} fine rows are not distinct rows of its {t - s} in order")
        steps = (None, None) if self.bits is not None else LEVELS[self.level]
        parts = [self._parse_part(reader, gb, step, t - s - len(fine))
                 for gb, step in zip((cal.keys[g], cal.values[g]), steps)]
        if len(fine):
            parts += [self._parse_fine(reader, part, len(fine)) for part in parts]
        sinks = []
        for c in present:
            h = c.shape.heads
            sinks.append([reader.take(h * s * d, "<f2").reshape(h, s, d) for d in (c.shape.key_dim, c.shape.value_dim)])
        if reader.pos != len(data):
            raise CorruptDataError(f"kvtc group has {len(data) - reader.pos} bytes too many")
        return parts, sinks, fine

    @staticmethod
    def spans(present: list[LayerContext],
              wanted: set[int]) -> tuple[dict[int, tuple[slice, slice]], tuple[slice, slice]]:
        """Each layer's key and value feature columns in its group, and the columns that cover the wanted layers
        (one product covers them all)."""
        spans = {}
        k_off = v_off = 0
        for c in present:
            h = c.shape.heads
            spans[c.layer] = (slice(k_off, k_off + h * c.shape.key_dim), slice(v_off, v_off + h * c.shape.value_dim))
            k_off, v_off = spans[c.layer][0].stop, spans[c.layer][1].stop
        cover = tuple(slice(min(spans[l][i].start for l in wanted if l in spans),
                            max(spans[l][i].stop for l in wanted if l in spans)) for i in range(2))
        return spans, cover  # type: ignore[return-value]

    def _decode_group(self, g: int, present: list[LayerContext], data: memoryview,
                      wanted: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        cal = self.calibration_data()
        ctx0 = present[0]
        t, s = ctx0.shape.tokens, self._sinks(ctx0)
        # (coefficients, basis) of the components up to the last one live in this chunk only: at the default level
        # most of the basis is dead in any one chunk
        coded, sinks, fine = self.parse_group(g, present, data)
        bases = (cal.keys[g], cal.values[g])
        spans, cover = self.spans(present, wanted)
        gains = self.row_gains(ctx0)
        feats = [self.side_features([self.coefficients(p) for p in coded[side::2]], bases[side].rows32,
                                    bases[side].mean, bases[side].weight, cover[side], fine, gains) for side in (0, 1)]
        out = {}
        for c, sink in zip(present, sinks):
            if c.layer in wanted:
                k, v = (f[:, span.start - at:span.stop - at].view(t - s, c.shape.heads, d).transpose(0, 1)
                        for (f, at), span, d in zip(feats, spans[c.layer], (c.shape.key_dim, c.shape.value_dim)))
                if self._rotated(c):
                    # a layer at a time: Rotary.rotate works a few heads at a time on a CPU anyway, and the group's
                    # keys need not be gathered first
                    k = cal.layers[c.layer].rotary.rotate(k, c.positions_tensor()[s:])
                # [H, S, D] exact sink tokens, then the [H, T - S, D] rows: each float32 row rounded once to the
                # header dtype as it is copied into place
                out[c.layer] = tuple(self._layer_tensor(exact, rows, c) for exact, rows in zip(sink, (k, v)))
        return out

    @staticmethod
    def _layer_tensor(exact: np.ndarray, rows: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """A layer's keys or values ``[H, T, D]`` in its dtype: the sink tokens ``exact`` (float16 ``[H, S, D]``),
        then the decoded ``rows`` (``[H, T - S, D]``)."""
        h, s, d = exact.shape
        out = torch.empty(h, s + rows.shape[1], d, dtype=ctx.dtype)
        out[:, :s] = torch.from_numpy(exact.astype(np.float16))
        out[:, s:] = rows
        return out.to(ctx.device)

    def side_features(self, coefficients: list[torch.Tensor], rows: torch.Tensor, mean: torch.Tensor,
                      weight: torch.Tensor, cols: slice, fine: np.ndarray,
                      gains: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Features ``cols`` of one side (keys or values) of a group, ``[T - S, cols]``, from its parts'
        coefficients (the normal part's, then with ``fine`` rows the fine part's, each ``[rows, span]`` on the
        same live components) and the basis ``rows`` (at least ``span`` of them); and where they start.  The
        coefficients are put back in token order first, so that one matrix product covers every row.  ``gains``
        (:meth:`row_gains`) scale each row's coefficients."""
        normal, *rest = coefficients
        span = normal.shape[1]
        coeff = normal
        if rest:
            # fine rows are few: the normal rows between them are whole blocks, copied once
            pieces, at = [], 0
            for i, row in enumerate(fine.tolist()):
                pieces += [normal[at:row - i], rest[0][i:i + 1]]
                at = row - i
            coeff = torch.cat(pieces + [normal[at:]])
        if gains is not None:
            coeff = coeff * gains.to(coeff.device)[:, None]
        return self.features(coeff, rows[:span], mean, weight, cols)

    def _parse_part(self, reader: SectionBytes, gb: GroupBasis, step: float | None, t: int) -> CodedPart:
        """One part's header and lanes, every count checked against the codec and the calibration; ``step``: the
        level's, None at a rate (the part's header names its step codes)."""
        if step is None:
            code, lead, m = RATE_HEAD.unpack(reader.take(RATE_HEAD.size, "u1").tobytes())
            if m > gb.components:
                raise CorruptDataError(f"kvtc part codes {m} leading components; its basis has {gb.components}")
            k = max(m, self._coded(gb, float(STEPS[code])))
            table = reader.take(k, "u1")
            (n_over,) = struct.unpack("<I", reader.take(4, "u1").tobytes())
            codes = np.where(np.arange(k) < m, lead, code).astype(np.int64)
        else:
            k = self._coded(gb, step)
            table = reader.take(k, "u1")
            base, n_over = struct.unpack("<BI", reader.take(5, "u1").tobytes())
            codes = np.full(k, base, np.int64)
        live = np.flatnonzero(table != DEAD)
        if int(table[live].max(initial=0)) >= NUM_TABLES:
            raise CorruptDataError("kvtc part names a table outside the codebook")
        return self._read_symbols(reader, table, codes, live, n_over, t)

    def _read_symbols(self, reader: SectionBytes, table: np.ndarray, codes: np.ndarray, live: np.ndarray,
                      n_over: int, t: int) -> CodedPart:
        """A part's overrides (applied to ``codes``), lane lengths and lanes, after its count of overrides."""
        if n_over > len(live):
            raise CorruptDataError("kvtc part has more step overrides than live components")
        for comp, code in OVERRIDE.iter_unpack(reader.take(n_over * OVERRIDE.size, "u1").tobytes()):
            if comp >= len(table) or table[comp] == DEAD:
                raise CorruptDataError("kvtc step override names a component that is not coded")
            codes[comp] = code
        lanes = -(-len(live) // self.lane_components) * -(-t // self.lane_tokens)  # as many as _plan makes
        lengths = reader.take(lanes, "<u2").astype(np.int64)
        return CodedPart(t, table, codes, live, lengths, reader.take(int(lengths.sum()), "<u4"))

    def _parse_fine(self, reader: SectionBytes, part: CodedPart, n: int) -> CodedPart:
        """A fine part of ``n`` rows after its normal ``part``: that part's live components, its tables as many
        octaves wider and its codes as many octaves finer as nominal, then overrides and lanes as a part's."""
        table, codes = self._fine_tables(part.table), self._fine_codes(part.codes)
        (n_over,) = struct.unpack("<I", reader.take(4, "u1").tobytes())
        return self._read_symbols(reader, table, codes, part.live, n_over, n)

    def coefficients(self, part: CodedPart) -> torch.Tensor:
        """A part's dequantized coefficients ``[T, part.span]`` float32, its lanes decoded on the CPU."""
        q = np.zeros((len(part.table), part.tokens), np.int32)
        offsets = np.concatenate([[0], np.cumsum(part.lengths)]).tolist()
        lc, lt, t = self.lane_components, self.lane_tokens, part.tokens
        # _plan's lanes, planned for the whole part at once (a plan per lane was a tenth of the CPU decode's own
        # Python time): per block of lc live components, the components by table (ties in order), one run per table
        block = np.arange(len(part.live)) // lc
        order = part.live[np.lexsort((part.table[part.live], block))]
        tables = part.table[order].astype(np.int64)
        starts = np.flatnonzero(np.diff(block * 256 + tables, prepend=-1)).tolist() + [len(order)]
        runs = [(a, b, int(tables[a])) for a, b in zip(starts, starts[1:])]
        j = 0
        for c0 in range(0, len(order), lc):
            rows = order[c0:c0 + lc]
            mine = [(a - c0, b - c0, table) for a, b, table in runs if c0 <= a < c0 + lc]
            for t0 in range(0, t, lt):
                width = min(lt, t - t0)
                symbols = decode_lane(part.words[offsets[j]:offsets[j + 1]].astype(np.uint32),
                                      [((b - a) * width, table) for a, b, table in mine])
                # the lane's runs, row-major each, are its rows (in run order) by its tokens
                q[rows, t0:t0 + width] = np.concatenate(symbols).reshape(len(rows), width)
                j += 1
        # |q| <= 255 and a float32 step: the float32 product is the exact product rounded once
        # up to the last live component: the basis rows are then a view (no copy), and dead components before
        # it contribute zeros
        n = part.span
        out = np.empty((part.tokens, n), np.float32)
        np.multiply(q[:n].T, STEPS[part.codes[:n]], out=out, dtype=np.float32, casting="unsafe")  # one pass
        return torch.from_numpy(out)

    @staticmethod
    def features(coeff: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor, weight: torch.Tensor,
                 cols: slice) -> tuple[torch.Tensor, int]:
        """Features ``cols`` of the group ``[T, cols]`` back from live coefficients and their basis rows
        (``coeff @ rows[:, cols] / weight + mean``), and where they start; on the tensors' device."""
        if not coeff.shape[0]:
            return torch.zeros(0, cols.stop - cols.start, device=coeff.device), cols.start
        product = coeff @ rows[:, cols]
        return torch.addcdiv(mean[cols], product, weight[cols], out=product), cols.start  # in place: one pass
