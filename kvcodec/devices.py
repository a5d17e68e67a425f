"""The torch device a call decodes to, checked before any work, so that a device this machine lacks is reported
as such (:class:`DeviceUnavailableError`) and not as damaged data when the first tensor fails to land on it."""

from __future__ import annotations

import torch

from kvcodec.errors import DeviceUnavailableError, InvalidInputError


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` (default cpu) as a :class:`torch.device` that can hold tensors here."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "meta":
        raise DeviceUnavailableError("the meta device holds no data; decode to cpu or cuda")
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, NotImplementedError) as e:
        reason = (str(e) or type(e).__name__).splitlines()[0].split(". ")[0]
        raise DeviceUnavailableError(f"device {str(dev)!r} is not available here: {reason}") from None
    return dev
