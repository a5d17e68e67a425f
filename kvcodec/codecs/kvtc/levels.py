"""kvtc's levels: the uniform quantization step of keys and of values in the weighted transform domain
(keys in attention-logit units, values in units of the next layer's normalized input; see calibration.py).
0 is the smallest output.  Measured on SmolLM2 with one all-layer basis on the three texts of
bench/results/rate_distortion.md (1536-token prefix, 512 scored tokens); level 2 (default, with the default fine
rows and min_std) meets the target of at most 0.6 bits/element at at most +1% perplexity and at least 94% greedy
agreement there (0.552 bits, +0.62%, 95.3%)."""

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
# default then (bench/studies/results/kvtc_truncation.md): 0 gives 0.596 bits/element at +0.67% perplexity and decodes
# 7.1 M elements per CPU-second; 0.2 gives 0.544 bits at +0.77% and 12.0 M; 0.3 crosses +1% (+1.32%).  With fine
# tokens (below) the default is 0.23: they take back more of the KL than the components between 0.2 and 0.23 steps
# gave, for fewer bytes (bench/studies/results/kvtc_heldout-levers.md).
DEFAULT_MIN_STD = 0.23
# Fine tokens (see KVTC.fine_rows): per chunk, the tokens with the smallest keys and values against the chunk's
# (attention sinks) are coded at steps 2**-octaves of the level's.  Measured at level 2 with the default calibration
# on the evaluation texts and the held-out kinds (bench/studies/results/kvtc_heldout-levers.md, bits and KL):
# none and min_std 0.2: 0.563 / 0.0118 and 0.609 / 0.0140; 3 rows a chunk at a quarter of the step and min_std
# 0.23: 0.552 / 0.0088 and 0.591 / 0.0116; 2 rows (min_std 0.22) and 4 (0.24) leave more KL for their bytes.
DEFAULT_FINE_TOKENS = 3
DEFAULT_FINE_OCTAVES = 2
# Window grading (see KVTC.row_gains): in a sliding-window layer a token's step grows by this many octaves from the
# window's newest token to its oldest.  The oldest tokens leave the window first and are read by fewer and less
# attentive queries: on Gemma 3 270M (bits=1.0, ungraded, three evaluation texts) the windowed layers' newest half
# put back exact took the KL from 0.0136 to 0.0062, their oldest half only to 0.0124.  At the same rate 1 octave gave
# KL 0.0103, 2 0.0101, 3 0.0136 (bench/studies/results/kvtc_window_grading.md); 1, the gentler, since a shorter continuation
# than the window reads the older tokens relatively more.  Layers that hold every token (all of SmolLM2's) are not
# graded.
DEFAULT_WINDOW_OCTAVES = 1.0
# The continuation's KL per token (nats) that a calibration's measured sensitivity predicts for the default level
# (kvcodec.codecs.kvtc.sensitivity.predicted_kl): a calibration that measures it scales its weights so that level 2
# predicts this on every model.  It is what SmolLM2's calibration with the matrices' weights predicts (the levels
# were measured there; 0.013111 from the six default texts, 14,837 tokens), so its default level stays where it was.
# Measured, the prediction is 1.1-1.5 times the KL on the evaluation texts (SmolLM2 level 2: 0.0131 against 0.0088;
# Gemma 3 270M with equalized layers, level 2: 0.040 against 0.036, level 4: 0.015 against 0.012).
LEVEL_KL = 0.0131
