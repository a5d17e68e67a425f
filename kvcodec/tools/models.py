"""Writing a model as a plain HuggingFace folder, for serving engines and their tests (loading a model is the
runtime's: :mod:`kvcodec.models`)."""

from __future__ import annotations

import os
import secrets
import shutil

import torch

from kvcodec.models import load_model


def export_hf_folder(spec: str, folder: str | os.PathLike[str], *, dtype: torch.dtype = torch.bfloat16) -> str:
    """Write model ``spec`` (``smollm2``, a GGUF file or a folder) as a plain HuggingFace folder (``config.json``,
    safetensors weights in ``dtype``, tokenizer) that serving engines such as vLLM load.  Written into a temporary
    folder next to ``folder`` and renamed, so a folder that exists is complete.  Returns ``folder``."""
    folder = os.fspath(folder)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    loaded = load_model(spec, cached=False)  # a copy of its own: it is changed below
    model = loaded.model
    # A GGUF-loaded model remembers its quantization, and save_pretrained refuses to write it; its weights are
    # already dequantized, so it is saved as the plain model it now is.
    for attr in ("hf_quantizer", "quantization_config"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".export-{secrets.token_hex(8)}")
    os.mkdir(tmp)  # the umask's mode, as kvcodec.files gives files (mkdtemp would make it 0700)
    try:
        model.to(dtype).save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(folder, "config.json")):  # not another process that got there first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
