"""How every engine hook opens its store: one :class:`~kvcodec.store.config.StoreConfig`, the engine's identity and
shape, and the configuration's calibration policy for codecs made from the model (kvtc).

A calibration is named by the model identity (:func:`kvcodec.store.identity.model_identity`), the same digest that
seeds the store's keys, so ``kvcodec calibrate --model M --install`` and every hook serving ``M`` find the same one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvcodec.engines.auto_calibration import (calibrate_in_background, ensure_model_calibration,
                                              needs_first_calibration, ready_variants, wants_calibration)
from kvcodec.errors import InvalidInputError
from kvcodec.store import ChunkShape, KVStore, StorageTier
from kvcodec.store.config import StoreConfig
from kvcodec.store.identity import CacheIdentity


def calibration_name(config: StoreConfig, model: str, identity: CacheIdentity) -> str:
    """The name a calibration of the served model is installed and found under: its model identity (the
    engine's model name only where the hook could not compute one)."""
    return identity.model_digest or config.model or model


def open_store(config: StoreConfig, *, model: str, identity: CacheIdentity, log: Callable[[str], None],
               load_model: Callable[[], Any] | None = None, shape: ChunkShape | None = None,
               engine_chunk_tokens: int | None = None, disk_folder: str | None = None,
               tiers: Sequence[StorageTier] | None = None) -> KVStore:
    """The hook's store, as :meth:`StoreConfig.store` makes it.  When its codec is made from the model (kvtc) and
    no calibration of the model is installed, ``load_model()`` (the served model, loaded with transformers on the
    CPU; called only then) is calibrated now (``calibrate="now"``), or in the background while the store serves
    with ``fallback_codec`` (``"background"``, the default); ``log`` says which.  ``tiers``: tiers the hook has
    already made (None: the configuration's)."""
    codec, options = config.codec, config.codec_options
    name = calibration_name(config, model, identity)
    wanted = wants_calibration(codec, options)
    if wanted and load_model is None and needs_first_calibration(codec, options, name):
        raise InvalidInputError(f"codec {codec!r} needs a calibration of the model, none is installed for {name}, "
                                "and this hook cannot load the model to make one: run `kvcodec calibrate --model "
                                "MODEL --install` first")
    later = wanted and config.calibrate == "background" and needs_first_calibration(codec, options, name)
    if wanted and not later:
        ensure_model_calibration(name, load_model, log, config.calibration_options)  # type: ignore[arg-type]
    common = dict(model=model, identity=identity, shape=shape, engine_chunk_tokens=engine_chunk_tokens,
                  disk_folder=disk_folder, tiers=tiers)
    if not later:
        return config.store(**common)
    serving = ready_variants(codec) or config.fallback_codec
    store = config.store(**common, codec=serving)
    log(f"kvtc: no calibration of {name} installed; serving with {store.codec.codec_id} while it is made in "
        "the background")
    calibrate_in_background(store, load_model, log, options, config.calibration_options, codec)  # type: ignore[arg-type]
    return store
