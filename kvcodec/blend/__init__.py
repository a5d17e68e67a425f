"""Reusing documents' KV wherever they sit in a prompt (CacheBlend-style): segments stored apart from any prefix
(:mod:`kvcodec.blend.segments`) and fused into a prompt with a share of their tokens recomputed
(:mod:`kvcodec.blend.fusion`; the model runs in an engine hook, :mod:`kvcodec.engines.transformers_fusion`).
"""

from kvcodec.blend.fusion import (DEFAULT_SHARE, FusedContext, FusionReport, RecomputeSchedule, SegmentHit, assemble,
                                  deviation)
from kvcodec.blend.segments import LoadedSegment, SegmentStore, default_anchor

__all__ = ["DEFAULT_SHARE", "FusedContext", "FusionReport", "RecomputeSchedule", "SegmentHit", "assemble", "deviation",
           "LoadedSegment", "SegmentStore", "default_anchor"]
