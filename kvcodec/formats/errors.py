"""Exception hierarchy: callers catch :class:`KVCodecError` for anything kvcodec raises.

Public as :mod:`kvcodec.errors`; defined here, in the bottom layer, because the format definition
(:mod:`kvcodec.formats.v1`) raises them and imports nothing above itself."""

from __future__ import annotations


class KVCodecError(Exception):
    """Base class of every error kvcodec raises on purpose."""


class CorruptDataError(KVCodecError):
    """The input is damaged or truncated: a checksum, a length or a structure is wrong."""


class UnsupportedError(KVCodecError):
    """The input is well formed but asks for something this build or machine cannot do:
    a newer container version, a codec that is not registered, a device that is not there."""


class UnsupportedVersionError(UnsupportedError):
    """The container's major version is not one this build reads."""


class UnknownCodecError(UnsupportedError):
    """No codec with the given id is registered."""


class InvalidInputError(KVCodecError, ValueError):
    """A caller passed arguments that cannot be encoded (bad shapes, dtypes, configs)."""


class LimitExceededError(KVCodecError):
    """A decode would take more memory than the caller allowed (``max_bytes``): the header declares a larger
    output than the limit, or a section longer than it.  Raised before anything that size is allocated."""


class DeviceUnavailableError(UnsupportedError):
    """The device or implementation asked for is not available here (a CUDA device on a CPU-only torch, the meta
    device, which holds no data): a problem of the environment, not of the data."""


class MissingCalibrationError(KVCodecError):
    """A container names a kvtc calibration that is not found in the search path."""
