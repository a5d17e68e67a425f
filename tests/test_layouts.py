"""KVCache validation and conversions: transformers caches, safetensors dumps, vLLM paged blocks, LMCache chunks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import kvcodec
from kvcodec import CorruptDataError, InvalidInputError, KVCache
from kvcodec.layouts.paged import read_paged, slot_mapping, write_paged

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT = {4: torch.int32, 2: torch.int16}


def bits_tensor(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns (NaNs with payloads, infs, -0.0 and subnormals among them)."""
    bits = 8 * dtype.itemsize
    n = math.prod(shape)
    ints = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n,), generator=gen, dtype=torch.int64)
    if n >= 3:
        ints[:3] = torch.tensor([-(1 << (bits - 1)), -1, 1])  # -0.0, a NaN, the smallest subnormal
    return ints.to(_INT[dtype.itemsize]).view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(_INT[a.dtype.itemsize]), b.contiguous().view(_INT[b.dtype.itemsize])))


def uniform_cache(dtype=torch.float32, layers=3, heads=2, tokens=13, dim=4, seed=0, **meta) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    return KVCache([(torch.randn(heads, tokens, dim, generator=gen).to(dtype),
                     torch.randn(heads, tokens, dim, generator=gen).to(dtype)) for _ in range(layers)], **meta)


# ---------------------------------------------------------------------------------------------- KVCache


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


BAD_CACHES = {
    "no layers": lambda: KVCache([]),
    "keys 2-D": lambda: KVCache([(_t(2, 3), _t(2, 3, 4))]),
    "values 4-D": lambda: KVCache([(_t(2, 3, 4), _t(1, 2, 3, 4))]),
    "heads differ": lambda: KVCache([(_t(2, 3, 4), _t(3, 3, 4))]),
    "tokens differ": lambda: KVCache([(_t(2, 3, 4), _t(2, 4, 4))]),
    "zero heads": lambda: KVCache([(_t(0, 3, 4), _t(0, 3, 4))]),
    "zero head_dim": lambda: KVCache([(_t(2, 3, 0), _t(2, 3, 4))]),
    "zero value dim": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 0))]),
    "mixed dtype in a layer": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4, dtype=torch.float16))]),
    "mixed dtype across layers": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4)),
                                                  (_t(2, 3, 4, dtype=torch.bfloat16), _t(2, 3, 4, dtype=torch.bfloat16))]),
    "int dtype": lambda: KVCache([(_t(2, 3, 4, dtype=torch.int32), _t(2, 3, 4, dtype=torch.int32))]),
    "int8 dtype": lambda: KVCache([(_t(2, 3, 4, dtype=torch.int8), _t(2, 3, 4, dtype=torch.int8))]),
    "float64": lambda: KVCache([(_t(2, 3, 4, dtype=torch.float64), _t(2, 3, 4, dtype=torch.float64))]),
    "bool": lambda: KVCache([(_t(2, 3, 4, dtype=torch.bool), _t(2, 3, 4, dtype=torch.bool))]),
    "bad rope": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4))], rope="mid"),
    "empty rope": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4))], rope=""),
    "rope upper case": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4))], rope="PRE"),
    "positions too short": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4))], positions=[0, 1]),
    "positions too long": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4))], positions=[0, 1, 2, 3]),
    "positions of a shorter layer": lambda: KVCache([(_t(2, 5, 4), _t(2, 5, 4)), (_t(2, 3, 4), _t(2, 3, 4))],
                                                    positions=[0, 1, 2]),
    "layers on two devices": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4)), (_t(2, 3, 4, device="meta"),
                                                                           _t(2, 3, 4, device="meta"))]),
    "keys and values on two devices": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4, device="meta"))]),
    "numpy array": lambda: KVCache([(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 4), np.float32))]),
    "numpy in a later layer": lambda: KVCache([(_t(2, 3, 4), _t(2, 3, 4)), (np.zeros((2, 3, 4), np.float32),
                                                                            np.zeros((2, 3, 4), np.float32))]),
    "from_tensors lengths": lambda: KVCache.from_tensors([_t(2, 3, 4)] * 2, [_t(2, 3, 4)]),
}


