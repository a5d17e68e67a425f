"""What the scheduler side tells the worker side each step (the loads and saves of that step's requests), and what
the workers tell it back (the saves they have run, and what their stores measured)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcodec.engines.vllm_connector.base import MetadataBase, WorkerMetadataBase
from kvcodec.store.telemetry import Estimates


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
class WorkerReport(WorkerMetadataBase):
    """What the workers tell the scheduler side after a step (vLLM's worker metadata): ``saves_run``, the requests
    whose saves they ran (written, or failed) since their last report, each with the number of workers that report
    it; and ``estimates``, their store's measurements (links, decode rates, vLLM's prefill speed) where they changed,
    which the scheduler's lookups weigh.  vLLM merges the workers' reports of one step with :meth:`aggregate`."""

    saves_run: dict[str, int] = field(default_factory=dict)
    estimates: Estimates | None = None

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        counts = dict(self.saves_run)
        for rid, n in other.saves_run.items():
            counts[rid] = counts.get(rid, 0) + n
        return WorkerReport(counts, self.estimates or other.estimates)  # one rank's measurements stand for all
