"""kvtc's levels: the uniform quantization step of keys and of values in the weighted transform domain
(keys in attention-logit units, values in units of the next layer's normalized input; see calibration.py).
0 is the smallest output.  Measured on SmolLM2 with one all-layer basis on the three texts of
bench/results/rate_distortion.md (1536-token prefix, 512 scored tokens); level 2 (default) meets the issue's
target of at most 0.6 bits/element at at most +1% perplexity and at least 94% greedy agreement."""

LEVELS: dict[int, tuple[float, float]] = {
    0: (0.8, 2.4),
    1: (0.55, 1.7),
    2: (0.4, 1.2),
    3: (0.3, 0.9),
    4: (0.2, 0.6),
}
DEFAULT_LEVEL = 2
# Components whose calibration std is below this many steps are not coded (see KVTC.coded_components); 0 codes them all.
# Measured at level 2 on the three texts of bench/rate_distortion.py with the four-license calibration that was the
# default then (bench/results/kvtc_truncation.md): 0 gives 0.596 bits/element at +0.67% perplexity and decodes
# 7.1 M elements per CPU-second; 0.2 gives 0.544 bits at +0.77% and 12.0 M; 0.3 crosses +1% (+1.32%).
DEFAULT_MIN_STD = 0.2
