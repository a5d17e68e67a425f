"""A real LMCache multiprocess server (``lmcache server``, LMCache 0.5.6) for the tests and the bench: started on
free loopback ports with the L2 adapters given, driven by LMCache's own ``lmcache bench server`` command and by
its own bench client (:class:`KVClient`, which puts real KV into the client's paged blocks and reads back what
the server retrieves into them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

import kvcodec
from kvcodec.tools.redis_server import free_port

SOURCE = Path(kvcodec.__file__).resolve().parent.parent  # the folder this kvcodec is imported from
LMCACHE = str(Path(sys.executable).parent / "lmcache")
BLOCK = 16  # tokens per paged block; LMCache's chunk is 256 tokens (16 blocks)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The server and bench processes import this kvcodec (the plugin adapter module) first."""
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE), env.get("PYTHONPATH", "")) if p)
    return env


class LMCacheServer:
    """``lmcache server`` with one L2 adapter (``--l2-adapter`` JSON), its output in ``folder/server.log``."""

    def __init__(self, folder: Path, adapter: dict[str, Any], *, l1_gb: float = 1, env: dict[str, str] | None = None,
                 ready_s: float = 120) -> None:
        self.folder, self.adapter, self.l1_gb, self.env, self.ready_s = folder, adapter, l1_gb, env, ready_s
        self.port, self.http_port = free_port(), free_port()
        self.log = folder / f"server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> LMCacheServer:
        cmd = [LMCACHE, "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
               "--http-port", str(self.http_port), "--l1-size-gb", str(self.l1_gb), "--eviction-policy", "LRU",
               "--l2-adapter", json.dumps(self.adapter)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(self.env),
                                         start_new_session=True)
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.http_url}/healthcheck", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"lmcache server not ready within {self.ready_s} s: {self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def clear_l1(self) -> None:
        """Drop every object from the server's L1 (memory), so what is read next comes from the L2 adapter."""
        req = urllib.request.Request(f"{self.http_url}/cache/clear", data=b'{"tier": "l1", "force": true}',
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["status"] == "ok"

    def bench(self, shape_spec: str, *, start: int = 0, end: int = 2, tokens: int = 512,
              timeout_s: float = 300) -> dict[str, Any]:
        """LMCache's own ``lmcache bench server`` traffic (cold store, warm retrieve, checksums) against this
        server; its JSON report."""
        out = self.folder / f"bench-{self.port}-{start}.json"
        cmd = [LMCACHE, "bench", "server", "--mode", "cpu", "--transfer-mode", "lmcache_driven",
               "--rpc-url", self.rpc_url, "--url", self.http_url, "--kvcache-shape-spec", shape_spec,
               "--num-tokens", str(tokens), "--start", str(start), "--end", str(end), "--interval", "0.5",
               "--format", "json", "--output", str(out), "-q"]
        done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout_s)
        if not out.exists():
            raise RuntimeError(f"lmcache bench server wrote no report (exit {done.returncode}): "
                               f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return json.loads(out.read_text())["metrics"]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class KVClient:
    """LMCache's own bench client (``ServerBenchClient``: one worker, KV tensors shared with the server over POSIX
    SHM) with ``layers`` paged tensors ``[2, blocks, 16, heads, head_dim]``.  Request ``seq`` is LMCache's bench
    sequence ``seq``: token ids ``(seq, hello * tokens)``, whose whole 256-token chunks are stored."""

    def __init__(self, server: LMCacheServer, *, layers: int, heads: int, head_dim: int, tokens: int = 512,
                 blocks: int = 256, dtype: str = "float16") -> None:
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        self.tokens = tokens
        config = BenchConfig(rpc_url=server.rpc_url, http_url=server.http_url, mode="cpu",
                             transfer_mode="lmcache_driven", tp_size=1, use_mla=False, num_tokens=tokens,
                             kvcache_shape_spec=f"(2,{blocks},{BLOCK},{heads},{head_dim}):{dtype}:{layers}",
                             num_blocks=blocks, block_size=BLOCK)
        self.messages: list[str] = []
        self.client = ServerBenchClient(config, self.messages.append)
        self.client.start()
        self.layers = [self.client._workers[0].kv_caches[f"layer.{i}"] for i in range(layers)]

    def _blocks(self, request: Any) -> slice:
        return slice(request.block_offset, request.block_offset + request.num_blocks)

    def _request(self, seq: int, kind: str) -> Any:
        request = self.client.create_request(seq, request_id=f"kvclient-{seq}-{kind}-{time.monotonic_ns()}",
                                             request_kind=kind)
        assert request is not None
        return request

    def store(self, seq: int, kv: torch.Tensor) -> float:
        """Write ``kv`` (LMCache's ``[2, L, T, H*D]``, T = the request's whole chunks) into the request's blocks
        and STORE it; the seconds the store took."""
        request = self._request(seq, "store")
        n = request.num_full_tokens
        assert kv.shape[2] == n, f"request {seq} stores {n} tokens, not {kv.shape[2]}"
        for i, t in enumerate(self.layers):
            t[:, self._blocks(request)] = kv[:, i].reshape(2, n // BLOCK, BLOCK, *t.shape[3:]).to(t.dtype)
        started = time.perf_counter()
        result = self.client.store(request, start_token=0, token_count=n)
        took = time.perf_counter() - started
        self.client.end_session(request)
        assert result.succeeded, f"STORE of request {seq} failed: {self.messages[-5:]}"
        return took

    def lookup(self, seq: int, timeout_s: float = 60) -> int:
        """Tokens of request ``seq`` the server holds (it prefetches them from L2 into L1 first)."""
        request = self._request(seq, "lookup")
        deadline = time.monotonic() + timeout_s
        hit = self.client.lookup(request).hit_chunks
        while hit < request.total_chunks and time.monotonic() < deadline:  # a slow prefetch polls out at 2.5 s
            time.sleep(0.2)
            hit = self.client.lookup(request).hit_chunks
        self.client.end_session(request)
        return hit * request.chunk_size

    def retrieve(self, seq: int) -> tuple[torch.Tensor, float]:
        """Zero the request's blocks, look it up and RETRIEVE it: ``[2, L, T, H*D]`` as the server wrote it into
        the blocks, and the seconds lookup and retrieve took."""
        request = self._request(seq, "retrieve")
        n = request.num_full_tokens
        for t in self.layers:
            t[:, self._blocks(request)] = 0
        started = time.perf_counter()
        lookup = self.client.lookup(request)
        assert lookup.hit_chunks == request.total_chunks, f"request {seq}: {lookup.hit_chunks} chunks hit"
        result = self.client.retrieve(request, start_token=0, token_count=n)
        took = time.perf_counter() - started
        self.client.end_session(request)
        assert result.succeeded, f"RETRIEVE of request {seq} failed: {self.messages[-5:]}"
        return torch.stack([t[:, self._blocks(request)].reshape(2, n, -1) for t in self.layers], 1).clone(), took

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
