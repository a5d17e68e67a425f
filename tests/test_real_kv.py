"""The Python API end to end on real SmolLM2 KV caches."""

from __future__ import annotations

import torch

import kvcodec


def test_raw_round_trip_is_bit_exact_on_real_kv(real_kv, tmp_path):
    path = tmp_path / "kv.kvc"
    size = kvcodec.save(path, real_kv, "raw")
    assert size == path.stat().st_size
    back = kvcodec.load(path)
    assert back.equal(real_kv)
    assert back.token_ids == real_kv.token_ids and back.model == real_kv.model and back.rope == "post"
    # overhead of headers, tables and index over the tensor bytes stays under 1% here
    assert real_kv.nbytes < size < 1.01 * real_kv.nbytes


def test_real_kv_has_expected_shape(real_kv):
    assert real_kv.num_layers == 30 and real_kv.num_tokens == 512 and real_kv.dtype == torch.float16
    assert real_kv.layers[0].keys.shape == (3, 512, 64)
    assert 5 < float(real_kv.layers[5].keys.abs().max()) < 100  # real keys have outlier channels, not N(0,1)


def test_kivi_error_is_within_half_a_step_on_real_kv(real_kv):
    for bits in (2, 4, 8):
        back = kvcodec.decode(kvcodec.encode(real_kv, "kivi", bits=bits))
        for orig, dec in zip(real_kv.layers, back.layers):
            v, w = orig.values.float(), dec.values.float()
            step = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / (2 ** bits - 1)
            # half a step, plus float16 rounding of scale and zero, plus float16 output rounding
            bound = 0.5 * step + 2 ** -9 * (v.abs().amax(-1, keepdim=True) + step * 2 ** bits) + 1e-3
            assert bool(((v - w).abs() <= bound).all()), f"kivi-{bits} value error above bound"


def test_kivi_sizes_on_real_kv(real_kv):
    sizes = {b: len(kvcodec.encode(real_kv, "kivi", bits=b)) for b in (2, 4, 8)}
    bpe = {b: 8 * s / real_kv.num_elements for b, s in sizes.items()}
    # codes + fp16 scale and zero (keys per 128-token group, values per token over 64 channels) + container
    for b in (2, 4, 8):
        assert b + 0.375 < bpe[b] < b + 0.375 + 0.05


def test_layer_by_layer_access_on_real_kv(real_kv):
    blob = kvcodec.encode(real_kv, "kivi", bits=4, chunk_tokens=128)
    full = kvcodec.decode(blob)
    with kvcodec.open(blob) as r:
        assert r.num_chunks == 4
        for i in range(r.num_chunks):
            chunk = r.read_chunk(i, layers=[7])
            assert list(chunk.layers) == [7]
            assert torch.equal(chunk.layers[7].keys, full.layers[7].keys[:, 128 * i:128 * (i + 1)])


def test_streamed_decode_of_real_kv(real_kv):
    blob = kvcodec.encode(real_kv, "kivi", bits=2)
    pieces = (blob[i:i + 4096] for i in range(0, len(blob), 4096))
    assert kvcodec.decode(pieces).equal(kvcodec.decode(blob))


def test_hf_round_trip_and_continuation_with_raw_is_identical(real_kv, smollm2):
    ids = real_kv.token_ids
    kv32 = real_kv.to(dtype=torch.float32)
    back = kvcodec.decode(kvcodec.encode(kv32)).to_hf(smollm2.model.config)
    assert kvcodec.KVCache.from_hf(back).equal(kv32)
    cont = smollm2.tokenize("The licensee may")
    a = smollm2.continue_from(kv32, cont)
    b = smollm2.continue_from(kvcodec.decode(kvcodec.encode(kv32)), cont)
    assert torch.equal(a, b)
    assert len(ids) == 512
