"""kvtc's levels: the uniform quantization step of keys and of values in the weighted transform domain
(keys in attention-logit units, values in units of the next layer's normalized input; see calibration.py).
Set from measurements on SmolLM2 (bench/kvtc_probe.py); 0 is the smallest output."""

LEVELS: dict[int, tuple[float, float]] = {
    0: (1.0, 0.08),
    1: (0.7, 0.055),
    2: (0.5, 0.04),
    3: (0.35, 0.028),
    4: (0.25, 0.02),
}
DEFAULT_LEVEL = 2