@pytest.mark.parametrize("name", list(BAD_CACHES))
def test_kvcache_validation_errors(name):
    with pytest.raises(InvalidInputError):
        BAD_CACHES[name]()


def test_kvcache_rejects_nested_lists():
    """The check 'keys and values must be torch tensors' must hold for the first layer too."""
    with pytest.raises(InvalidInputError):
        KVCache([([[[1.0]]], [[[1.0]]])])


def test_kvcache_valid_forms_and_properties():
    k, v = torch.zeros(2, 7, 4, dtype=torch.bfloat16), torch.zeros(2, 7, 3, dtype=torch.bfloat16)
    window = (torch.zeros(1, 0, 4, dtype=torch.bfloat16), torch.zeros(1, 0, 4, dtype=torch.bfloat16))
    kv = KVCache([(k, v), kvcodec.KVLayer(*window)], model="m", token_ids=range(7), rope="pre", positions=range(7))
    assert kv.num_layers == 2 and kv.num_tokens == 7 and kv.dtype == torch.bfloat16
    assert kv.num_elements == 2 * 7 * 7 and kv.nbytes == 2 * 2 * 7 * 7
    assert kv.meta == {"model": "m", "token_ids": list(range(7)), "rope": "pre", "positions": list(range(7))}
    assert kv.shapes[1].tokens == 0
    assert KVCache.from_tensors([k], [v], rope="post").rope == "post"
    assert KVCache([(k, v)]).meta == {}
    half = kv.to(dtype=torch.float16)
    assert half.dtype == torch.float16 and half.meta == kv.meta and not half.equal(kv)


def test_equal_compares_bits():
    nan1 = torch.tensor([[[float("nan")]]])
    nan2 = nan1.view(torch.int32).add(1).view(torch.float32)  # another NaN payload
    assert KVCache([(nan1, nan1)]).equal(KVCache([(nan1.clone(), nan1.clone())]))
    assert not KVCache([(nan1, nan1)]).equal(KVCache([(nan2, nan1)]))
    z, nz = torch.zeros(1, 1, 1), -torch.zeros(1, 1, 1)
    assert not KVCache([(z, z)]).equal(KVCache([(nz, z)]))
    assert not KVCache([(z, z)]).equal(KVCache([(z.half(), z.half())]))


# ---------------------------------------------------------------------------------------------- transformers


def _mixed_cache(dtype: torch.dtype, seed: int = 0, **meta) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    return KVCache([(bits_tensor(gen, (2, 9, 4), dtype), bits_tensor(gen, (2, 9, 4), dtype)),
                    (bits_tensor(gen, (3, 9, 6), dtype), bits_tensor(gen, (3, 9, 5), dtype)),
                    (bits_tensor(gen, (2, 4, 4), dtype), bits_tensor(gen, (2, 4, 4), dtype))], **meta)


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_hf_from_hf_round_trip(dtype):
    from transformers import DynamicCache

    kv = _mixed_cache(dtype)
    cache = kv.to_hf()
    assert isinstance(cache, DynamicCache)
    assert len(cache.layers) == kv.num_layers
    for layer, ours in zip(cache.layers, kv.layers):
        assert layer.keys.shape == (1, *ours.keys.shape) and layer.keys.dtype == dtype
        assert same_bits(layer.keys[0], ours.keys) and same_bits(layer.values[0], ours.values)
    back = KVCache.from_hf(cache, model="m", rope="post")
    assert back.equal(kv) and back.dtype == dtype
    assert back.meta == {"model": "m", "rope": "post"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_hf_takes_one_sequence_of_a_batch(dtype):
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(4)
    batch = [(torch.randn(3, 2, 6, 5, generator=gen).to(dtype), torch.randn(3, 2, 6, 5, generator=gen).to(dtype))
             for _ in range(2)]
    cache = DynamicCache()
    for i, (k, v) in enumerate(batch):
        cache.update(k, v, i)
    for b in range(3):
        kv = KVCache.from_hf(cache, batch_index=b, token_ids=list(range(6)))
        expected = KVCache([(k[b], v[b]) for k, v in batch])
        assert kv.equal(expected) and kv.dtype == dtype and kv.token_ids == list(range(6))
        assert not kv.equal(KVCache([(k[(b + 1) % 3], v[(b + 1) % 3]) for k, v in batch]))
    # the legacy tuple-of-pairs form
    assert KVCache.from_hf(tuple(batch), batch_index=2).equal(KVCache([(k[2], v[2]) for k, v in batch]))


def test_from_hf_rejects_empty_or_wrong_caches():
    from transformers import DynamicCache

    with pytest.raises(InvalidInputError):
        KVCache.from_hf(DynamicCache())
    with pytest.raises(InvalidInputError):
        KVCache.from_hf([(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))])  # no batch axis


