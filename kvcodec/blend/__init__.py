"""Reusing documents' KV wherever they sit in a prompt (CacheBlend-style): segments stored apart from any prefix
(:mod:`kvcodec.blend.segments`) and fused into a prompt with a share of their tokens recomputed
(:mod:`kvcodec.blend.fusion`, with the loading controller that picks the share; the model runs in an engine hook,
:mod:`kvcodec.engines.transformers_fusion`).
"""

from kvcodec.blend.fusion import (DEFAULT_SHARE, SHARE_FLOOR, FusedContext, FusionReport, RecomputeSchedule,
                                  SegmentHit, SegmentLoads, ShareChoice, computed_front, controlled_share, deviation,
                                  estimated_load_s, segment_shares)
from kvcodec.blend.segments import LoadedSegment, SegmentStore, default_anchor

__all__ = ["DEFAULT_SHARE", "SHARE_FLOOR", "FusedContext", "FusionReport", "RecomputeSchedule", "SegmentHit",
           "SegmentLoads", "ShareChoice", "computed_front", "controlled_share", "deviation", "estimated_load_s",
           "segment_shares",
           "LoadedSegment", "SegmentStore", "default_anchor"]
