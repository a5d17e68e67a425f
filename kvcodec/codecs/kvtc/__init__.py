"""``kvtc``: cross-layer PCA transform coding of KV caches over a per-model calibration."""

from kvcodec.codecs.kvtc.calibration import (Calibration, MissingCalibrationError, cache_dir, calibrate,
                                             calibration_for_model, ensure_calibration, find_calibration, install,
                                             register_calibration)
from kvcodec.codecs.kvtc.codec import KVTC
from kvcodec.codecs.kvtc.reposition import reposition

__all__ = ["KVTC", "Calibration", "MissingCalibrationError", "cache_dir", "calibrate", "calibration_for_model", "ensure_calibration",
           "find_calibration", "install", "register_calibration", "reposition"]
