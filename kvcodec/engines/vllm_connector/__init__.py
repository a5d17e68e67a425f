"""A vLLM v1 KV connector that keeps prompt KV in a :class:`~kvcodec.store.KVStore`, compressed by a kvcodec codec.

Load it with::

    python -m vllm.entrypoints.openai.api_server --model <model> --kv-transfer-config '{"kv_connector": "KVCodecConnector",
        "kv_connector_module_path": "kvcodec.engines.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"codec": "cachegen", "tiers": ["cpu", "disk:/var/cache/kvcodec",
                                      "redis://127.0.0.1:6379/0?password_file=/etc/kvcodec/redis-password"]}}'

``kv_connector_extra_config`` holds :class:`~kvcodec.store.config.StoreConfig`'s settings (docs/engines.md, "Store
settings"; ``tiers`` defaults to ``["cpu", "disk"]``, a bare ``disk`` being the private ``~/.cache/kvcodec/vllm``).
vLLM logs it, so it never holds a secret: the store's comes from ``$KVCODEC_STORE_SECRET`` or ``secret_file``, a
Redis password from the tier URL's ``password_file`` or ``password_env``.

vLLM runs the scheduler-side and the worker-side connector in different processes, each with its own store: a
``cpu``/``gpu`` tier is private to its process, so every chunk is also written to every disk, Redis and Mooncake
tier, where the scheduler's lookup finds it.  The parts:

- :mod:`.connector`: the ``KVConnectorBase_V1`` class, which hands vLLM's calls to its role's side;
- :mod:`.scheduler`: lookups, and each step's loads and saves (:mod:`.metadata`);
- :mod:`.worker`: the paged KV memory, loads into it through the store's one load path, saves out of it; nothing
  that goes wrong is raised into vLLM, its blocks are reported as load errors and recomputed;
- :mod:`.saves`: the saves' own thread, so that a save delays no token (a prompt that needs a save under way
  waits for it: :mod:`.scheduler`);
- :mod:`.requests`: a request's salt (``cache_salt``, prompt embeddings, LoRA adapter, multimodal items) and what
  it asks of segments (``kv_transfer_params={"kvcodec": ...}``);
- :mod:`.fusion`: a prompt's stored segments fused into its blocks, with selective recompute through vLLM's own
  decoder layers, and :mod:`.model`, which records the worker's model for it (docs/segments.md, "In vLLM");
- :mod:`.setup`: the store, the caches' identity (the model's configuration and weights, KV dtype, rank), the
  model's channel profile and the paged layout, once at start-up;
- :mod:`.base`: vLLM's base classes, or stand-ins when vLLM is not installed.
"""

from kvcodec.engines.vllm_connector.base import HAVE_VLLM, KVConnectorRole
from kvcodec.engines.vllm_connector.connector import KVCodecConnector
from kvcodec.engines.vllm_connector.metadata import KVCodecConnectorMetadata, LoadSpec, SaveSpec

__all__ = ["KVCodecConnector", "KVCodecConnectorMetadata", "LoadSpec", "SaveSpec", "KVConnectorRole", "HAVE_VLLM"]
