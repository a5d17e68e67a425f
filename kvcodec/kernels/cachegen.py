"""Triton kernels of the ``cachegen`` codec: the CPU path's exact bytes, lane-parallel on a GPU.

A *part* is the keys or the values of one section, ``[H, T, D]``; a launch
codes any number of parts at once (both parts of a layer, or every layer of a
chunk) so that the GPU sees enough lanes.  Parts and lanes are described by
small int64 tables built on the host (:mod:`kvcodec.codecs.cachegen.device`, and
for the decode :mod:`kvcodec.codecs.entropy.device`, which kvtc's lanes use too):

* encode parts ``[P, 9]``: input offset (elements from ``x``), strides of h, t
  and d, first channel in the concatenated channel arrays, T, D, offset of the
  part's token scales (-1: none), H;
* decode parts ``[P, 8]``: output offset (elements from ``out``), stride of h,
  first entry in the row-offset table, first channel, T, D, token-scale
  offset, stride of d.  Element ``[h, t, d]`` goes to ``out + offset + h *
  stride_h + d * stride_d + rows[first + t]``: one rule covers a contiguous ``[H, T, D]`` tensor and
  vLLM-style paged blocks, whose row offsets come from the block table;
* lanes ``[NL, 6]``: part, first entry of the lane's channels in ``order``,
  number of channels, first token, tokens per channel, first word.

Symbol ``i`` of a lane (decode order) is channel ``order[first + i // width]``
at token ``t0 + i % width`` (spec/cachegen.md §10.3, ``group = 1``).  The ANS state
machine is constriction's (``kvcodec/tools/ans_reference.py``): u64 state,
u32 words, 24-bit probabilities, one renormalisation step at most per symbol.

Side information travels as a section stores it (float16 means, one-byte
step codes and table indices; steps come from the 256-entry step table), so a
decode holds little on the device beyond the compressed bytes, the output, the
lane table and the channel order.

Numerics follow spec/cachegen.md §10.3 so the bytes and the decoded values equal the
CPU path's: quantization and reconstruction in binary64 (the products there
are exact, so fused and unfused evaluation agree), steps ``f32(a * b)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcodec.formats import cachegen as fmt

# encode part table columns
E_IN = tl.constexpr(0)
E_SH = tl.constexpr(1)
E_ST = tl.constexpr(2)
E_SD = tl.constexpr(3)
E_CHAN = tl.constexpr(4)
E_T = tl.constexpr(5)
E_D = tl.constexpr(6)
E_A = tl.constexpr(7)
E_H = tl.constexpr(8)
E_FIELDS = tl.constexpr(9)
# decode part table columns
D_OUT = tl.constexpr(0)
D_SH = tl.constexpr(1)
D_ROWS = tl.constexpr(2)
D_CHAN = tl.constexpr(3)
D_T = tl.constexpr(4)
D_D = tl.constexpr(5)
D_A = tl.constexpr(6)
D_SD = tl.constexpr(7)  # channel stride: 1, or block_size for vLLM CPU's transposed keys
D_FIELDS = tl.constexpr(8)
# lane table columns
L_PART = tl.constexpr(0)
L_ORDER = tl.constexpr(1)
L_CHANNELS = tl.constexpr(2)
L_T0 = tl.constexpr(3)
L_WIDTH = tl.constexpr(4)
L_WORDS = tl.constexpr(5)
L_FIELDS = tl.constexpr(6)

# The coding tables' sizes, from the format's constants that the CPU tables are built from too.
RADIX = tl.constexpr(fmt.RADIX)
HIST_BINS = tl.constexpr(fmt.RADIX + 1)  # symbol magnitudes 0..RADIX; the codebook is symmetric
NUM_TABLES = tl.constexpr(fmt.NUM_TABLES)
TABLE_GROUP = tl.constexpr(16)
TABLE_STRIDE = tl.constexpr(fmt.ALPHABET + 1)  # cumulative table row: the symbols + the total
BUCKET_SHIFT = tl.constexpr(fmt.PRECISION - fmt.BUCKET_BITS)  # slot -> bucket (kvcodec.codecs.entropy.tables.slot_buckets)
LUT_STRIDE = tl.constexpr((1 << fmt.BUCKET_BITS) + 1)
PRECISION = tl.constexpr(fmt.PRECISION)
UNIT_STEP = tl.constexpr(128)  # the step code whose step is exactly 1
SLOT_MASK = tl.constexpr((1 << fmt.PRECISION) - 1)
RENORM_SHIFT = tl.constexpr(64 - fmt.PRECISION)  # a full state keeps its top PRECISION bits below the symbol's frequency
# Adding and subtracting 1.5 * 2**52 rounds a binary64 of magnitude below 2**51 to the nearest integer,
# ties to even: the hardware's own rounding, with no libm call that might differ between back ends.
ROUNDER = tl.constexpr(6755399441055744.0)
CLAMP = tl.constexpr(1125899906842624.0)  # 2**50


@triton.jit
def _quantize(x, mu, step):
    """``round_half_even((x - mu) / step)`` in binary64 (spec/cachegen.md §10.3), clamped far outside the symbol range."""
    y = (x.to(tl.float64) - mu.to(tl.float64)) / step.to(tl.float64)
    y = tl.minimum(tl.maximum(y, -CLAMP), CLAMP)
    return ((y + ROUNDER) - ROUNDER).to(tl.int64)


@triton.jit
def _token_scale(steps_ptr, a_ptr, a_base, h, t, tokens, mask):
    """The values' per-token step factor where ``mask``, else 1 (idle elements, parts without token scales)."""
    # both sides vectors: the interpreter mishandles a scalar condition broadcast into a mask
    scaled = mask & (a_base + tl.zeros_like(t) >= 0)
    code = tl.load(a_ptr + tl.maximum(a_base, 0) + h * tokens + t, mask=scaled, other=UNIT_STEP)
    return tl.load(steps_ptr + code.to(tl.int32))


