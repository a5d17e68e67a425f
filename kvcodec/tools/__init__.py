"""Tooling around the runtime: evaluation, models, plots, texts, distortion metrics, computing kvtc calibrations
and importance profiles, fuzzing, the reference ANS coder and the golden-file generator.  The runtime never
imports this package at module level (tests/test_structure.py checks it); the CLI's commands and an engine's
first-use kvtc calibration import it when they run."""