def test_hf_through_the_container():
    kv = _mixed_cache(torch.bfloat16, model="m", token_ids=list(range(9)))
    out = kvcodec.decode(kvcodec.encode(KVCache.from_hf(kv.to_hf(), **kv.meta), chunk_tokens=4))
    assert out.equal(kv) and out.meta == kv.meta
    again = KVCache.from_hf(out.to_hf())
    assert again.equal(kv)


# ---------------------------------------------------------------------------------------------- safetensors


@pytest.mark.parametrize("dtype", DTYPES)
def test_safetensors_round_trip_bit_exact_with_metadata(tmp_path, dtype):
    kv = _mixed_cache(dtype, model="HuggingFaceTB/SmolLM2-135M", token_ids=[1, 50000, 3, 2**31, 0, 7, 7, 8, 9],
                      rope="pre", positions=list(range(100, 109)))
    path = tmp_path / "kv.safetensors"
    kv.save_safetensors(path)
    back = KVCache.load_safetensors(path)
    assert back.equal(kv) and back.dtype == dtype
    assert back.meta == kv.meta
    assert back.model == "HuggingFaceTB/SmolLM2-135M" and back.rope == "pre"
    assert back.token_ids == kv.token_ids and back.positions == kv.positions
    # and without metadata, nothing is invented
    plain = _mixed_cache(dtype, seed=1)
    plain.save_safetensors(tmp_path / "plain.safetensors")
    back = KVCache.load_safetensors(str(tmp_path / "plain.safetensors"))
    assert back.equal(plain) and back.meta == {}


def test_safetensors_writes_non_contiguous_tensors(tmp_path):
    base = torch.randn(2, 4, 6, 3)
    kv = KVCache([(base[0].transpose(0, 1), base[1].transpose(0, 1))])  # [4, 2, 3] views
    kv.save_safetensors(tmp_path / "v.safetensors")
    assert KVCache.load_safetensors(tmp_path / "v.safetensors").equal(kv)


def test_safetensors_writes_tensors_that_share_a_buffer(tmp_path):
    """Keys and values that are views of one fused buffer (as from_lmcache gives with one head)."""
    fused = torch.randn(2, 3, 5, 4)  # [K/V, heads, tokens, dim]
    kv = KVCache([(fused[0], fused[1])])
    kv.save_safetensors(tmp_path / "f.safetensors")
    assert KVCache.load_safetensors(tmp_path / "f.safetensors").equal(kv)
    one_head = KVCache.from_lmcache(torch.randn(2, 2, 5, 4), 1)
    one_head.save_safetensors(tmp_path / "g.safetensors")
    assert KVCache.load_safetensors(tmp_path / "g.safetensors").equal(one_head)


@pytest.fixture
def dump(tmp_path):
    kv = _mixed_cache(torch.float16, model="m", token_ids=list(range(9)), rope="post", positions=list(range(9)))
    path = tmp_path / "kv.safetensors"
    kv.save_safetensors(path)
    return path, path.read_bytes()


def test_truncated_safetensors_is_corrupt(tmp_path, dump):
    _, data = dump
    bad = []
    target = tmp_path / "cut.safetensors"
    for n in range(len(data)):
        target.write_bytes(data[:n])
        try:
            KVCache.load_safetensors(target)
        except CorruptDataError:
            continue
        except Exception as e:  # noqa: BLE001
            bad.append((n, repr(e)))
            continue
        bad.append((n, "no error"))
    assert not bad, bad[:5]


