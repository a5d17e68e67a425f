"""kvtc's levels: the uniform quantization step of keys and of values in the weighted transform domain
(keys in attention-logit units, values in units of the next layer's normalized input; see calibration.py).
Set from measurements on SmolLM2 (bench/kvtc_probe.py); 0 is the smallest output."""

LEVELS: dict[int, tuple[float, float]] = {
    0: (0.4, 1.0),
    1: (0.3, 0.8),
    2: (0.2, 0.6),
    3: (0.14, 0.45),
    4: (0.1, 0.3),
}
DEFAULT_LEVEL = 2
