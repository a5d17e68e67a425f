"""The connector's scheduler side: which prompt tokens the store can supply, and what each step loads and saves.

``lookup`` looks the whole prompt up (chained chunk keys, salted per request by :mod:`.requests`), rounds the hit
down to whole vLLM blocks, keeps at least one prompt token for vLLM to compute and subtracts what vLLM already has;
``after_alloc`` records the load; ``build_meta`` turns loads and, once a prompt's prefill completes, saves into the
step's :class:`~.metadata.KVCodecConnectorMetadata` with the request's block table.
"""

from __future__ import annotations

from typing import Any

from kvcodec.engines.vllm_connector.metadata import KVCodecConnectorMetadata, LoadSpec, SaveSpec
from kvcodec.engines.vllm_connector.requests import request_key_salt
from kvcodec.engines.vllm_connector.setup import engine_logger
from kvcodec.errors import UnsupportedError
from kvcodec.store import KVStore

log = engine_logger(__name__)


def first_block_ids(block_ids: Any) -> list[int]:
    """vLLM passes block ids per KV-cache group, ``([ids...],)``; the first group's."""
    if block_ids is None:
        return []
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in block_ids]


class SchedulerSide:
    """The scheduler process's state over ``store``; ``block_size`` is vLLM's (hits are whole blocks)."""

    def __init__(self, store: KVStore, block_size: int) -> None:
        self.store, self.block_size = store, block_size
        self.stats = {"lookups": 0, "lookup_hit_tokens": 0}
        self._matched: dict[str, tuple[int, int]] = {}  # req id -> (num_computed_tokens, external tokens)
        self._need_load: dict[str, tuple[int, int]] = {}  # req id -> (start, end)
        self._unsaved: dict[str, dict[str, Any]] = {}  # req id -> prompt ids, block ids, tokens done, salt
        self._keyed: dict[str, str | None] = {}  # req id -> its salt, for requests the store can key
        self._unkeyable_said: set[str] = set()

    def _salt(self, request: Any) -> tuple[bool, str | None]:
        """Whether the store can key ``request``, and its salt (computed once per request)."""
        rid = request.request_id
        if rid in self._keyed:
            return True, self._keyed[rid]
        try:
            salt = request_key_salt(request)
        except UnsupportedError as e:
            if str(e) not in self._unkeyable_said:
                self._unkeyable_said.add(str(e))
                log.warning("kvcodec connector: requests with %s are neither loaded from nor saved to the store (its "
                            "keys cannot cover it); said once", e)
            return False, None
        self._keyed[rid] = salt
        return True, salt

    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` the store can supply (whole blocks), and False (sync load)."""
        keyable, salt = self._salt(request)
        ids = list(getattr(request, "prompt_token_ids", None) or [])
        if not keyable or len(ids) < 2:
            return 0, False
        try:
            # the whole prompt's chunks (a stored last chunk counts), less one token that vLLM must compute
            hit = min(self.store.lookup(ids, salt=salt).num_tokens, len(ids) - 1)
        except Exception:
            log.warning("store lookup failed; treating it as a miss", exc_info=True)
            hit = 0
        hit = hit // self.block_size * self.block_size
        self.stats["lookups"] += 1
        self.stats["lookup_hit_tokens"] += hit
        ext = max(0, hit - int(num_computed_tokens))
        self._matched[request.request_id] = (int(num_computed_tokens), ext)
        return ext, False

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        computed, _ = self._matched.pop(rid, (0, 0))
        if num_external_tokens > 0:
            self._need_load[rid] = (computed, computed + int(num_external_tokens))

    def build_meta(self, scheduler_output: Any) -> KVCodecConnectorMetadata:
        """This step's loads (new requests with a hit) and saves (prompts whose prefill completes in it)."""
        meta = KVCodecConnectorMetadata()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        meta.step_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or sum(scheduled.values()))
        for req in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            self._new_request(req, scheduled, meta)
        self._cached_requests(getattr(scheduler_output, "scheduled_cached_reqs", None), scheduled)
        for rid in list(self._unsaved):
            st = self._unsaved[rid]
            if st["done"] >= len(st["ids"]):  # the prompt's prefill completes in this step
                ids = st["ids"]
                if not self.store.save_partial:
                    ids = ids[: len(ids) // self.store.chunk_tokens * self.store.chunk_tokens]
                if ids:
                    meta.saves.append(SaveSpec(rid, ids, st["blocks"], st["salt"]))
                del self._unsaved[rid]
        return meta

    def _new_request(self, req: Any, scheduled: dict[str, int], meta: KVCodecConnectorMetadata) -> None:
        rid = req.req_id
        if rid not in self._keyed:  # not looked up here, or not keyable: neither loaded nor saved
            return
        salt = self._keyed[rid]
        ids = [int(t) for t in (req.prompt_token_ids or [])]
        blocks = first_block_ids(req.block_ids)
        if rid in self._need_load:
            start, end = self._need_load.pop(rid)
            # the chunks that hold tokens start..end-1, as they were stored (a chunk's key covers its tokens)
            chunk_end = min(len(ids), -(-end // self.store.chunk_tokens) * self.store.chunk_tokens)
            meta.loads.append(LoadSpec(rid, ids[:chunk_end], blocks, start, end, salt))
        done = int(getattr(req, "num_computed_tokens", 0)) + int(scheduled.get(rid, len(ids)))
        self._unsaved[rid] = {"ids": ids, "blocks": blocks, "done": done, "salt": salt}

    def _cached_requests(self, cached: Any, scheduled: dict[str, int]) -> None:
        """Follow running requests' new blocks and progress (a request resumed from preemption has new blocks)."""
        if cached is None:
            return
        new_blocks = getattr(cached, "new_block_ids", None) or []
        computed = getattr(cached, "num_computed_tokens", None) or []
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        flags = getattr(cached, "resumed_from_preemption", None) or []  # older vLLM: one bool per request
        resumed |= {rid for rid, f in zip(getattr(cached, "req_ids", None) or [], flags) if f}
        for i, rid in enumerate(getattr(cached, "req_ids", None) or []):
            st = self._unsaved.get(rid)
            if st is None:
                continue
            nb = first_block_ids(new_blocks[i]) if i < len(new_blocks) else []
            st["blocks"] = nb if rid in resumed else st["blocks"] + nb
            if i < len(computed):
                st["done"] = int(computed[i]) + int(scheduled.get(rid, 0))

    def finished(self, request: Any) -> None:
        """Forget ``request`` (saves finish within the forward pass, so its blocks can be freed now)."""
        rid = request.request_id
        for state in (self._unsaved, self._need_load, self._matched, self._keyed):
            state.pop(rid, None)
