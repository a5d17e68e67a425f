"""Reading and writing the chunked container (format v1, see SPEC.md and kvcodec.formats.v1)."""

from kvcodec.container.file import ContainerFile, FrameData
from kvcodec.container.stream import iter_frames
from kvcodec.container.writer import Frame, write_container

__all__ = ["ContainerFile", "FrameData", "Frame", "iter_frames", "write_container"]
