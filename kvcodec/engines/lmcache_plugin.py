"""The module LMCache users name for kvcodec's remote storage plugin and serializer (docs/engines.md, "LMCache").

``remote_storage_plugin.kvcodec.module_path: kvcodec.engines.lmcache_plugin`` with ``class_name:
KVCodecConnectorAdapter`` (:mod:`kvcodec.engines.lmcache.remote_connector`); :func:`register` registers the
serializer ``"kvcodec"`` for the multiprocess server's L2 adapters (:mod:`kvcodec.engines.lmcache.serde`).
"""

from kvcodec.engines.lmcache.remote_connector import (HAVE_LMCACHE, KVCodecConnectorAdapter, KVCodecRemoteConnector,
                                                      connector_from_url)
from kvcodec.engines.lmcache.serde import (HAVE_LMCACHE_SERDE, KVCodecDeserializer, KVCodecSerializer, make_serde,
                                           register)

__all__ = ["KVCodecConnectorAdapter", "KVCodecRemoteConnector", "connector_from_url", "KVCodecSerializer",
           "KVCodecDeserializer", "make_serde", "register", "HAVE_LMCACHE", "HAVE_LMCACHE_SERDE"]
