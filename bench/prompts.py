"""The model folder and prompts the vLLM benches share (:func:`vllm_prompt`)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def vllm_prompt(tokens: int) -> tuple[Path, list[int], list[int]]:
    """SmolLM2's HuggingFace folder (made once, cached in ``.cache/models``), the first ``tokens`` token ids of
    ``license:GPL-3`` and a 256-token warm-up prompt from later in the same text (no prefix in common)."""
    from transformers import AutoTokenizer

    from kvcodec.texts import load_text
    from kvcodec.tools.models import export_hf_folder

    model = Path(export_hf_folder("smollm2", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"))
    ids = AutoTokenizer.from_pretrained(model)(load_text("license:GPL-3")).input_ids
    return model, ids[:tokens], ids[4000:4000 + 256]
