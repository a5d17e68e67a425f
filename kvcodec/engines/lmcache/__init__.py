"""kvcodec inside LMCache, split by role: :mod:`~kvcodec.engines.lmcache.settings` (LMCache's settings as one
:class:`~kvcodec.store.config.StoreConfig`, and the store every part opens), :mod:`~.remote_connector` (the remote
storage plugin), :mod:`~.serde` (the multiprocess server's serializer) and :mod:`~.server_adapters` (its L2
adapters; they import LMCache).  Users name the thin modules :mod:`kvcodec.engines.lmcache_plugin` and
:mod:`kvcodec.engines.lmcache_server` in their configurations."""
