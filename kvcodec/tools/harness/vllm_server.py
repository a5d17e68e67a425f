"""One real vLLM engine (its CPU build) in a process of its own, driven by tests and benchmarks over pipes.

``python -m kvcodec.tools.harness.vllm_server CONFIG_JSON`` starts ``vllm.LLM`` on the config's model (with its
``kv_transfer_config``, when given), prints ``KVCODEC-REPLY {"ready": ...}``, then answers each JSON request read
from stdin with one ``KVCODEC-REPLY <json>`` line on stdout (vLLM's own logging shares the streams, hence the
prefix).  Requests: ``{"prompt_token_ids": [...], "max_tokens": 16, "logprobs": true}`` generates greedily and
replies with the tokens, their log-probabilities, ``num_cached_tokens`` and the seconds it took; with
``"prompt_embeds"`` (base64 of ``torch.save`` bytes, as vLLM's own API takes them) and ``"prompt_is_token_ids"`` the
prompt is vLLM's mixed one, whose ids at the positions marked False are placeholders for embedding rows (an engine
started with ``enable_prompt_embeds``); ``{"op": "quit"}`` stops.

:class:`Engine` is the parent's side.  A process per engine lets tests start engines with different connector
settings, and a "new process" really is one (nothing of the connector's memory survives).
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

PREFIX = "KVCODEC-REPLY "
MODULE = "kvcodec.tools.harness.vllm_server"  # what the engine process runs
# vLLM CPU reserves one more core when a kv_transfer_config is set, which changes the worker's thread count and so
# its bfloat16 numerics: every engine here pins the reservation, so runs with and without the connector compare.
# float32: on CPUs without native bfloat16 (AVX2 only, as here) vLLM runs a 2048-token prefill 3x sooner in float32.
DTYPE = os.environ.get("KVCODEC_ENGINE_DTYPE", "float32")
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}


def connector_config(**extra: Any) -> dict[str, Any]:
    """The README's ``kv_transfer_config`` for kvcodec's connector, with ``extra`` as its extra config (and
    ``kv_load_failure_policy: recompute``: vLLM's default fails a request whose stored KV does not load)."""
    return {"kv_connector": "KVCodecConnector", "kv_connector_module_path": "kvcodec.engines.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def connector_store(extra: dict[str, Any], model: str | os.PathLike[str], dtype: str = DTYPE) -> Any:
    """The store of a connector with ``extra`` serving ``model`` in ``dtype``, seen from outside the engine: the same
    tiers and the same keys (its cache identity: the folder's config and weights, the KV dtype, rank 0 of 1)."""
    from kvcodec.engines.vllm_connector.setup import cache_identity, connector_store

    return connector_store(extra, str(model), cache_identity(str(model), kv_dtype=dtype))


class Engine:
    """A running engine process (``python``, which must have vLLM and kvcodec): :meth:`generate` sends a prompt and
    waits for its reply."""

    def __init__(self, model: str | os.PathLike[str], kv_transfer_config: dict[str, Any] | None = None, *,
                 max_model_len: int = 4096, dtype: str = DTYPE, python: str = sys.executable,
                 start_timeout_s: float = 600, env: dict[str, str] | None = None,
                 enable_prompt_embeds: bool = False) -> None:
        cfg = {"model": os.fspath(model), "kv_transfer_config": kv_transfer_config, "max_model_len": max_model_len,
               "dtype": dtype, "enable_prompt_embeds": enable_prompt_embeds}
        # -m, not this file's path: run as a script, its folder would come first on the child's sys.path, and this
        # package's mooncake.py would shadow Mooncake's own package.
        self.proc = subprocess.Popen([python, "-m", MODULE, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **ENGINE_ENV, **(env or {})})
        self.log: deque[str] = deque(maxlen=400)  # the engine's own output, for failure messages
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._reply(start_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                with self._cond:
                    self._replies.append(json.loads(line[len(PREFIX):]))
                    self._cond.notify_all()
            else:
                self.log.append(line.rstrip("\n"))
        with self._cond:
            self._cond.notify_all()

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._replies:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the vLLM engine exited ({self.proc.returncode}):\n" + self.tail())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the vLLM engine did not answer within {timeout_s} s:\n" + self.tail())
                self._cond.wait(min(left, 1.0))
            return self._replies.pop(0)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(list(self.log)[-lines:])

    def grep(self, text: str) -> list[str]:
        """The engine's log lines containing ``text``."""
        return [line for line in self.log if text in line]

    def generate(self, prompt_token_ids: list[int], max_tokens: int = 16, *, prompt_embeds: Any = None,
                 prompt_is_token_ids: list[bool] | None = None, kv_transfer_params: dict[str, Any] | None = None,
                 prompt_logprobs: int | None = None, cache_salt: str | None = None,
                 timeout_s: float = 600) -> dict[str, Any]:
        """Greedy tokens for ``prompt_token_ids``; with ``prompt_embeds`` (a ``(len, hidden)`` tensor) and
        ``prompt_is_token_ids``, the ids marked False are placeholders whose inputs are those rows.
        ``kv_transfer_params`` reach the connector; with ``prompt_logprobs`` (k), the reply's ``prompt_logprobs``
        holds, for each prompt position vLLM computed, its top k and actual tokens' log-probabilities
        (``{token id: logprob}``; None where vLLM gave none), with loads from the connector still allowed.
        ``cache_salt`` is vLLM's per-request salt."""
        req: dict[str, Any] = {"prompt_token_ids": prompt_token_ids, "max_tokens": max_tokens,
                               "kv_transfer_params": kv_transfer_params, "prompt_logprobs": prompt_logprobs,
                               "cache_salt": cache_salt}
        if prompt_embeds is not None:
            import torch

            buf = io.BytesIO()
            torch.save(prompt_embeds.detach().cpu().contiguous(), buf)
            req["prompt_embeds"] = base64.b64encode(buf.getvalue()).decode()
            req["prompt_is_token_ids"] = prompt_is_token_ids
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout_s)
        if "error" in reply:
            raise RuntimeError(f"the engine failed a request: {reply['error']}\n" + self.tail())
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- the engine process ------------------------------------------------------------------------------

def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _prompt(req: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prompt for ``req``: its token ids, and its embeddings with the mask of real ids when it has them."""
    salt = {"cache_salt": req["cache_salt"]} if req.get("cache_salt") else {}
    if "prompt_embeds" not in req:
        return {"prompt_token_ids": req["prompt_token_ids"], **salt}
    import torch

    embeds = torch.load(io.BytesIO(base64.b64decode(req["prompt_embeds"])), weights_only=True)
    return {"prompt_embeds": embeds, "prompt_token_ids": req["prompt_token_ids"],
            "prompt_is_token_ids": req["prompt_is_token_ids"], **salt}


def _serve(cfg: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams

    # vLLM's own prefix cache is off, so every hit a test sees comes through the connector.
    llm = LLM(model=cfg["model"], max_model_len=cfg["max_model_len"], enforce_eager=True, dtype=cfg["dtype"],
              enable_prefix_caching=False, kv_transfer_config=cfg["kv_transfer_config"], seed=0,
              enable_prompt_embeds=cfg["enable_prompt_embeds"])
    _reply({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            extra = {}
            if req.get("prompt_logprobs") is not None:
                # vLLM would skip every cache read for them; its detokenizer fails on the placeholder ids of the
                # positions a connector loaded (OverflowError), and the ids are all a test reads
                extra = {"prompt_logprobs": int(req["prompt_logprobs"]), "skip_reading_prefix_cache": False,
                         "detokenize": False}
            params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), logprobs=0,
                                    extra_args={"kv_transfer_params": req.get("kv_transfer_params")}, **extra)
            start = time.perf_counter()
            out = llm.generate([_prompt(req)], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            gen = out.outputs[0]
            logprobs = [float(step[t].logprob) for step, t in zip(gen.logprobs or [], gen.token_ids)]
            prompt = [None if p is None else {int(t): float(x.logprob) for t, x in p.items()}
                      for p in (out.prompt_logprobs or [])]
            _reply({"token_ids": list(gen.token_ids), "logprobs": logprobs, "seconds": seconds,
                    "num_cached_tokens": out.num_cached_tokens, "prompt_logprobs": prompt})
        except Exception as e:  # the test sees it in the reply, with the engine's log
            _reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
