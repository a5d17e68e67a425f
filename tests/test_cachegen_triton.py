"""cachegen's Triton kernels against its CPU path, on slices of real SmolLM2 KV.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which is slow: the shapes are small, and the lanes short
(the interpreter's time grows with the symbols per lane, not with the lanes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import kvcodec  # noqa: E402
from kvcodec.chunking import layer_context  # noqa: E402
from kvcodec.layouts.paged import empty_shape, read_paged, slot_mapping  # noqa: E402

SMALL_LANES = dict(lane_channels=8, lane_tokens=8)


@pytest.fixture(scope="module")
def tiny(real_kv):
    """Two real layers (shallow and deep), 40 tokens: two chunks of 24 and 16, the first with the sink."""
    return kvcodec.KVCache([(l.keys[:, :40], l.values[:, :40]) for l in (real_kv.layers[0], real_kv.layers[20])],
                           model=real_kv.model)


def _encode(kv, backend, **config):
    return kvcodec.encode(kv, "cachegen", chunk_tokens=24, backend=backend, **{**SMALL_LANES, **config})


@pytest.mark.parametrize("config", [dict(level=2), dict(level=0, profile="none", sink_tokens=0)])
def test_kernel_bytes_equal_the_cpu_path(tiny, config):
    assert _encode(tiny, "triton", **config) == _encode(tiny, "cpu", **config)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_decode_equals_cpu_decode(tiny, dtype):
    kv = kvcodec.KVCache([(l.keys.to(dtype), l.values.to(dtype)) for l in tiny.layers], model=tiny.model)
    blob = _encode(kv, "cpu")
    cpu, gpu = kvcodec.decode(blob, backend="cpu"), kvcodec.decode(blob, backend="triton")
    for a, b in zip(cpu.layers, gpu.layers):
        assert a.keys.dtype == b.keys.dtype == dtype
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@settings(max_examples=6, deadline=None)
@given(layer=st.integers(0, 29), start=st.integers(0, 480), tokens=st.integers(1, 32), level=st.integers(0, 4),
       lane_channels=st.integers(1, 12), lane_tokens=st.integers(1, 12), sink_tokens=st.integers(0, 2),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_kernels_match_the_cpu_path_on_any_real_slice(real_kv, layer, start, tokens, level, lane_channels,
                                                      lane_tokens, sink_tokens, dtype):
    k, v = real_kv.layers[layer]
    kv = kvcodec.KVCache([(k[:, start:start + tokens].to(dtype), v[:, start:start + tokens].to(dtype))],
                         model=real_kv.model)
    config = dict(level=level, lane_channels=lane_channels, lane_tokens=lane_tokens, sink_tokens=sink_tokens)
    blob = kvcodec.encode(kv, "cachegen", backend="cpu", **config)
    assert kvcodec.encode(kv, "cachegen", backend="triton", **config) == blob
    a, b = kvcodec.decode(blob, backend="cpu"), kvcodec.decode(blob, backend="triton")
    assert torch.equal(a.layers[0].keys, b.layers[0].keys) and torch.equal(a.layers[0].values, b.layers[0].values)


def test_streams_cross_decode(tiny):
    """A stream made by either side decodes on the other to the same tensors."""
    from_gpu = _encode(tiny, "triton", level=1)
    from_cpu = _encode(tiny, "cpu", level=1)
    a = kvcodec.decode(from_gpu, backend="cpu")
    b = kvcodec.decode(from_cpu, backend="triton")
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("layout", ["flash", "gpu", "cpu"])
def test_paged_restore_equals_contiguous(tiny, layout):
    """Decoding straight into scattered paged blocks of each layout (vLLM CPU's keys are transposed per block, so
    the kernel steps channels by block_size there) gives what a contiguous decode gives."""
    blob = _encode(tiny, "cpu")
    expected = kvcodec.decode(blob, backend="cpu")
    block_size, num_blocks = 16, 9
    block_table = torch.tensor([7, 2, 5], dtype=torch.int32)  # not in order, not from 0
    with kvcodec.open(blob) as r:
        for backend in ("triton", "cpu"):
            paged = [torch.full(empty_shape(layout, num_blocks, block_size, 3, 64), float("nan"), dtype=torch.float16)
                     for _ in tiny.layers]
            for i in range(r.num_chunks):
                frame = r._container.read_frame(i)
                e = frame.entry
                for layer, data in frame.sections.items():
                    lo, hi = r.header.local_range(layer, e.token_start, e.token_count)
                    ctx = layer_context(r.header, layer, (lo, hi), torch.device("cpu"), backend)
                    slots = slot_mapping(block_table, lo, hi - lo, block_size)
                    r.codecs[e.variant].decode_layer_paged(data, ctx, paged[layer], slots, layout)
            slots = slot_mapping(block_table, 0, 40, block_size)
            for layer, want in zip(paged, expected.layers):
                keys, values = read_paged(layer, slots, layout)
                assert torch.equal(keys, want.keys) and torch.equal(values, want.values), backend


def test_kernel_treats_damaged_lanes_like_the_cpu_path(tiny):
    """ANS carries no redundancy, so a flipped bit in a lane may decode to other symbols (the container's
    checksums catch it); the kernel must then do exactly what the CPU path does: refuse the same lanes
    (the stream does not end at state 0 with every word used) and decode the rest to the same values."""
    codec = kvcodec.get_codec("cachegen", **SMALL_LANES)
    k, v = tiny.layers[1]
    header = kvcodec.chunking.make_header(kvcodec.KVCache([(k[:, :16], v[:, :16])]), [codec])
    ctx = layer_context(header, 0, (0, 16), torch.device("cpu"), "triton")
    cpu_ctx = layer_context(header, 0, (0, 16), torch.device("cpu"), "cpu")
    data = codec.encode_layer(k[:, :16], v[:, :16], ctx)
    parts, sinks = codec.parse(data, ctx)
    words_end = len(data) - sum(s.nbytes for s in sinks)
    words_start = words_end - parts[1].words.nbytes  # the values' lanes
    rng = np.random.default_rng(1)
    verdicts = set()
    for pos in rng.integers(words_start, words_end, 6):
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(8))
        outcomes = []
        for c in (cpu_ctx, ctx):
            try:
                outcomes.append(codec.decode_layer(bytes(bad), c))
            except kvcodec.CorruptDataError:
                outcomes.append(None)
        if outcomes[0] is None:
            assert outcomes[1] is None
        else:
            assert outcomes[1] is not None and all(torch.equal(a, b) for a, b in zip(*outcomes))
        verdicts.add(outcomes[0] is None)
    assert verdicts == {True, False}  # these seeds hit both cases
    last = words_end - 1  # a lane never ends in a zero word
    bad = bytearray(data)
    bad[last - 3:last + 1] = bytes(4)
    with pytest.raises(kvcodec.CorruptDataError):
        codec.decode_layer(bytes(bad), ctx)


def test_kernels_reject_non_finite_input(tiny):
    k, v = (x.clone() for x in tiny.layers[1])
    v[1, 3, 5] = float("nan")
    with pytest.raises(kvcodec.InvalidInputError, match="non-finite"):
        kvcodec.encode(kvcodec.KVCache([(k[:, :8], v[:, :8])]), "cachegen", backend="triton", **SMALL_LANES)


def test_backend_choice_errors(tiny):
    with pytest.raises(kvcodec.InvalidInputError, match="backend"):
        kvcodec.encode(tiny, "cachegen", backend="gpu")
    with pytest.raises(kvcodec.UnsupportedError, match="triton"):
        kvcodec.encode(tiny, "raw", backend="triton")
    with pytest.raises(kvcodec.UnsupportedError, match="group"):
        kvcodec.encode(tiny, "cachegen", group=4, backend="triton")
    blob = kvcodec.encode(tiny, "raw")
    with pytest.raises(kvcodec.UnsupportedError, match="triton"):
        kvcodec.decode(blob, backend="triton")


def test_kernels_compile_for_nvidia_gpus():
    """The interpreter runs code the GPU compiler would reject: compile every kernel to sm_80 and sm_90
    cubin (ptxas ships in the triton wheel; no GPU needed) and check the rounding the format relies on."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_kernels.py")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(": ok,") == 14
