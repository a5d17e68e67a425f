""":class:`KVCodecConnector`, vLLM's ``KVConnectorBase_V1``: it builds the store at start-up and hands each of
vLLM's calls to its role's side (:class:`~.scheduler.SchedulerSide` in the scheduler process,
:class:`~.worker.WorkerSide` in a worker)."""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.blend.segments import default_anchor
from kvcodec.engines.vllm_connector.base import ConnectorBase, KVConnectorRole
from kvcodec.engines.vllm_connector.metadata import KVCodecConnectorMetadata, WorkerReport
from kvcodec.engines.vllm_connector.model import capture_model
from kvcodec.engines.vllm_connector.scheduler import SchedulerSide
from kvcodec.engines.vllm_connector.setup import (connector_store, engine_logger, parallel_sizes, served_model,
                                                 vllm_identity)
from kvcodec.engines.vllm_connector.worker import WorkerSide
from kvcodec.store import KVStore

log = engine_logger(__name__)


class KVCodecConnector(ConnectorBase):
    """vLLM ``KVConnectorBase_V1`` backed by a kvcodec :class:`~kvcodec.store.KVStore` (see the package doc);
    ``store`` replaces the one ``kv_connector_extra_config`` describes (tests)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *, store: KVStore | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        is_worker = role != KVConnectorRole.SCHEDULER
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        self.store = store if store is not None else connector_store(
            extra, served_model(vllm_config), vllm_identity(vllm_config, is_worker), hf_config=hf_config)
        if not is_worker and getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            log.warning("kvcodec connector: kv_load_failure_policy is 'fail', so a stored chunk that turns out missing or "
                        "damaged fails its request; set \"kv_load_failure_policy\": \"recompute\" in "
                        "--kv-transfer-config and vLLM recomputes those blocks instead")
        block_size = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", None) or 16)
        anchor = default_anchor(hf_config)  # segments are computed after the model's BOS
        caching = bool(getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False))
        tp_size, pp_size = parallel_sizes(vllm_config)  # a save counts as run once each rank's worker reports it
        self.scheduler = None if is_worker else SchedulerSide(self.store, block_size, anchor, prefix_caching=caching,
                                                              workers=tp_size * pp_size)
        self.worker = WorkerSide(self.store, vllm_config, block_size, anchor) if is_worker else None
        if is_worker:  # segment fusion recomputes with the model, which vLLM hands no connector
            capture_model()

    @property
    def stats(self) -> dict[str, int]:
        """This role's counters."""
        return (self.worker or self.scheduler).stats  # type: ignore[union-attr]

    def _metadata(self) -> KVCodecConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVCodecConnectorMetadata) else None

    # -- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.lookup(request, num_computed_tokens)  # type: ignore[union-attr]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, num_external_tokens)  # type: ignore[union-attr]

    def build_connector_meta(self, scheduler_output: Any) -> KVCodecConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)  # type: ignore[union-attr]

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.finished(request)  # type: ignore[union-attr]
        return False, None  # its KV was copied out for its save during its step: the blocks can go

    def update_connector_output(self, connector_output: Any) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, WorkerReport):
            self.scheduler.worker_report(report)  # type: ignore[union-attr]

    # -- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)  # type: ignore[union-attr]

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.begin_step(self._metadata())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_loads(self._metadata())  # type: ignore[union-attr]

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)  # type: ignore[union-attr]

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_layer(self._metadata(), layer_name, kv_layer)  # type: ignore[union-attr]

    def wait_for_save(self) -> None:
        self.worker.end_step(self._metadata())  # type: ignore[union-attr]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads finish within the forward pass; saves hold no blocks

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self.worker.report()  # type: ignore[union-attr]

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()  # type: ignore[union-attr]

    def shutdown(self) -> None:
        try:
            if self.worker is not None:
                self.worker.close()
        finally:
            self.store.close()