def test_damaged_safetensors_header_is_corrupt(tmp_path, dump):
    _, data = dump
    header_len = int.from_bytes(data[:8], "little")
    target = tmp_path / "bad.safetensors"
    bad = []
    for pos in [*range(8), 8, 9, 8 + header_len // 2, 8 + header_len - 1]:
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        target.write_bytes(bytes(damaged))
        try:
            out = KVCache.load_safetensors(target)
        except CorruptDataError:
            continue
        except Exception as e:  # noqa: BLE001
            bad.append((pos, repr(e)))
            continue
        bad.append((pos, f"loaded {out}"))
    assert not bad, bad


def test_safetensors_with_wrong_tensors_is_corrupt(tmp_path):
    for names in (["layers.1.keys", "layers.1.values"], ["layers.0.keys"],
                  ["layers.0.keys", "layers.0.values", "extra"],
                  ["layers.0.keys", "layers.0.values", "layers.2.keys", "layers.2.values"]):
        save_file({n: torch.zeros(1, 2, 3) for n in names}, tmp_path / "x.safetensors")
        with pytest.raises(CorruptDataError):
            KVCache.load_safetensors(tmp_path / "x.safetensors")
    (tmp_path / "text.safetensors").write_text("not a safetensors file at all")
    with pytest.raises(CorruptDataError):
        KVCache.load_safetensors(tmp_path / "text.safetensors")


@pytest.mark.parametrize("field", ["token_ids", "positions"])
def test_safetensors_with_damaged_list_metadata_is_corrupt(tmp_path, field):
    save_file({"layers.0.keys": torch.zeros(1, 2, 3), "layers.0.values": torch.zeros(1, 2, 3)}, tmp_path / "m.safetensors",
              metadata={"format": "kvcodec-kv-dump", field: "[0, 1"})
    with pytest.raises(CorruptDataError):
        KVCache.load_safetensors(tmp_path / "m.safetensors")


def test_safetensors_metadata_is_json_for_lists(tmp_path):
    kv = uniform_cache(tokens=3, token_ids=[5, 6, 7], positions=[0, 1, 2], model="m")
    kv.save_safetensors(tmp_path / "a.safetensors")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        meta = f.metadata()
        names = sorted(f.keys())
    assert json.loads(meta["token_ids"]) == [5, 6, 7] and json.loads(meta["positions"]) == [0, 1, 2]
    assert meta["model"] == "m"
    assert names == sorted(f"layers.{i}.{kind}" for i in range(3) for kind in ("keys", "values"))


# ---------------------------------------------------------------------------------------------- paged


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,tokens", [(16, 13), (4, 13), (4, 12), (1, 5), (16, 0), (8, 33)])
def test_to_paged_from_paged_round_trip(dtype, block_size, tokens):
    gen = torch.Generator().manual_seed(tokens)
    kv = KVCache([(bits_tensor(gen, (3, tokens, 8), dtype), bits_tensor(gen, (3, tokens, 8), dtype)) for _ in range(2)],
                 model="m", rope="post")
    pages, table = kv.to_paged(block_size=block_size)
    needed = math.ceil(tokens / block_size)
    assert len(pages) == 2
    for p in pages:
        assert p.shape == (2, needed, block_size, 3, 8) and p.dtype == dtype
    assert table.dtype == torch.int32 and table.tolist() == list(range(needed))
    # token t of head h lives at [0 or 1, t // block_size, t % block_size, h]
    for t in range(tokens):
        assert same_bits(pages[1][0, t // block_size, t % block_size], kv.layers[1].keys[:, t])
        assert same_bits(pages[1][1, t // block_size, t % block_size], kv.layers[1].values[:, t])
    back = KVCache.from_paged(pages, table, tokens, model="m", rope="post")
    assert back.equal(kv) and back.meta == kv.meta


def test_to_paged_with_spare_blocks():
    kv = uniform_cache(tokens=10)
    pages, table = kv.to_paged(block_size=4, num_blocks=7)
    assert pages[0].shape == (2, 7, 4, 2, 4)
    assert table.tolist() == [0, 1, 2]
    assert torch.count_nonzero(pages[0][:, 3:]) == 0 and torch.count_nonzero(pages[0][:, 2, 2:]) == 0
    assert KVCache.from_paged(pages, table, 10).equal(kv)
    with pytest.raises(InvalidInputError):
        kv.to_paged(block_size=4, num_blocks=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_paged_with_a_shuffled_block_table(dtype):
    gen = torch.Generator().manual_seed(17)
    block_size, num_blocks, tokens, heads, dim = 4, 20, 15, 2, 6
    kv = KVCache([(bits_tensor(gen, (heads, tokens, dim), dtype), bits_tensor(gen, (heads, tokens, dim), dtype))
                  for _ in range(3)])
    table = torch.tensor([13, 2, 17, 7], dtype=torch.int32)  # 15 tokens in 4 scattered blocks of 20
    assert len(table) == math.ceil(tokens / block_size)
    pages = []
    for layer in kv.layers:
        paged = bits_tensor(gen, (2, num_blocks, block_size, heads, dim), dtype)  # other sequences' garbage
        before = paged.clone()
        slots = slot_mapping(table, 0, tokens, block_size)
        assert slots.tolist() == [int(table[t // block_size]) * block_size + t % block_size for t in range(tokens)]
        write_paged(paged, layer.keys, layer.values, slots)
        # only the slots of this sequence changed
        touched = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        touched[slots] = True
        flat_now, flat_before = paged.view(2, -1, heads, dim), before.view(2, -1, heads, dim)
        assert same_bits(flat_now[:, ~touched], flat_before[:, ~touched])
        for t in range(tokens):
            assert same_bits(paged[0, int(table[t // block_size]), t % block_size], layer.keys[:, t])
        pages.append(paged)
    back = KVCache.from_paged(pages, table, tokens, token_ids=list(range(tokens)))
    assert back.equal(kv) and back.token_ids == list(range(tokens))
    # a prefix of the sequence, and tokens read from the middle
    assert KVCache.from_paged(pages, table, 6).equal(KVCache([(l.keys[:, :6], l.values[:, :6]) for l in kv.layers]))
    mid = slot_mapping(table, 5, 7, block_size)
    k, v = read_paged(pages[2], mid)
    assert same_bits(k, kv.layers[2].keys[:, 5:12]) and same_bits(v, kv.layers[2].values[:, 5:12])


def test_paged_errors():
    kv = uniform_cache(tokens=10)
    pages, table = kv.to_paged(block_size=4)
    with pytest.raises(InvalidInputError):  # table of 3 blocks cannot hold 13 tokens
        KVCache.from_paged(pages, table, 13)
    with pytest.raises(InvalidInputError):  # block 5 does not exist
        KVCache.from_paged(pages, torch.tensor([0, 5, 1], dtype=torch.int32), 10)
    with pytest.raises(InvalidInputError):
        KVCache.from_paged([], table, 10)
    with pytest.raises(InvalidInputError):
        KVCache.from_paged([p[0] for p in pages], table, 10)
    with pytest.raises(InvalidInputError):
        slot_mapping(table, 8, 5, 4)
    sliding = KVCache([(torch.zeros(2, 10, 4), torch.zeros(2, 10, 4)), (torch.zeros(2, 5, 4), torch.zeros(2, 5, 4))])
    with pytest.raises(InvalidInputError):
        sliding.to_paged()
    with pytest.raises(InvalidInputError):
        KVCache([(torch.zeros(2, 10, 4), torch.zeros(2, 10, 3))]).to_paged()


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_paged_layout_is_vllm_cpu_attention(dtype):
    """vLLM's CPU attention: per (block, head) the keys transposed as [D, block_size], then the values as
    [block_size, D], written here element by element from that description."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_blocks, tokens, heads, dim = 4, 9, 14, 3, 6
    kv = KVCache([(bits_tensor(gen, (heads, tokens, dim), dtype), bits_tensor(gen, (heads, tokens, dim), dtype))])
    table = torch.tensor([7, 0, 4, 2], dtype=torch.int32)
    paged = bits_tensor(gen, (num_blocks, heads, block_size, 2 * dim), dtype)
    expected = paged.clone()
    for t in range(tokens):
        b, o = int(table[t // block_size]), t % block_size
        for h in range(heads):
            region = expected[b, h].view(-1)  # 2 * D * block_size elements
            for d in range(dim):
                region[d * block_size + o] = kv.layers[0].keys[h, t, d]
                region[block_size * dim + o * dim + d] = kv.layers[0].values[h, t, d]
    slots = slot_mapping(table, 0, tokens, block_size)
    write_paged(paged, kv.layers[0].keys, kv.layers[0].values, slots, "cpu")
    assert same_bits(paged, expected)
    k, v = read_paged(paged, slots, "cpu")
    assert same_bits(k, kv.layers[0].keys) and same_bits(v, kv.layers[0].values)
    pages, table2 = kv.to_paged(block_size=block_size, layout="cpu")
    assert pages[0].shape == (4, heads, block_size, 2 * dim)
    assert KVCache.from_paged(pages, table2, tokens, layout="cpu").equal(kv)


def test_paged_layouts_refuse_what_they_are_not():
    with pytest.raises(InvalidInputError, match="cpu"):
        read_paged(torch.zeros(2, 3, 4, 2, 8), torch.arange(4), "cpu")  # a flash layer read as cpu
    with pytest.raises(InvalidInputError, match="flash"):
        read_paged(torch.zeros(3, 2, 4, 16), torch.arange(4))  # a cpu layer read as flash
    with pytest.raises(InvalidInputError, match="unknown paged layout"):
        read_paged(torch.zeros(3, 2, 4, 16), torch.arange(4), "amx")


# ---------------------------------------------------------------------------------------------- lmcache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers,heads,tokens,dim", [(3, 2, 13, 4), (1, 1, 1, 1), (2, 5, 0, 3), (4, 3, 7, 64)])
def test_lmcache_round_trip_and_shape(dtype, layers, heads, tokens, dim):
    gen = torch.Generator().manual_seed(layers * 100 + tokens)
    kv = KVCache([(bits_tensor(gen, (heads, tokens, dim), dtype), bits_tensor(gen, (heads, tokens, dim), dtype))
                  for _ in range(layers)])
    chunk = kv.to_lmcache()
    assert chunk.shape == (2, layers, tokens, heads * dim)
    assert chunk.dtype == dtype
    for l in range(layers):
        for t in range(tokens):
            for h in range(heads):
                assert same_bits(chunk[0, l, t, h * dim:(h + 1) * dim], kv.layers[l].keys[h, t])
                assert same_bits(chunk[1, l, t, h * dim:(h + 1) * dim], kv.layers[l].values[h, t])
            if tokens > 3:
                break
    back = KVCache.from_lmcache(chunk, heads, model="m")
    assert back.equal(kv) and back.model == "m"
    assert all(l.keys.is_contiguous() for l in back.layers)


def test_lmcache_errors():
    with pytest.raises(InvalidInputError):  # layers of different shapes
        KVCache([(torch.zeros(2, 10, 4), torch.zeros(2, 10, 4)), (torch.zeros(2, 5, 4), torch.zeros(2, 5, 4))]).to_lmcache()
    for bad, heads in ((torch.zeros(2, 1, 3), 1), (torch.zeros(3, 1, 3, 8), 2), (torch.zeros(2, 1, 3, 8), 3)):
        with pytest.raises(InvalidInputError):
            KVCache.from_lmcache(bad, heads)


def test_lmcache_rejects_different_key_and_value_dims():
    kv = KVCache([(torch.zeros(2, 10, 4), torch.zeros(2, 10, 3))])
    with pytest.raises(InvalidInputError):
        kv.to_lmcache()


def test_from_lmcache_rejects_zero_heads():
    with pytest.raises(InvalidInputError):
        KVCache.from_lmcache(torch.zeros(2, 1, 3, 8), 0)
