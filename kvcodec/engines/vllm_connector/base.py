"""vLLM's connector base classes when vLLM is importable, else small stand-ins of the same protocol (so the connector
runs, and is tested, without vLLM)."""

from __future__ import annotations

import enum
from typing import Any

try:  # pragma: no cover - vLLM is not installed in the CPU test environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as ConnectorBase
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as MetadataBase
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata as WorkerMetadataBase
    HAVE_VLLM = True
except Exception:  # ImportError, or a vLLM that fails to import without a GPU
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's enum of the same name."""

        SCHEDULER = 0
        WORKER = 1

    class MetadataBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorMetadata``."""

    class WorkerMetadataBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorWorkerMetadata`` (what a worker tells the scheduler each step)."""

    class ConnectorBase:  # type: ignore[no-redef]
        """Stand-in for the parts of vLLM's ``KVConnectorBase_V1`` the connector uses."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            if self._kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def shutdown(self) -> None:
            return None
