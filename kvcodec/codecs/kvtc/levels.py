"""kvtc's levels: the uniform quantization step of keys and of values in the weighted transform domain
(keys in attention-logit units, values in units of the next layer's normalized input; see calibration.py).
0 is the smallest output.  Measured on SmolLM2 with one all-layer basis (bench/results/kvtc_probe.md: one text,
license:GPL-3, 1024-token prefix, 256 scored tokens): level 2 = 0.56 bits/element at +0.04% perplexity and
94.1% greedy agreement, level 3 = 0.72 bits at -0.24% and 96.1%, level 4 = 1.07 bits at +0.66% and 98.4%.
Levels 0 and 1 extend the same geometric ladder and are not measured yet."""

LEVELS: dict[int, tuple[float, float]] = {
    0: (0.8, 2.4),
    1: (0.55, 1.7),
    2: (0.4, 1.2),
    3: (0.3, 0.9),
    4: (0.2, 0.6),
}
DEFAULT_LEVEL = 2
