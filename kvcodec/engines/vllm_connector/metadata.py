"""What the scheduler side tells the worker side each step (the loads and saves of that step's requests), and what
the workers tell it back (the saves they have written)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcodec.engines.vllm_connector.base import MetadataBase, WorkerMetadataBase


@dataclass
class LoadSpec:
    """Load tokens ``start .. end-1`` of ``token_ids`` (the prompt up to the end of the chunk holding token
    ``end-1``) into the blocks ``block_ids``; ``salt`` keys the request (:mod:`.requests`).  With ``segments``
    (token counts after the anchor), ``token_ids`` are the anchor and those segments, fused with recompute ``share``
    (None: the loading controller's) instead of loaded as a prefix."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    salt: str | None = None
    segments: tuple[int, ...] = ()
    share: float | None = None


@dataclass
class SaveSpec:
    """Save the KV of ``token_ids`` (a prompt), held in the blocks ``block_ids``, under ``salt``; with
    ``segment``, the prompt after the anchor as a segment instead."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    salt: str | None = None
    segment: bool = False


@dataclass
class KVCodecConnectorMetadata(MetadataBase):
    """One step's loads and saves, and ``step_tokens``: the tokens vLLM computes in it (the worker times its
    prefill speed with them)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    step_tokens: int = 0


@dataclass
class SavesRun(WorkerMetadataBase):
    """The requests whose saves the workers ran (written, or failed) since their last step, each with the number of
    workers that report it (vLLM sums the workers' reports of one step with :meth:`aggregate`)."""

    req_ids: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: SavesRun) -> SavesRun:
        counts = dict(self.req_ids)
        for rid, n in other.req_ids.items():
            counts[rid] = counts.get(rid, 0) + n
        return SavesRun(counts)
