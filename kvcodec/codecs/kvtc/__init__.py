"""``kvtc``: cross-layer PCA transform coding of KV caches over a per-model calibration.

Fitting a calibration to a model: :mod:`kvcodec.codecs.kvtc.fit`."""

from kvcodec.codecs.kvtc.calibration import (Calibration, cache_dir, calibration_for_model, find_calibration, install,
                                             register_calibration)
from kvcodec.codecs.kvtc.codec import KVTC
from kvcodec.errors import MissingCalibrationError

__all__ = ["KVTC", "Calibration", "MissingCalibrationError", "cache_dir", "calibration_for_model", "find_calibration",
           "install", "register_calibration"]
