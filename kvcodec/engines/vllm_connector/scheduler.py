"""The connector's scheduler side: which prompt tokens the store can supply, and what each step loads and saves.

``lookup`` looks the whole prompt up (chained chunk keys, salted per request by :mod:`.requests`), rounds the hit
down to whole vLLM blocks, keeps at least one prompt token for vLLM to compute and subtracts what vLLM already has;
``after_alloc`` records the load; ``build_meta`` turns loads and, once a prompt's prefill completes, saves into the
step's :class:`~.metadata.KVCodecConnectorMetadata` with the request's block table.

Saves run behind the forward pass (:mod:`.saves`), so a prompt may be looked up while the save that would supply
it is still under way: such a request waits (``lookup`` answers None, vLLM asks again at its next step) until the
store holds what that save writes, or until every worker reports the save run (:class:`~.metadata.WorkerReport`;
a failed save then leaves it to compute).  Within one engine a prompt thus finds what an earlier one saved, as when
saves ran in the step.

A prefix hit is claimed only where loading it is sooner than vLLM computing it, by the estimates the workers report
(their links, decode rates and vLLM's prefill speed): the worker's load stops where recomputing is sooner anyway,
but blocks claimed and then given back cost vLLM a pass of their own (a raw hit over 100 Mbit/s, stopped after 0-2
chunks, took 1.2x a plain prefill).  Only a link estimate a worker's read measured in the last
:data:`LINK_RECHECK_S` seconds can refuse a hit: a hit refused is never read, so a link that rose would otherwise
never be measured again.

A request that names its segments (:func:`~.requests.segment_request`) and has any of them stored claims the anchor
and the segments instead (to the token), where that is more than its prefix hit: vLLM's scheduler takes a
connector's hit as a count of leading tokens, so the worker fills those blocks with the fused context
(:mod:`.fusion`) and vLLM computes the question over them. Its KV is not a prefill's, so it is never saved under the
prompt's keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from kvcodec.blend.segments import SegmentStore
from kvcodec.engines.vllm_connector.metadata import KVCodecConnectorMetadata, LoadSpec, SaveSpec, WorkerReport
from kvcodec.engines.vllm_connector.requests import SegmentRequest, request_key_salt, segment_request, segment_spans
from kvcodec.engines.vllm_connector.setup import engine_logger
from kvcodec.errors import InvalidInputError, UnsupportedError
from kvcodec.store import KVStore, Lookup

log = engine_logger(__name__)

#: How old (seconds) the workers' latest link measurement may be for the scheduler to refuse a hit on it.  A refused
#: hit reads nothing, so past this a hit is claimed again and the worker's load measures the link (and stops where
#: recomputing is sooner): on a link that stays slow, one request in this long pays the blocks given back (about
#: 1.2 s on a 6 s prefill over 100 Mbit/s here); a link that rose is seen within this long.
LINK_RECHECK_S = 15.0


def first_block_ids(block_ids: Any) -> list[int]:
    """vLLM passes block ids per KV-cache group, ``([ids...],)``; the first group's."""
    if block_ids is None:
        return []
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in block_ids]