@triton.jit
def _channel_step(steps_ptr, b_ptr, g, mask):
    """A channel's step where ``mask``, else 1."""
    return tl.load(steps_ptr + tl.load(b_ptr + g, mask=mask, other=UNIT_STEP).to(tl.int32))


@triton.jit
def _to_output(x, dtype: tl.constexpr):
    """A float32 value in the output dtype, rounded to nearest even (spelled out for bfloat16, which
    the interpreter would otherwise truncate)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _lanes(lanes_ptr, num_lanes, BLOCK_L: tl.constexpr):
    """This program's lanes: index, liveness, part, first channel-order entry, channels, first token, width."""
    lane = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    live = lane < num_lanes
    info = lanes_ptr + lane * L_FIELDS
    p = tl.load(info + L_PART, mask=live, other=0)
    first, channels = tl.load(info + L_ORDER, mask=live, other=0), tl.load(info + L_CHANNELS, mask=live, other=0)
    t0 = tl.load(info + L_T0, mask=live, other=0)
    width = tl.load(info + L_WIDTH, mask=live, other=1).to(tl.int32)
    return lane, live, p, first, channels, t0, width


@triton.jit
def _encode_part(parts_ptr, p):
    """Part ``p``'s row of the encode part table: input offset, strides of h, t and d, first channel, T, D,
    token-scale offset, H."""
    row = parts_ptr + p * E_FIELDS
    return (tl.load(row + E_IN), tl.load(row + E_SH), tl.load(row + E_ST), tl.load(row + E_SD), tl.load(row + E_CHAN),
            tl.load(row + E_T), tl.load(row + E_D), tl.load(row + E_A), tl.load(row + E_H))


