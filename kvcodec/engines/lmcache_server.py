"""The module ``lmcache server`` imports for kvcodec's L2 adapters (``"type": "plugin"``, ``"module_path":
"kvcodec.engines.lmcache_server"``): :class:`KVCodecFSL2Adapter` and :class:`KVCodecTierL2Adapter`
(:mod:`kvcodec.engines.lmcache.server_adapters`).  Importing it registers kvcodec's serializer (``"serde":
{"type": "kvcodec", ...}``), which the server builds after importing the adapter's module::

    lmcache server --host 127.0.0.1 --port 5555 --http-port 8080 --l1-size-gb 4 --eviction-policy LRU \\
      --l2-adapter '{"type": "plugin", "module_path": "kvcodec.engines.lmcache_server",
                     "class_name": "KVCodecFSL2Adapter", "adapter_params": {"base_path": "/var/cache/lmcache"},
                     "serde": {"type": "kvcodec", "codec": "cachegen", "num_heads": 8}}'
    # or a kvcodec tier: "class_name": "KVCodecTierL2Adapter",
    #                    "adapter_params": {"url": "mooncake://10.0.0.5:50051?segment=512MiB"}   (or redis://, file://)
"""

from kvcodec.engines.lmcache.serde import register
from kvcodec.engines.lmcache.server_adapters import KVCodecFSL2Adapter, KVCodecFSL2AdapterConfig, KVCodecTierL2Adapter

register()

__all__ = ["KVCodecFSL2Adapter", "KVCodecFSL2AdapterConfig", "KVCodecTierL2Adapter"]
