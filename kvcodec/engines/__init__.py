"""Engine integrations: hooks that let a serving engine save KV to and load KV from a :class:`kvcodec.store.KVStore`."""