@triton.jit
def stats_kernel(x_ptr, parts_ptr, sum_ptr, abs_ptr, tok_ptr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per channel the binary64 sum and absolute sum over tokens; per (head, token) the absolute sum over
    the head's channels (parts with token scales).  Grid: (parts, heads)."""
    h = tl.program_id(1)
    base, sh, st, sd, chan, tokens, dim, a_base, heads = _encode_part(parts_ptr, tl.program_id(0))
    if h >= heads:
        return
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    total = tl.zeros([BLOCK_D], dtype=tl.float64)
    total_abs = tl.zeros([BLOCK_D], dtype=tl.float64)
    for t0 in range(0, tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        mask = (t[:, None] < tokens) & dmask[None, :]
        x = tl.load(x_ptr + base + h * sh + t[:, None] * st + d[None, :] * sd, mask=mask, other=0.0).to(tl.float64)
        magnitude = tl.abs(x)
        total += tl.sum(x, 0)
        total_abs += tl.sum(magnitude, 0)
        if a_base >= 0:
            tl.store(tok_ptr + a_base + h * tokens + t, tl.sum(magnitude, 1), mask=t < tokens)
    tl.store(sum_ptr + chan + h * dim + d, total, mask=dmask)
    tl.store(abs_ptr + chan + h * dim + d, total_abs, mask=dmask)


@triton.jit
def range_kernel(x_ptr, parts_ptr, mu_ptr, b_ptr, a_ptr, steps_ptr, lengths_ptr, maxq_ptr, table_ptr,
                 BLOCK_T: tl.constexpr):
    """Quantize one channel's tokens and record the largest symbol magnitude and the codebook table that
    codes the symbols in the fewest bits: a histogram of magnitudes (the codebook is symmetric) against
    code lengths in 1/65536 bit, summed exactly in 64-bit integers, first table on a tie (as the CPU
    path's float64 matrix product, exact at these sizes).  No atomics, nothing per bin in memory.
    Grid: (parts, channels)."""
    c = tl.program_id(1)
    base, sh, st, sd, chan, tokens, dim, a_base, heads = _encode_part(parts_ptr, tl.program_id(0))
    if c >= heads * dim:
        return
    h = c // dim
    g = chan + c
    mu = tl.load(mu_ptr + g)
    b = tl.load(steps_ptr + tl.load(b_ptr + g).to(tl.int32))
    hist = tl.zeros([HIST_BINS], dtype=tl.int32)
    worst = tl.zeros([BLOCK_T], dtype=tl.int64)
    for t0 in range(0, tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m = t < tokens
        x = tl.load(x_ptr + base + h * sh + t * st + (c - h * dim) * sd, mask=m, other=0.0)
        q = tl.abs(_quantize(x, mu, _token_scale(steps_ptr, a_ptr, a_base, h, t, tokens, m) * b))
        q = tl.where(m, q, 0)
        worst = tl.maximum(worst, q)
        hist += tl.histogram(tl.minimum(q, HIST_BINS - 1).to(tl.int32), HIST_BINS)
    bins = tl.arange(0, HIST_BINS)
    padding = tl.cdiv(tokens, BLOCK_T) * BLOCK_T - tokens  # the tile's idle tokens, counted as magnitude 0
    counts = (hist - tl.where(bins == 0, padding, 0)).to(tl.int64)
    best = tl.full([], 1 << 62, tl.int64)
    best_table = 0
    for j0 in tl.static_range(0, NUM_TABLES, TABLE_GROUP):  # a [magnitudes, tables] tile at a time
        j = j0 + tl.arange(0, TABLE_GROUP)
        cost = tl.sum(counts[:, None] * tl.load(lengths_ptr + bins[:, None] * NUM_TABLES + j[None, :]).to(tl.int64), 0)
        low = tl.min(cost, 0)
        better = low < best  # strictly: the first table wins a tie
        best_table = tl.where(better, j0 + tl.argmin(cost, 0, tie_break_left=True), best_table)
        best = tl.where(better, low, best)
    tl.store(maxq_ptr + g, tl.minimum(tl.max(worst, 0), 1 << 30).to(tl.int32))
    tl.store(table_ptr + g, best_table.to(tl.uint8))


@triton.jit
def encode_kernel(x_ptr, parts_ptr, lanes_ptr, order_ptr, table_ptr, freq_ptr, cum_ptr, mu_ptr, b_ptr, a_ptr, steps_ptr,
                  scratch_ptr, nwords_ptr, num_lanes, max_symbols, capacity, BLOCK_L: tl.constexpr):
    """ANS-encode lanes straight from the KV tensor (quantizing on the fly, no symbol buffer).
    Lane ``l`` writes its words, in stream order, to ``scratch[l * capacity:]`` and their count to
    ``nwords[l]`` (``capacity + 1`` flags an overflow).  Grid: lane blocks."""
    lane, live, p, first, channels, t0, width = _lanes(lanes_ptr, num_lanes, BLOCK_L)
    base, sh, st, sd, chan, tokens, dim, a_base, _ = _encode_part(parts_ptr, p)
    dim = dim.to(tl.int32)
    count = tl.where(live, channels * width, 0)
    out = scratch_ptr + lane.to(tl.int64) * capacity
    state = tl.zeros([BLOCK_L], dtype=tl.uint64)
    n = tl.zeros([BLOCK_L], dtype=tl.int64)
    for k in range(max_symbols):
        i = max_symbols - 1 - k  # ANS is a stack: push the last symbol first
        active = i < count
        j = i // width
        g = tl.load(order_ptr + first + j, mask=active, other=0)
        c = (g - chan).to(tl.int32)  # 32-bit division per symbol: 64-bit is a long software routine
        h = c // dim
        t = t0 + (i - j * width)
        x = tl.load(x_ptr + base + h * sh + t * st + (c - h * dim) * sd, mask=active, other=0.0)
        step = _token_scale(steps_ptr, a_ptr, a_base, h, t, tokens, active) * _channel_step(steps_ptr, b_ptr, g, active)
        sym = _quantize(x, tl.load(mu_ptr + g, mask=active, other=0.0), step) + RADIX
        entry = tl.load(table_ptr + g, mask=active, other=0).to(tl.int64) * TABLE_STRIDE + sym
        f = tl.load(freq_ptr + entry, mask=active, other=1).to(tl.uint64)
        cf = tl.load(cum_ptr + entry, mask=active, other=0).to(tl.uint64)
        emit = active & ((state >> RENORM_SHIFT) >= f)
        tl.store(out + n, (state & 0xFFFFFFFF).to(tl.uint32), mask=emit & (n < capacity))
        n += emit.to(tl.int64)
        state = tl.where(emit, state >> 32, state)
        state = tl.where(active, ((state // f) << PRECISION) | (cf + state % f), state)
    # flush: the low word, then the high word, leaving out leading zero words
    tl.store(out + n, (state & 0xFFFFFFFF).to(tl.uint32), mask=live & (state > 0) & (n < capacity))
    n += (state > 0).to(tl.int64)
    tl.store(out + n, (state >> 32).to(tl.uint32), mask=live & (state >> 32 > 0) & (n < capacity))
    n += (state >> 32 > 0).to(tl.int64)
    tl.store(nwords_ptr + lane, tl.minimum(n, capacity + 1), mask=live)


@triton.jit
def compact_kernel(scratch_ptr, nwords_ptr, offsets_ptr, out_ptr, capacity, BLOCK: tl.constexpr):
    """Copy each lane's words from its scratch row to its place in the section.  Grid: lanes."""
    lane = tl.program_id(0)
    n = tl.load(nwords_ptr + lane)
    dst = tl.load(offsets_ptr + lane)
    for k0 in range(0, n, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        w = tl.load(scratch_ptr + lane.to(tl.int64) * capacity + k, mask=k < n)
        tl.store(out_ptr + dst + k, w, mask=k < n)


@triton.jit
def decode_kernel(words_ptr, lanes_ptr, lane_words_ptr, parts_ptr, order_ptr, table_ptr, cum_ptr, lut_ptr,
                  mu_ptr, b_ptr, a_ptr, steps_ptr, rows_ptr, out_ptr, status_ptr, num_lanes, max_symbols,
                  BLOCK_L: tl.constexpr):
    """ANS-decode lanes, dequantize and store each element in the output dtype at its place (contiguous
    or paged): no symbol buffer, nothing full-size but the output.  ``status[l]`` is 0 when lane ``l``
    ended exactly at the start of its words with state 0, as a valid stream must.  Grid: lane blocks."""
    lane, live, p, first, channels, t0, width = _lanes(lanes_ptr, num_lanes, BLOCK_L)
    start = tl.load(lanes_ptr + lane * L_FIELDS + L_WORDS, mask=live, other=0)
    row = parts_ptr + p * D_FIELDS
    out_base, sh, rows = tl.load(row + D_OUT), tl.load(row + D_SH), tl.load(row + D_ROWS)
    chan, tokens, a_base = tl.load(row + D_CHAN), tl.load(row + D_T), tl.load(row + D_A)
    dim = tl.load(row + D_D).to(tl.int32)
    sd = tl.load(row + D_SD)
    count = tl.where(live, channels * width, 0)
    pos = start + tl.load(lane_words_ptr + lane, mask=live, other=0).to(tl.int64)
    # seed the state from the last one or two words (constriction's AnsCoder(words))
    has1 = pos > start
    w1 = tl.load(words_ptr + pos - 1, mask=has1, other=0).to(tl.uint64)
    has2 = pos - 1 > start
    w2 = tl.load(words_ptr + pos - 2, mask=has2, other=0).to(tl.uint64)
    bad = has1 & (w1 == 0)  # a stream never ends in a zero word
    state = tl.where(has2, (w1 << 32) | w2, w1)
    pos -= has1.to(tl.int64) + has2.to(tl.int64)
    for i in range(max_symbols):
        active = i < count
        j = i // width
        g = tl.load(order_ptr + first + j, mask=active, other=0)
        table = tl.load(table_ptr + g, mask=active, other=0).to(tl.int64)
        tab = table * TABLE_STRIDE
        slot = state & SLOT_MASK
        # the symbol of the slot: the last s with cum[s] <= slot.  The slot's bucket bounds it to
        # [lut[b], lut[b + 1]], nearly always one symbol; a binary search covers the rest (the tails)
        bucket = table * LUT_STRIDE + (slot >> BUCKET_SHIFT).to(tl.int64)
        s = tl.load(lut_ptr + bucket, mask=active, other=0).to(tl.int64)
        size = tl.where(active, tl.load(lut_ptr + bucket + 1, mask=active, other=0).to(tl.int64) - s + 1, 1)
        while tl.max(size, 0) > 1:
            half = size // 2
            right = tl.load(cum_ptr + tab + s + half, mask=active & (half > 0), other=0).to(tl.uint64) <= slot
            s = tl.where(right, s + half, s)
            size = tl.where(right, size - half, half)
        lo = tl.load(cum_ptr + tab + s, mask=active, other=0).to(tl.uint64)
        hi = tl.load(cum_ptr + tab + s + 1, mask=active, other=1).to(tl.uint64)
        state = tl.where(active, (state >> PRECISION) * (hi - lo) + (slot - lo), state)
        refill = active & (state < 0x100000000) & (pos > start)
        w = tl.load(words_ptr + pos - 1, mask=refill, other=0).to(tl.uint64)
        state = tl.where(refill, (state << 32) | w, state)
        pos -= refill.to(tl.int64)
        c = (g - chan).to(tl.int32)  # 32-bit division per symbol: 64-bit is a long software routine
        h = c // dim
        t = t0 + (i - j * width)
        step = _token_scale(steps_ptr, a_ptr, a_base, h, t, tokens, active) * _channel_step(steps_ptr, b_ptr, g, active)
        step = step.to(tl.float64)
        x = tl.load(mu_ptr + g, mask=active, other=0.0).to(tl.float64) + (s - RADIX).to(tl.float64) * step
        x = tl.where(active, x, 0.0)  # idle lanes compute garbage; keep it finite
        dst = out_base + h * sh + (c - h * dim) * sd + tl.load(rows_ptr + rows + t, mask=active, other=0)
        tl.store(out_ptr + dst, _to_output(x.to(tl.float32), out_ptr.dtype.element_ty), mask=active)
    tl.store(status_ptr + lane, (bad | (state != 0) | (pos != start)).to(tl.int32), mask=live)
