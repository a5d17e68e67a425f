"""Engine hooks' first use of ``kvtc``: calibrate the served model when no calibration of it is installed.

An engine hook has the model, so ``codec="kvtc"`` with ``calibration="auto"`` (the default) needs no separate
``kvcodec calibrate`` step: the first start finds none installed under the model's identity (the digest of its
configuration and weights that its store's keys carry, :func:`kvcodec.store.identity.model_identity`), fits one
on the model (:func:`kvcodec.codecs.kvtc.fit.ensure_calibration`, installing it in the cache folder under that
identity) and says so in the log; later starts, and ``kvcodec calibrate --model M --install`` beforehand, find
it there.  Engines that run several processes at once (vLLM's scheduler and workers) take a lock per model, so one
of them calibrates and the others wait and find it.

The model is loaded (:mod:`kvcodec.models`) and the fit imported only when a first start calibrates, so a serving
process that finds its calibration installed never pays for either.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from typing import Any, Callable, Iterator

from kvcodec.codecs import codec_class, get_codec
from kvcodec.codecs.registry import parse_spec
from kvcodec.codecs.kvtc import cache_dir, calibration_for_model, register_calibration


def _specs(codec: Any, codec_options: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """The ids and options of a store's ``codec``: one id (with ``codec_options``) or a list of variant specs."""
    if isinstance(codec, str):
        codec_id, options = parse_spec(codec)
        return [(codec_id, {**options, **(codec_options or {})})]
    return [parse_spec(c) for c in codec if isinstance(c, str)] if isinstance(codec, (list, tuple)) else []


def wants_calibration(codec: Any, codec_options: dict[str, Any] | None) -> bool:
    """Whether a store of ``codec`` (an id with ``codec_options``, or a list of variant specs) resolves something
    made from the model at first use (:meth:`Codec.needs_model`: kvtc's calibration)."""
    return any(codec_class(i).needs_model(o) for i, o in _specs(codec, codec_options))


def ready_variants(codec: Any) -> list[str]:
    """The variants of a list that need nothing made from the model: what a store serves with meanwhile."""
    return [c for c in codec if not wants_calibration(c, None)] if isinstance(codec, (list, tuple)) else []


def load_served_model(model: str, log: Callable[[str], None]) -> Any:
    """The model an engine serves (its folder, a GGUF file or ``smollm2``), loaded with transformers on the CPU
    to calibrate it in float32, its weights held as stored: the engine's own copy of the weights is in a layout of
    its own."""
    from kvcodec.models import load_model

    log(f"kvtc: loading {model} with transformers on the CPU (float32) to calibrate it")
    return load_model(model, progress=False, stored_weights=True)


@contextlib.contextmanager
def _model_lock(model: str) -> Iterator[None]:
    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ".lock-" + hashlib.sha256(model.encode()).hexdigest()[:16])
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_model_calibration(model: str, load: Callable[[], Any], log: Callable[[str], None],
                             options: dict[str, Any] | None = None) -> str:
    """The digest of the kvtc calibration of ``model`` (the model's identity, as the store's keys carry it; a
    model's name finds only calibrations made before identities were recorded): the one installed, else one fitted
    now to ``load()`` (a :class:`kvcodec.models.LoadedModel`, loaded only then, whose name the file records for
    humans) with ``options`` for :func:`kvcodec.codecs.kvtc.fit.calibrate`, installed under ``model`` and
    registered."""
    with _model_lock(model):
        cal = calibration_for_model(model)
        if cal is not None:
            log(f"kvtc: using the installed calibration {cal.digest} of {cal.model} ({model})")
            return register_calibration(cal).digest
        from kvcodec.codecs.kvtc.fit import ensure_calibration

        return ensure_calibration(load(), log=log, model_digest=model, **(options or {})).digest


def calibrate_in_background(store: Any, load: Callable[[], Any], log: Callable[[str], None],
                            codec_options: dict[str, Any] | None = None,
                            calibration_options: dict[str, Any] | None = None, codec: Any = "kvtc") -> threading.Thread:
    """Calibrate the model of ``store`` (known by its identity, ``store.identity.model_digest``, else by
    ``store.model``) in a thread, then switch the store to ``codec`` (an id with ``codec_options``, or a list of
    variant specs) over that calibration: until then it saves and loads with the codec it has.  A first request then
    waits for nothing; a failed calibration is logged and the store keeps its codec."""
    name = store.identity.model_digest or store.model

    def run() -> None:
        try:
            digest = ensure_model_calibration(name, load, log, calibration_options)
            variants = [get_codec(i, **{**o, "calibration": digest}) if codec_class(i).needs_model(o) else
                        get_codec(i, **o) for i, o in _specs(codec, codec_options)]
            store.use_codec(variants[0] if isinstance(codec, str) else variants)
            store.measure_decodes()  # (in this thread: the engine's loads go on meanwhile)
            log(f"kvtc: calibration {digest} of {store.model} installed; saving and loading kvtc chunks from now on")
        except Exception as e:  # noqa: BLE001 - the engine keeps serving with the codec it has
            log(f"kvtc: calibrating {store.model} failed ({type(e).__name__}: {e}); keeping {store.codec.codec_id}")

    thread = threading.Thread(target=run, name="kvcodec-calibrate", daemon=True)
    thread.start()
    return thread


def needs_first_calibration(codec: Any, codec_options: dict[str, Any] | None, model: str) -> bool:
    """Whether a store of ``codec`` for ``model`` (its identity, as :func:`ensure_model_calibration` takes it) would
    have to make a calibration before its first save."""
    return wants_calibration(codec, codec_options) and calibration_for_model(model) is None
