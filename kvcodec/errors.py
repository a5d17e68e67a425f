"""Exception hierarchy: callers catch :class:`KVCodecError` for anything kvcodec raises.

The classes are defined in :mod:`kvcodec.formats.errors` (the format definition, the bottom layer, raises them);
this is their public name."""

from kvcodec.formats.errors import (CorruptDataError, DeviceUnavailableError, InvalidInputError, KVCodecError,
                                    LimitExceededError, MissingCalibrationError, UnknownCodecError, UnsupportedError,
                                    UnsupportedVersionError)

__all__ = ["KVCodecError", "CorruptDataError", "InvalidInputError", "UnsupportedError", "UnsupportedVersionError",
           "UnknownCodecError", "DeviceUnavailableError", "LimitExceededError", "MissingCalibrationError"]
