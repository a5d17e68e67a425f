"""The worker's model, which segment fusion runs (:mod:`.fusion`).

vLLM's connector API hands a connector its paged KV memory, never the model.  vLLM 0.32's worker creates the
connector (``Worker.initialize_from_config``) and then calls its model runner's ``initialize_kv_cache``, which
registers the KV memory with the connector; the model is loaded before both.  :func:`capture_model` wraps that one
method of ``GPUModelRunner`` (``CPUModelRunner`` calls it through ``super()``) so that it records the runner's model
first, in this process.  It changes nothing else, and runs only in a worker's connector.  LMCache's CacheBlend
needs the same handle and asks users to patch vLLM's worker for it (``VLLMModelTracker.register_model``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

_model: weakref.ReferenceType | None = None


def capture_model() -> bool:
    """Record, from now on in this process, the model of the runner that next initializes its KV cache; False
    where this vLLM has no such method (fusion then reports the model missing)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # no vLLM, or one without v1's runner
        return False
    original = GPUModelRunner.initialize_kv_cache
    if getattr(original, "_kvcodec_captures", False):
        return True

    @functools.wraps(original)
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _model
        model = getattr(self, "model", None)
        _model = None if model is None else weakref.ref(model)
        return original(self, *args, **kwargs)

    initialize_kv_cache._kvcodec_captures = True  # type: ignore[attr-defined]
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    return True


def worker_model() -> Any:
    """The model :func:`capture_model` recorded in this process, or None."""
    return None if _model is None else _model()
