"""kvtc's levels: the uniform quantization step of keys and of values in the weighted transform domain
(keys in attention-logit units, values in units of the next layer's normalized input; see calibration.py).
0 is the smallest output.  Measured on SmolLM2 with one all-layer basis (bench/results/kvtc_probe.md, one text):
(0.2, 0.6) gave 1.07 bits/element at +0.66% perplexity and 98.4% greedy agreement, (0.1, 0.4) 1.69 bits at
-0.04%; the others are interpolated on the same log scale, not measured yet."""

LEVELS: dict[int, tuple[float, float]] = {
    0: (0.4, 1.2),
    1: (0.3, 0.9),
    2: (0.2, 0.6),
    3: (0.14, 0.5),
    4: (0.1, 0.4),
}
DEFAULT_LEVEL = 2
