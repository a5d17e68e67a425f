"""How every engine hook opens its store: one :class:`~kvcodec.store.config.StoreConfig`, the engine's identity and
shape, the configuration's calibration policy for codecs made from the model (kvtc), and the model's channel
profile (cachegen, kvfetcher).

A calibration is named by the model identity (:func:`kvcodec.store.identity.model_identity`), the same digest that
seeds the store's keys, so ``kvcodec calibrate --model M --install`` and every hook serving ``M`` find the same one.
A profile is found one way in every hook (:func:`use_model_profile`): by the store's model name, else by the
signature of the served model's configuration, so a hook serving a folder of a known model gets its profile under
whatever name the engine gives it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Sequence

from kvcodec.engines.auto_calibration import (calibrate_in_background, ensure_model_calibration,
                                              needs_first_calibration, ready_variants, wants_calibration)
from kvcodec.errors import InvalidInputError
from kvcodec.profiles import find_profile, find_profile_for_config, register_profile
from kvcodec.store import ChunkShape, KVStore, StorageTier
from kvcodec.store.config import StoreConfig
from kvcodec.store.identity import CacheIdentity


def calibration_name(config: StoreConfig, model: str, identity: CacheIdentity) -> str:
    """The name a calibration of the served model is installed and found under: its model identity (the
    engine's model name only where the hook could not compute one)."""
    return identity.model_digest or config.model or model


def use_model_profile(store: KVStore, *, hf_config: Any = None, model_path: str | None = None,
                      log: Callable[[str], None]) -> str | None:
    """Make the channel profile of the served model the one cachegen and kvfetcher find for ``store.model``: one
    registered or shipped under that name, else one measured on a model of the same signature (``hf_config``, or
    the ``config.json`` of the folder ``model_path``).  Returns the profile's own model name; logs which, or that a
    codec using a profile falls back to steps from the data."""
    profile = find_profile(store.model)
    if profile is None:
        if hf_config is None and model_path and os.path.isfile(os.path.join(model_path, "config.json")):
            with open(os.path.join(model_path, "config.json"), "rb") as f:
                hf_config = json.loads(f.read(1 << 20))
        profile = find_profile_for_config(hf_config) if hf_config is not None else None
        if profile is not None:
            register_profile(dataclasses.replace(profile, model=store.model))
    users = [c.codec_id for c in store.variants if c.uses_profile]
    if profile is not None and users:
        log(f"kvcodec: model {store.model} uses the channel profile of {profile.model}")
    elif users:
        log(f"kvcodec: no channel profile matches model {store.model} (see `kvcodec profile`); {', '.join(users)} "
            "take their steps from the data, at lower quality")
    return None if profile is None else profile.model


def time_decodes(store: KVStore, log: Callable[[str], None]) -> None:
    """Time the decode of each of ``store``'s variants it has no rate of (:meth:`KVStore.measure_decodes`; only a
    store of several variants with the engine's shape does), so that the engine's first load plans on this
    machine's rates; ``log`` says which.  A hook that learns the shape after :func:`open_store` calls this then."""
    measured = store.measure_decodes()
    if measured:
        log("kvcodec: decode rates timed at start (tokens/s): "
            + ", ".join(f"{codec} {tps:.3g}" for codec, tps in measured.items()))


def open_store(config: StoreConfig, *, model: str, identity: CacheIdentity, log: Callable[[str], None],
               load_model: Callable[[], Any] | None = None, shape: ChunkShape | None = None,
               engine_chunk_tokens: int | None = None, disk_folder: str | None = None,
               tiers: Sequence[StorageTier] | None = None, hf_config: Any = None,
               model_path: str | None = None) -> KVStore:
    """The hook's store, as :meth:`StoreConfig.store` makes it.  When its codec is made from the model (kvtc) and
    no calibration of the model is installed, ``load_model()`` (the served model, loaded with transformers on the
    CPU; called only then) is calibrated now (``calibrate="now"``), or in the background while the store serves
    with ``fallback_codec`` (``"background"``, the default); ``log`` says which.  ``tiers``: tiers the hook has
    already made (None: the configuration's).  ``hf_config`` or ``model_path`` (the served folder) find the model's
    profile (:func:`use_model_profile`).  Given ``shape``, the store's decodes are timed (:func:`time_decodes`)."""
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
    serving = {"codec": ready_variants(codec) or config.fallback_codec} if later else {}
    store = config.store(**common, **serving)
    if store.telemetry_file is not None and store.telemetry_file.restored:
        log(store.telemetry_file.restored)  # what a fresh engine's first loads plan on
    use_model_profile(store, hf_config=hf_config, model_path=model_path, log=log)
    if not later:
        time_decodes(store, log)
        return store
    log(f"kvtc: no calibration of {name} installed; serving with {store.codec.codec_id} while it is made in "
        "the background")
    calibrate_in_background(store, load_model, log, options, config.calibration_options, codec)  # type: ignore[arg-type]
    return store