class SchedulerSide:
    """The scheduler process's state over ``store``; ``block_size`` is vLLM's (hits are whole blocks);
    segments are computed after ``anchor`` (the model's BOS).  ``prefix_caching``: vLLM's own prefix cache is on,
    which would keep a fused prompt's blocks and hand them to later prompts as computed KV, so nothing is fused."""

    def __init__(self, store: KVStore, block_size: int, anchor: Sequence[int] = (), *,
                 prefix_caching: bool = False, workers: int = 1) -> None:
        self.store, self.block_size, self.prefix_caching, self.workers = store, block_size, prefix_caching, workers
        self.segments = SegmentStore(store, anchor) if store.save_partial else None
        self.stats = {"lookups": 0, "lookup_hit_tokens": 0, "fusions": 0}
        self._asks: dict[str, SegmentRequest | None] = {}  # req id -> what it asks of segments
        self._fusing: set[str] = set()  # requests whose hit is their segments fused
        self._matched: dict[str, tuple[int, int]] = {}  # req id -> (num_computed_tokens, external tokens)
        self._need_load: dict[str, tuple[int, int]] = {}  # req id -> (start, end)
        self._unsaved: dict[str, dict[str, Any]] = {}  # req id -> prompt ids, block ids, tokens done, salt
        self._held: dict[str, int] = {}  # req id -> its prompt's tokens stored in every variant at its lookup
        self._keyed: dict[str, str | None] = {}  # req id -> its salt, for requests the store can key
        self._unkeyable_said: set[str] = set()
        self._saving: dict[str, SaveSpec] = {}  # req id -> its save, queued on the workers and not reported run
        self._reported: dict[str, int] = {}  # req id -> workers that reported its save run so far
        self._left: set[str] = set()  # requests whose hit was left to vLLM (said once)
        self._link_measured_at = -math.inf  # wall-clock time of the latest link read the workers reported

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

    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` the store can supply (whole blocks), and False (sync load);
        None while a save under way would supply more of them."""
        keyable, salt = self._salt(request)
        ids = list(getattr(request, "prompt_token_ids", None) or [])
        if not keyable or len(ids) < 2:
            return 0, False
        try:
            stored = self.store.lookup(ids, salt=salt)  # the whole prompt's chunks (a last one counts)
        except Exception:
            log.warning("store lookup failed; treating it as a miss", exc_info=True)
            stored = Lookup(0, [])
        found = stored.num_tokens
        self._held[request.request_id] = stored.in_every_variant
        ask = self._ask(request, salt, ids)
        if self._saving and self._awaits_save(ids, salt, found, ask):
            return None, False
        hit = min(found, len(ids) - 1) // self.block_size * self.block_size  # vLLM computes one token at least
        if hit and not self._worth_loading(request.request_id, ids, hit, salt):
            hit = 0
        self._fusing.discard(request.request_id)
        if ask is not None and ask.segments and not num_computed_tokens:
            fused = self._fusion_hit(request, ids, ask)
            if fused > hit:
                hit = fused
                self._fusing.add(request.request_id)
        self.stats["lookups"] += 1
        self.stats["lookup_hit_tokens"] += hit
        ext = max(0, hit - int(num_computed_tokens))
        self._matched[request.request_id] = (int(num_computed_tokens), ext)
        return ext, False

    def _worth_loading(self, rid: str, ids: list[int], hit: int, salt: str | None) -> bool:
        """Whether loading the chunks that hold the first ``hit`` tokens ends sooner than vLLM computing those
        tokens, by the workers' estimates (True until a worker has timed vLLM's prefill)."""
        prefill = self.store.telemetry.prefill
        if not prefill.samples or time.time() - self._link_measured_at > LINK_RECHECK_S:
            return True
        try:
            load_s = self.store.load_estimates([ids[:self._chunks_end(ids, hit)]], salt=salt)[0]
        except Exception:
            log.warning("estimating a load failed; the hit is claimed", exc_info=True)
            return True
        compute_s = hit / prefill.estimate
        if load_s is None or load_s <= compute_s:
            return True
        if rid not in self._left:
            self._left.add(rid)
            log.info("kvcodec connector: request %s: loading tokens 0-%d would take %.2f s by the workers' estimates, "
                     "computing them %.2f s: left to vLLM", rid, hit, load_s, compute_s)
        return False

    def _awaits_save(self, ids: list[int], salt: str | None, found: int, ask: SegmentRequest | None) -> bool:
        """Whether a save under way would give this prompt (``found`` tokens of it stored now) more than it has:
        more of its prefix chunks, or one of the segments it names."""
        segments = ([ids[a:b] for a, b in segment_spans(len(self.segments.anchor), ask.segments)]
                    if ask is not None and ask.segments and self.segments is not None else [])
        for spec in self._saving.values():
            if spec.segment:
                saved = spec.token_ids[len(self.segments.anchor):] if self.segments is not None else []
                if saved in segments and self._segment_short(saved):
                    return True
            elif spec.salt == salt and self._chunks_in_common(ids, spec.token_ids) > found:
                return True
        return False

    def _segment_short(self, tokens: list[int]) -> bool:
        try:
            return self.segments.stored_tokens(tokens) < len(tokens)  # type: ignore[union-attr]
        except Exception:
            return False  # the lookup's own failure is a miss, as in lookup

    def _chunks_end(self, ids: list[int], end: int) -> int:
        """The end of the chunks that hold tokens ``0 .. end-1`` of ``ids``, as they were stored (a chunk's key
        covers its tokens, so a load reads whole chunks)."""
        return min(len(ids), -(-end // self.store.chunk_tokens) * self.store.chunk_tokens)

    def _chunks_in_common(self, ids: list[int], saved: list[int]) -> int:
        """The tokens of ``ids`` that the chunks of a save of ``saved`` cover: whole chunks in common, and the
        last, partial one where ``ids`` is ``saved`` (a chunk's key covers its tokens, and no others)."""
        if ids == saved:
            return len(ids)
        common = 0
        for a, b in zip(ids, saved):
            if a != b:
                break
            common += 1
        return common // self.store.chunk_tokens * self.store.chunk_tokens

    def _ask(self, request: Any, salt: str | None, ids: list[int]) -> SegmentRequest | None:
        """What ``request`` asks of segments, where it can be done (warned once per request where not)."""
        rid = request.request_id
        if rid in self._asks:
            return self._asks[rid]
        try:
            ask = segment_request(request)
        except InvalidInputError as e:
            log.warning("kvcodec connector: request %s: %s; its segment parameters are ignored", rid, e)
            ask = None
        problem = None
        if ask is not None:
            anchor = list(self.segments.anchor if self.segments is not None else ())
            if self.segments is None:
                problem = "the store does not save partial chunks (save_partial), which segments need"
            elif ask.segments and self.prefix_caching:
                problem = ("vLLM's prefix caching is on, and it would serve the fused blocks to later prompts as "
                           "computed KV (start vLLM with --no-enable-prefix-caching to fuse)")
            elif salt is not None:  # segments are keyed by their own tokens and the model only
                problem = "it is salted (cache_salt, prompt embeddings, LoRA or multimodal inputs)"
            elif ids[:len(anchor)] != anchor:
                problem = f"its prompt does not start with the model's anchor {anchor}"
            elif len(anchor) + sum(ask.segments) >= len(ids):
                problem = "its segments leave no token of the prompt (the question) for vLLM to compute"
            elif ask.store_segment and len(ids) == len(anchor):
                problem = "its prompt holds no token after the anchor"
        if problem is not None:
            log.warning("kvcodec connector: request %s asks for segments, but %s: served without them", rid, problem)
            ask = None
        self._asks[rid] = ask
        return ask

    def _fusion_hit(self, request: Any, ids: list[int], ask: SegmentRequest) -> int:
        """The tokens a fusion of ``ask``'s segments supplies (the anchor and the segments), or 0 where none of them
        is stored.  To the token: vLLM 0.32 takes such a hit, and its greedy tokens and log-probabilities then equal
        its full prefill's (share 1, tests/engines/test_vllm_segments.py), where whole blocks would leave it up to
        127 stored tokens to compute (0.4 s of a 3,850-token prompt's 7.7 s at 30%).  But after a hit that ends
        inside a block vLLM returns uninitialized memory as the prompt's log-probabilities, so a request that asks
        for them gets whole blocks."""
        spans = segment_spans(len(self.segments.anchor), ask.segments)
        try:
            stored = any(self.segments.stored_tokens(ids[a:b]) > 0 for a, b in spans)
        except Exception:
            log.warning("segment lookup failed; treating it as a miss", exc_info=True)
            return 0
        if not stored:
            return 0
        end = spans[-1][1]
        prompt_logprobs = getattr(getattr(request, "sampling_params", None), "prompt_logprobs", None)
        return end if prompt_logprobs is None else end // self.block_size * self.block_size

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        computed, _ = self._matched.pop(rid, (0, 0))
        if num_external_tokens > 0:
            self._need_load[rid] = (computed, computed + int(num_external_tokens))
        else:
            self._fusing.discard(rid)

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
                ids = st["ids"][:self.store.put_end(len(st["ids"]))]
                if ids:
                    spec = SaveSpec(rid, ids, st["blocks"], st["salt"], st["segment"])
                    meta.saves.append(spec)
                    self._saving[rid] = spec
                del self._unsaved[rid]
        return meta

    def _new_request(self, req: Any, scheduled: dict[str, int], meta: KVCodecConnectorMetadata) -> None:
        rid = req.req_id
        if rid not in self._keyed:  # not looked up here, or not keyable: neither loaded nor saved
            return
        salt = self._keyed[rid]
        ids = [int(t) for t in (req.prompt_token_ids or [])]
        blocks = first_block_ids(req.block_ids)
        ask = self._asks.get(rid)
        if rid in self._need_load:
            start, end = self._need_load.pop(rid)
            if rid in self._fusing:
                self.stats["fusions"] += 1
                fused_end = segment_spans(len(self.segments.anchor), ask.segments)[-1][1]
                meta.loads.append(LoadSpec(rid, ids[:fused_end], blocks, start, end, None, ask.segments, ask.share))
                return  # a fused context is not a prefill's KV: never saved under the prompt's keys
            meta.loads.append(LoadSpec(rid, ids[:self._chunks_end(ids, end)], blocks, start, end, salt))
        segment = bool(ask is not None and ask.store_segment)
        if not segment and self._held.pop(rid, 0) >= self.store.put_end(len(ids)):
            # every chunk the save would write is stored: it would copy the prompt's KV out of vLLM's memory during
            # the forward pass (94 MB for a 2,048-token hit here) and then write nothing
            return
        done = int(getattr(req, "num_computed_tokens", 0)) + int(scheduled.get(rid, len(ids)))
        self._unsaved[rid] = {"ids": ids, "blocks": blocks, "done": done, "salt": salt, "segment": segment}

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
        """Forget ``request`` (but its save, if under way, until the workers report it)."""
        rid = request.request_id
        for state in (self._unsaved, self._need_load, self._matched, self._keyed, self._asks, self._held):
            state.pop(rid, None)
        self._fusing.discard(rid)
        self._left.discard(rid)

    def worker_report(self, report: WorkerReport) -> None:
        """A step's report from the workers: their store's estimates (weighed by later lookups), and the saves they
        ran; a save counts as run once every worker has reported it."""
        if report.estimates is not None:
            # (estimates equal to this store's own teach it nothing, and seeding them again would count them twice)
            if report.estimates != self.store.telemetry.estimates():
                self.store.telemetry.restore(report.estimates)
            self._link_measured_at = max([self._link_measured_at, *(m.at for m in report.estimates.links.values())])
        for rid, n in report.saves_run.items():
            seen = self._reported.get(rid, 0) + n
            if seen >= self.workers:
                self._saving.pop(rid, None)
                self._reported.pop(rid, None)
            else:
                self._reported[rid] = seen
