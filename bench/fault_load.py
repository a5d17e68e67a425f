"""Fault-and-load run of the KV store: many processes, one Redis, one disk folder, faults, and every answer checked.

Worker processes (``--workers``, at least 8) share one :class:`kvcodec.store.KVStore` configuration over two
tiers: a :class:`DiskTier` folder and a :class:`RedisTier` on a ``redis-server`` this script starts on a
loopback port.  Each worker loops for ``--seconds``: it picks a prompt (a prefix of one of a few real
SmolLM2-135M token sequences, so prompts share chunks), loads it (``KVStore.get``, or ``fetch`` and decode),
checks every chunk it got, saves the prompt's real KV (``put``; only missing chunks are encoded) and now and
then evicts a prefix, so that chunks keep being rewritten.

The check: a stored chunk must decode to exactly (bit for bit) what encoding that chunk's reference KV with
the store's codec and decoding it gives; the parent computes those references once before the run.  A load
may stop early (a miss, or a damaged chunk reported and evicted) but must never return a wrong chunk.

Faults injected while the load runs, ``--rounds`` times:

- ``writer-kill``: a worker that is inside ``put`` is killed with SIGKILL (and replaced);
- ``redis-restart``: redis-server is killed and started again on the same port, empty;
- ``disk-full``: the disk folder is a small tmpfs (root only) that a ballast file fills for a while;
- ``corrupt``: bytes of a stored value are flipped, once in Redis and once on disk;
- ``foreign-*``: a valid container for the same tokens under another configuration (another codec, another
  codec setting, another model string) is stored under this configuration's key, in Redis and on disk.

Faults are injected only through public methods (``KVStore.keys_for``, the tiers' ``get``/``put``/``delete``),
never through the stores' internals.  Afterwards: the disk folder is reopened with ``stale_tmp_s=0`` and must hold
no temporary files, no worker may be left (no zombies), Redis must have no client connections left, every
prompt is loaded and checked once more, and a write and read-back must still work.  The report
(``--out``, default ``bench/results/fault_load.{md,json}``) gives operations per second, per-fault counts
(misses, reported load errors, wrong chunks served) and the wrong chunks in detail.

    python bench/fault_load.py [--workers 8] [--seconds 120] [--rounds 3] [--codec cachegen]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcodec.tools.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "fault_load"
DEFAULT_TEXTS = ("license:GPL-3", "pydoc-topics")
MODEL = "SmolLM2-135M-Instruct"
# The state board: per worker a u32 op counter and a u32 state, so the parent can see who is inside put().
SLOT = struct.Struct("<II")
MAX_SLOTS = 512
IDLE, LOADING, SAVING = 0, 1, 2
FOREIGN = ("foreign-codec", "foreign-setting", "foreign-model")


@dataclass
class Config:
    workers: int = 8
    seconds: float = 120.0
    rounds: int = 3
    tokens: int = 320
    chunk_tokens: int = 64
    codec: str = "cachegen"
    faults: tuple[str, ...] = ("writer-kill", "redis-restart", "disk-full", "corrupt", *FOREIGN)
    seed: int = 0
    tmpfs_mb: int = 32
    evict_p: float = 0.05
    redis_timeout_s: float = 2.0
    redis_down_for_s: float = 1.0
    redis_outage_s: float = 1.0
    settle_s: float = 3.0
    start_timeout_s: float = 180.0


ALL_FAULTS = Config().faults


# --- processes, Redis, tmpfs ------------------------------------------------------------------------

def mount_tmpfs(folder: Path, size_mb: int) -> str | None:
    """Mount a tmpfs of ``size_mb`` on ``folder``; None when done, else why not."""
    if os.geteuid() != 0:
        return "not root: the disk-full fault needs a tmpfs mount (mount -t tmpfs), skipped"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"mount -t tmpfs failed ({done.stderr.strip() or done.returncode}): disk-full fault skipped"
    return None


def unmount(folder: Path) -> None:
    if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
        # Still busy (a process we could not reap?): detach it so nothing stays mounted after the run.
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def descendants(root: int) -> list[tuple[int, str, str]]:
    """``(pid, state, command)`` of every live or zombie process below ``root``."""
    parent: dict[int, int] = {}
    info: dict[int, tuple[str, str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        parent[int(entry.name)] = int(rest[1])
        info[int(entry.name)] = (rest[0], cmd[:120])
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for child, pp in parent.items():
            if pp == p:
                out.append((child, *info[child]))
                todo.append(child)
    return out


# --- data ----------------------------------------------------------------------------------------------

def dump_kv(text: str, tokens: int, folder: Path) -> Path:
    """A float16 SmolLM2 KV dump of ``text``'s first ``tokens`` tokens, made with ``kvcodec dump`` once."""
    from kvcodec.cli import main as kvcodec_main

    path = folder / f"{text.replace(':', '-').replace('/', '_')}-{tokens}-float16.safetensors"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.safetensors")
        code = kvcodec_main(["dump", "--model", "smollm2", "--text", text, "--tokens", str(tokens),
                             "--dtype", "float16", "-o", str(tmp), "--quiet"])
        if code != 0:
            raise RuntimeError(f"kvcodec dump of {text} failed with exit code {code}")
        tmp.rename(path)
    return path


def slice_kv(seq: dict[str, Any], n: int, model: str | None = MODEL):
    from kvcodec.cache import KVCache

    return KVCache([(k[:, :n], v[:, :n]) for k, v in seq["layers"]], model=model, token_ids=seq["ids"][:n],
                   rope=seq["rope"])


def prompt_lengths(total: int, chunk: int, rng: random.Random) -> list[int]:
    """Whole-chunk prefixes (shared by every longer prompt) plus one prefix ending inside each chunk
    (a partial last chunk, shared only by the workers that pick that prompt)."""
    full = list(range(chunk, total + 1, chunk))
    partial = [s + rng.randrange(1, chunk) for s in range(0, total, chunk) if s + 1 < total]
    return sorted(set(full + [min(p, total) for p in partial]))


def make_store(cfg: dict[str, Any], disk: str, port: int, *, stale_tmp_s: float = 3600.0, model: str = MODEL,
               codec: str | None = None, codec_options: dict[str, Any] | None = None):
    from kvcodec.store import DiskTier, KVStore, RedisTier

    tiers = [DiskTier(disk, stale_tmp_s=stale_tmp_s),
             RedisTier(port=port, timeout_s=cfg["redis_timeout_s"], down_for_s=cfg["redis_down_for_s"])]
    return KVStore(tiers, model=model, codec=codec or cfg["codec"], codec_options=codec_options,
                   chunk_tokens=cfg["chunk_tokens"])


def foreign_config(kind: str, codec: str) -> dict[str, Any]:
    """Another configuration that stores the same tokens: its containers are valid but decode differently."""
    if kind == "foreign-codec":
        return {"codec": "raw" if codec != "raw" else "cachegen"}
    if kind == "foreign-setting":
        # Only cachegen has a setting that changes the decode here; another codec stands in for raw.
        return {"codec": "cachegen", "codec_options": {"level": 0 if codec == "cachegen" else 2}}
    return {"model": MODEL + "-other"}


def prepare(cfg: Config, kv_paths: list[Path], run: Path) -> dict[str, Any]:
    """Sequences, prompts, each chunk's expected decode and reference container, and the foreign containers."""
    import torch

    from kvcodec.api import decode
    from kvcodec.cache import KVCache
    from kvcodec.store import KVStore, MemoryTier

    rng = random.Random(cfg.seed)
    seqs, prompts = [], []
    for i, p in enumerate(kv_paths):
        kv = KVCache.load_safetensors(p)
        n = min(cfg.tokens, kv.num_tokens)
        seqs.append({"name": p.name, "ids": kv.token_ids[:n], "rope": kv.rope,
                     "layers": [(l.keys[:, :n].clone(), l.values[:, :n].clone()) for l in kv.layers]})
        prompts += [(i, L) for L in prompt_lengths(n, cfg.chunk_tokens, rng)]
    ref_tier = MemoryTier(None)
    ref = KVStore([ref_tier], model=MODEL, codec=cfg.codec, chunk_tokens=cfg.chunk_tokens)
    foreign_tiers = {kind: MemoryTier(None) for kind in FOREIGN if kind in cfg.faults}
    foreign_stores = {}
    for kind, tier in foreign_tiers.items():
        o = foreign_config(kind, cfg.codec)
        foreign_stores[kind] = KVStore([tier], model=o.get("model", MODEL), codec=o.get("codec", cfg.codec),
                                       codec_options=o.get("codec_options"), chunk_tokens=cfg.chunk_tokens)
    expected, blobs, alien, chunks = {}, {}, {kind: {} for kind in foreign_stores}, []
    for i, L in prompts:
        ids = seqs[i]["ids"][:L]
        ref.put(ids, slice_kv(seqs[i], L))
        hot = min(L, 2 * cfg.chunk_tokens)  # foreign values go only under the keys pick_key chooses
        for kind, store in foreign_stores.items():
            store.put(ids[:hot], slice_kv(seqs[i], hot, model=store.model))
            for (key, _, _), (fkey, _, _) in zip(ref.keys_for(ids[:hot]), store.keys_for(ids[:hot])):
                alien[kind][key] = foreign_tiers[kind].get(fkey)
        for key, s, e in ref.keys_for(ids):
            if key not in expected:
                blobs[key] = ref_tier.get(key)
                expected[key] = [(l.keys, l.values) for l in decode(blobs[key]).layers]
                chunks.append({"key": key, "seq": i, "start": s, "end": e})
    torch.save({"seqs": seqs, "prompts": prompts, "expected": expected}, run / "data.pt")
    return {"seqs": seqs, "prompts": prompts, "blobs": blobs, "alien": alien, "chunks": chunks,
            "expected": expected}


# --- the checker -----------------------------------------------------------------------------------------

def fingerprint(layers: list[tuple[Any, Any]]) -> str:
    """A digest of a decoded chunk's bits: which injected value a wrong chunk was."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for pair in layers:
        for t in pair:
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_chunk(layers: list[tuple[Any, Any]], want: list[tuple[Any, Any]]) -> str | None:
    """None when ``layers`` are bit for bit the expected decode, else what differs."""
    from kvcodec.cache import same_bits

    if len(layers) != len(want):
        return f"{len(layers)} layers, expected {len(want)}"
    for i, ((k, v), (wk, wv)) in enumerate(zip(layers, want)):
        for name, got, exp in (("keys", k, wk), ("values", v, wv)):
            if got.shape != exp.shape or got.dtype != exp.dtype:
                return f"layer {i} {name}: {tuple(got.shape)} {got.dtype}, expected {tuple(exp.shape)} {exp.dtype}"
            if not same_bits(got, exp):
                diff = (got.float() - exp.float()).abs().max().item()
                return f"layer {i} {name}: values differ (max abs difference {diff:.4g})"
    return None


def load_and_check(store, ids: list[int], expected: dict[str, Any], mode: str) -> dict[str, Any]:
    """Load ``ids`` through ``store`` and check every chunk it returned: a load event."""
    keys = store.keys_for(ids)
    corrupt0 = store.stats["corrupt"]
    ev: dict[str, Any] = {"op": "load", "mode": mode, "chunks": len(keys), "served": 0, "ok": [], "wrong": []}
    try:
        if mode == "get":
            got = store.get(ids)
            n = 0 if got is None else got.num_tokens
            ends = [e for _, _, e in keys]
            if n and n not in ends:
                ev["wrong"].append({"key": None, "why": f"{n} tokens is not a chunk boundary"})
            elif got is not None and got.token_ids != ids[:n]:
                ev["wrong"].append({"key": None, "why": "token ids differ from the prompt's"})
            for key, s, e in keys:
                if e > n:
                    break
                layers = [(l.keys[:, s:e], l.values[:, s:e]) for l in got.layers]
                why = check_chunk(layers, expected[key])
                if why:
                    ev["wrong"].append({"key": key, "why": why, "fp": fingerprint(layers)})
                else:
                    ev["ok"].append(key)
                ev["served"] += 1
        else:
            fetched = store.fetch(ids)
            for (key, s, e), chunk in zip(keys, fetched):
                if (chunk.key, chunk.start, chunk.end) != (key, s, e):
                    why = f"fetch returned chunk {chunk.key} {chunk.start}..{chunk.end} for {key} {s}..{e}"
                    layers = []
                else:
                    try:
                        dec = store.decode_chunk(chunk)
                    except Exception as exc:  # the caller sees a load error, not a wrong chunk
                        ev["error"] = f"decode after fetch: {type(exc).__name__}: {exc}"
                        break
                    layers = [(l.keys, l.values) for l in dec.layers]
                    why = check_chunk(layers, expected[key])
                if why:
                    ev["wrong"].append({"key": key, "tier": chunk.tier, "why": why, "fp": fingerprint(layers)})
                else:
                    ev["ok"].append(key)
                ev["served"] += 1
    except Exception as exc:
        ev["error"] = f"{type(exc).__name__}: {exc}"
    ev["reported"] = store.stats["corrupt"] - corrupt0
    ev["stop"] = keys[ev["served"]][0] if ev["served"] < len(keys) else None
    return ev


# --- a worker process ------------------------------------------------------------------------------------

def worker(spec_file: Path, wid: int) -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(spec_file.read_text())
    run = Path(spec["run"])
    data = torch.load(run / "data.pt", weights_only=True)
    store = make_store(spec, spec["disk"], spec["port"])
    fd = os.open(run / "state.bin", os.O_RDWR)
    board = mmap.mmap(fd, SLOT.size * MAX_SLOTS)
    rng = random.Random(spec["seed"] * 1000 + wid)
    with open(run / f"events-{wid}.jsonl", "a", buffering=1) as events:
        def emit(ev: dict[str, Any]) -> None:
            ev["t"], ev["w"] = time.monotonic(), wid
            events.write(json.dumps(ev) + "\n")

        emit({"op": "ready", "pid": os.getpid()})
        deadline = time.monotonic() + spec["start_timeout_s"]
        while not (run / "go.json").exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        end = json.loads((run / "go.json").read_text())["end"]
        n = 0
        while time.monotonic() < end:
            n += 1
            i, L = rng.choice(data["prompts"])
            seq = data["seqs"][i]
            ids = seq["ids"][:L]
            if rng.random() < spec["evict_p"]:
                keys = store.keys_for(ids)
                upto = keys[rng.randrange(len(keys))][2]
                emit({"op": "evict", "deleted": store.evict(ids[:upto])})
                continue
            SLOT.pack_into(board, wid * SLOT.size, n, LOADING)
            t0 = time.monotonic()
            ev = load_and_check(store, ids, data["expected"], rng.choice(("get", "fetch")))
            ev.update(seq=i, L=L, t0=t0)
            emit(ev)
            # An engine saves what it computed: put() encodes and writes only the chunks some tier lacks.
            SLOT.pack_into(board, wid * SLOT.size, n, SAVING)
            try:
                emit({"op": "save", "written": store.put(ids, slice_kv(seq, L))})
            except Exception as exc:
                emit({"op": "save", "written": 0, "error": f"{type(exc).__name__}: {exc}"})
            SLOT.pack_into(board, wid * SLOT.size, n, IDLE)
        emit({"op": "done"})
    store.close()
    board.close()
    os.close(fd)


# --- the parent: load, faults, checks ---------------------------------------------------------------------

@dataclass
class Run:
    cfg: Config
    folder: Path
    disk: Path
    redis: RedisServer
    spec_file: Path
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    tmpfs: bool = False
    used: dict[str, int] = field(default_factory=dict)  # injections per key
    board: mmap.mmap | None = None

    def spawn(self) -> int:
        wid = len(self.procs)
        if wid >= MAX_SLOTS:
            raise RuntimeError("too many worker processes")
        log = open(self.folder / f"worker-{wid}.log", "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.procs[wid] = subprocess.Popen([sys.executable, __file__, "--worker", str(self.spec_file), str(wid)],
                                           stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()
        return wid

    def state(self, wid: int) -> tuple[int, int]:
        return SLOT.unpack_from(self.board, wid * SLOT.size)

    def ready(self) -> set[int]:
        out = set()
        for wid in self.procs:
            f = self.folder / f"events-{wid}.jsonl"
            if f.exists() and f.stat().st_size:
                out.add(wid)
        return out


def kill_writer(r: Run, rng: random.Random, until: float) -> dict[str, Any] | None:
    """SIGKILL a worker that has been inside the same put() for a random 20-300 ms (so it is encoding or
    writing, not just finding every chunk stored), then start a replacement."""
    seen: dict[int, tuple[int, float]] = {}
    wait = rng.uniform(0.02, 0.3)
    while time.monotonic() < until:
        now = time.monotonic()
        for wid, proc in list(r.procs.items()):
            if proc.poll() is not None:
                continue
            n, st = r.state(wid)
            if st != SAVING:
                seen.pop(wid, None)
                continue
            first = seen.setdefault(wid, (n, now))
            if first[0] != n:
                seen[wid] = (n, now)
            elif now - first[1] >= wait:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return {"worker": wid, "pid": proc.pid, "in_put_s": round(now - first[1], 3),
                        "replacement": r.spawn()}
        time.sleep(0.005)
    return None


def pick_key(rng: random.Random, chunks: list[dict[str, Any]], chunk_tokens: int, used: dict[str, int]) -> dict[str, Any]:
    """A chunk that most loads read (one of the first two of a sequence), the least used for injections so far,
    so that two injections rarely share a key and each outcome is told apart."""
    hot = [c for c in chunks if c["start"] < 2 * chunk_tokens and c["end"] - c["start"] == chunk_tokens]
    least = min(used.get(c["key"], 0) for c in hot)
    c = rng.choice([c for c in hot if used.get(c["key"], 0) == least])
    used[c["key"]] = least + 1
    return c


def flip(data: bytes, rng: random.Random, count: int) -> bytes:
    out = bytearray(data)
    for pos in rng.sample(range(len(out)), count):
        out[pos] ^= rng.randrange(1, 256)
    return bytes(out)


def inject(r: Run, kind: str, prep: dict[str, Any], rng: random.Random, tool) -> list[dict[str, Any]]:
    """Store a bad value under a much-read key, once in Redis (with the disk copy deleted so the Redis copy is
    the one read) and once on disk, through the tiers' public put/delete."""
    from kvcodec.api import decode

    out = []
    for where in ("redis", "disk"):
        c = pick_key(rng, prep["chunks"], r.cfg.chunk_tokens, r.used)
        if kind == "corrupt":
            count = rng.choice((1, 4, 16))
            bad, what = flip(prep["blobs"][c["key"]], rng, count), f"{count} byte(s) flipped"
        else:
            bad, what = prep["alien"][kind][c["key"]], json.dumps(foreign_config(kind, r.cfg.codec))
        # The good value goes back everywhere first, so that a key holds at most one bad value at a time and
        # whatever a load meets under it belongs to this injection.
        for tier in tool.tiers:
            tier.put(c["key"], prep["blobs"][c["key"]])
        t = time.monotonic()  # before the bad value lands: a load may meet it at once
        if where == "redis":
            stored = tool.tier("redis").put(c["key"], bad)
            tool.tier("disk").delete(c["key"])
        else:
            stored = tool.tier("disk").put(c["key"], bad)
        try:
            fp = fingerprint([(l.keys, l.values) for l in decode(bad).layers])
        except Exception:  # a value that cannot decode cannot be served as a wrong chunk either
            fp = None
        out.append({"fault": kind, "t": t, "where": where, "key": c["key"], "seq": c["seq"],
                    "start": c["start"], "end": c["end"], "what": what, "stored": bool(stored), "fp": fp})
    return out


def fill_disk(disk: Path) -> int:
    """Write a ballast file until the tmpfs is full; returns its size."""
    n = 0
    block = b"\0" * (1 << 20)
    with open(disk / "ballast.fill", "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(block)
            except OSError:
                break
    return n


def run_faults(r: Run, prep: dict[str, Any], start: float, end: float, tool) -> None:
    cfg = r.cfg
    rng = random.Random(cfg.seed + 1)
    faults = [f for f in cfg.faults if f != "disk-full" or r.tmpfs]
    plan = []
    span = (end - start) / cfg.rounds
    for k in range(cfg.rounds):
        # Each round starts with a quiet tenth (the store fills) and ends with a quiet tenth (loads settle).
        slots = [start + span * (k + 0.1 + 0.8 * j / len(faults)) for j in range(len(faults))]
        plan += list(zip(slots, faults))
    for at, kind in plan:
        while time.monotonic() < at:
            time.sleep(0.02)
        t0 = time.monotonic()
        if kind == "writer-kill":
            got = kill_writer(r, rng, min(end, t0 + span / len(faults)))
            r.faults.append({"fault": kind, "t": t0, "t_end": time.monotonic() + cfg.settle_s,
                             **(got or {"skipped": "no worker was inside put() long enough"})})
        elif kind == "redis-restart":
            r.redis.kill()
            time.sleep(cfg.redis_outage_s)
            r.redis.start()
            r.faults.append({"fault": kind, "t": t0, "t_end": time.monotonic() + cfg.redis_down_for_s + cfg.settle_s,
                             "down_s": round(time.monotonic() - t0, 3)})
        elif kind == "disk-full":
            size = fill_disk(r.disk)
            hold = min(span / len(faults) * 0.7, max(0.0, end - time.monotonic() - 1))
            time.sleep(hold)
            os.unlink(r.disk / "ballast.fill")
            r.faults.append({"fault": kind, "t": t0, "t_end": time.monotonic() + cfg.settle_s,
                             "ballast_mb": round(size / 2**20, 1), "full_s": round(hold, 2)})
        else:
            r.faults += inject(r, kind, prep, rng, tool)


# --- the report -----------------------------------------------------------------------------------------------

def read_events(folder: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(folder.glob("events-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a killed worker
                pass
    return sorted(out, key=lambda e: e["t"])


def tally(r: Run, events: list[dict[str, Any]], chunks: list[dict[str, Any]], start: float,
          end: float) -> dict[str, Any]:
    """Assign each load to a fault and count misses, reported load errors and wrong chunks.

    A wrong chunk belongs to the injected value it decodes to (by fingerprint), else to the latest value
    injected under its key.  A reported error belongs to a value injected under one of the load's keys and not
    read since, else to the latest value injected under the key it stopped at; a miss at a key, to a value
    injected under it while that key has not been served correctly since.  Other loads
    belong to the window fault (writer kill, Redis restart, full disk) acting when they ended, else to
    ``none``, the quiet baseline."""
    rows = {name: {"injected": 0, "loads": 0, "misses": 0, "load_errors": 0, "wrong_chunks": 0, "ops": 0,
                   "seconds": 0.0, "values_served_wrong": 0, "values_detected": 0, "values_unread": 0}
            for name in ("none", *[f for f in ALL_FAULTS if f in r.cfg.faults])}
    where = {c["key"]: c for c in chunks}
    windows = [f for f in r.faults if "t_end" in f and "skipped" not in f]
    pending = sorted((f for f in r.faults if "key" in f), key=lambda f: f["t"])
    for f in r.faults:
        rows[f["fault"]]["injected"] += "skipped" not in f
        f.update(served_wrong=0, detected=0)
    for f in windows:
        rows[f["fault"]]["seconds"] += min(f["t_end"], end) - f["t"]
    done: list[dict[str, Any]] = []
    latest: dict[str, dict[str, Any]] = {}
    unread: dict[str, dict[str, Any]] = {}
    wrong_detail = []
    for ev in events:
        while pending and pending[0]["t"] <= ev["t"]:
            inj = pending.pop(0)
            done.append(inj)
            latest[inj["key"]] = unread[inj["key"]] = inj
        if ev["op"] not in ("load", "save", "evict") or not start <= ev["t"] <= end:
            continue
        window = next((f["fault"] for f in windows if f["t"] <= ev["t"] <= f["t_end"]), "none")
        rows[window]["ops"] += 1
        if ev["op"] != "load":
            continue
        row = window
        for w in ev["wrong"]:
            inj = next((i for i in reversed(done) if i["fp"] and i["fp"] == w.get("fp")), None) or latest.get(w["key"])
            name = inj["fault"] if inj else window
            rows[name]["wrong_chunks"] += 1
            if inj:
                inj["served_wrong"] += 1
                row = name
            c = where.get(w["key"], {})
            wrong_detail.append({**w, "worker": ev["w"], "mode": ev["mode"], "seq": ev["seq"], "L": ev["L"],
                                 "start": c.get("start"), "end": c.get("end"), "fault": name,
                                 "injected": {k: inj[k] for k in ("where", "what")} if inj else None,
                                 "exact": bool(inj and inj["fp"] and inj["fp"] == w.get("fp")),
                                 "t_run": round(ev["t"] - start, 2)})
        failed = bool(ev["reported"] or ev.get("error"))
        # A damaged copy in one tier can be evicted and the chunk served from the next: the load completes with
        # an error reported, at a key that is then among those served.  Of several candidates the value that
        # landed first is the likeliest one the load met.
        if failed:
            met = sorted((unread[k] for k in {ev["stop"], *ev["ok"]} if k in unread), key=lambda i: i["t"])
            inj = met[0] if met else latest.get(ev["stop"])
        else:
            inj = unread.get(ev["stop"])
        if inj:
            row = inj["fault"]
            inj["detected"] += failed
        rows[row]["loads"] += 1
        rows[row]["load_errors"] += failed
        rows[row]["misses"] += not failed and ev["served"] < ev["chunks"]
        for key in ev["ok"]:
            if key in unread and ev["t0"] >= unread[key]["t"]:  # a load that began earlier may have read the old value
                unread.pop(key)
    for inj in done:
        rows[inj["fault"]]["values_served_wrong"] += inj["served_wrong"] > 0
        rows[inj["fault"]]["values_detected"] += inj["detected"] > 0
        rows[inj["fault"]]["values_unread"] += not inj["served_wrong"] and not inj["detected"]
    return {"rows": rows, "wrong": wrong_detail}


def final_checks(r: Run, prep: dict[str, Any]) -> dict[str, Any]:
    """After the workers: temporary files, a clean reopen, a full re-check, a write, Redis clients, processes."""
    import redis

    out: dict[str, Any] = {}
    tmps = [p.name for p in r.disk.iterdir() if p.name.startswith(".tmp-")]
    out["tmp_files_left_by_kills"] = len(tmps)
    cfg = asdict(r.cfg)
    store = make_store(cfg, str(r.disk), r.redis.port, stale_tmp_s=0)  # nothing writes now: every .tmp-* is stale
    out["tmp_files_after_reopen"] = sorted(p.name for p in r.disk.iterdir() if p.name.startswith(".tmp-"))
    out["other_files"] = sorted(p.name for p in r.disk.iterdir() if not p.name.endswith(".kvc")
                                and not p.name.startswith(".tmp-"))
    wrong, loads = [], 0
    where = {c["key"]: c for c in prep["chunks"]}
    by_fp = {f["fp"]: f for f in r.faults if f.get("fp")}
    for n, (i, L) in enumerate(prep["prompts"]):
        ids = prep["seqs"][i]["ids"][:L]
        mode = ("get", "fetch")[n % 2]
        ev = load_and_check(store, ids, prep["expected"], mode)
        loads += 1
        for w in ev["wrong"]:
            inj = by_fp.get(w.get("fp"))
            c = where.get(w["key"], {})
            wrong.append({**w, "seq": i, "L": L, "mode": mode, "start": c.get("start"), "end": c.get("end"),
                          "fault": f"after the run ({inj['fault'] if inj else 'no injected value'})",
                          "injected": {k: inj[k] for k in ("where", "what")} if inj else None, "exact": bool(inj)})
    out["sweep_loads"], out["sweep_wrong"] = loads, wrong
    # Nothing is left locked: a chunk evicted everywhere can be written and read back whole.
    i, L = max(prep["prompts"], key=lambda p: p[1])
    ids = prep["seqs"][i]["ids"][:L]
    store.evict(ids)
    written = store.put(ids, slice_kv(prep["seqs"][i], L))
    ev = load_and_check(store, ids, prep["expected"], "get")
    out["rewrite_ok"] = written == ev["chunks"] == ev["served"] and not ev["wrong"]
    store.close()
    client = redis.Redis(port=r.redis.port, socket_timeout=5)
    try:
        me = client.client_id()
        out["redis_clients_left"] = [c.get("addr") for c in client.client_list() if int(c["id"]) != me]
    finally:
        client.close()
    return out


def report(r: Run, prep: dict[str, Any], tallied: dict[str, Any], final: dict[str, Any], events: list[dict[str, Any]],
           start: float, end: float, leftovers: list[tuple[int, str, str]]) -> dict[str, Any]:
    secs = end - start
    inside = [e for e in events if start <= e["t"] <= end]
    loads = [e for e in inside if e["op"] == "load"]
    count = {"loads": len(loads), "saves": sum(e["op"] == "save" for e in inside),
             "evicts": sum(e["op"] == "evict" for e in inside),
             "chunks_served": sum(e["served"] for e in loads),
             "chunks_written": sum(e.get("written", 0) for e in inside if e["op"] == "save")}
    # Operations take a second or more each on a busy machine: rates over 5-second windows, not single seconds.
    buckets: dict[int, int] = {}
    for e in inside:
        if e["op"] in ("load", "save", "evict"):
            buckets[int((e["t"] - start) / 5)] = buckets.get(int((e["t"] - start) / 5), 0) + 1
    per_window = [buckets.get(s, 0) / 5 for s in range(max(1, int(secs / 5)))]
    wrong_total = sum(row["wrong_chunks"] for row in tallied["rows"].values()) + len(final["sweep_wrong"])
    workers = sorted({e["w"] for e in events if e["op"] == "ready"})
    return {
        "config": {**asdict(r.cfg), "model": MODEL, "sequences": [s["name"] for s in prep["seqs"]],
                   "prompts": len(prep["prompts"]), "distinct_chunks": len(prep["chunks"])},
        "seconds": round(secs, 1), "worker_processes": len(workers), "counts": count,
        "ops_per_s": round(sum(buckets.values()) / secs, 2),
        "ops_per_s_lowest_5s": min(per_window),
        "chunks_served_per_s": round(count["chunks_served"] / secs, 2),
        "faults": tallied["rows"], "injections": r.faults, "skipped": r.skipped,
        "wrong_chunks_served": wrong_total, "wrong": tallied["wrong"] + final["sweep_wrong"],
        "load_exceptions": sorted({e["error"] for e in loads if e.get("error")}),
        "worker_exit_codes": {str(w): p.returncode for w, p in r.procs.items()},
        "final": final, "processes_left": [list(p) for p in leftovers],
    }


def markdown(rep: dict[str, Any]) -> str:
    c = rep["config"]
    lines = [
        "# Fault-and-load run of the KV store",
        "",
        f"{rep['worker_processes']} worker processes (at least {c['workers']} at a time) over {rep['seconds']} s: "
        f"one KVStore configuration ({c['model']}, codec {c['codec']}, {c['chunk_tokens']}-token chunks) on a "
        f"DiskTier folder and a RedisTier (one redis-server on 127.0.0.1). Prompts: {c['prompts']} prefixes of "
        f"{len(c['sequences'])} real SmolLM2 token sequences (up to {c['tokens']} tokens, {c['distinct_chunks']} "
        f"distinct chunks), real KV. Every chunk a load returns is compared bit for bit with the decode of its "
        f"reference KV. {c['rounds']} round(s) of faults. Produced by `python bench/fault_load.py`.",
        "",
        f"**Wrong chunks served: {rep['wrong_chunks_served']}**",
        "",
        f"Operations (a load, a save or an evict) per second: {rep['ops_per_s']} on average, "
        f"{rep['ops_per_s_lowest_5s']} in the slowest 5 seconds; chunks served per second: "
        f"{rep['chunks_served_per_s']}. Loads {rep['counts']['loads']}, saves {rep['counts']['saves']}, "
        f"evicts {rep['counts']['evicts']}, chunks served {rep['counts']['chunks_served']}, chunks written "
        f"{rep['counts']['chunks_written']}.",
        "",
        "| fault | injected | ops/s while it acted | loads | misses | reported load errors "
        "| bad values detected | bad values served | bad values never read | wrong chunks served |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rep["faults"].items():
        rate = f"{row['ops'] / row['seconds']:.1f}" if row["seconds"] else "-"
        targeted = name == "corrupt" or name.startswith("foreign")
        lines.append(f"| {name} | {row['injected'] if name != 'none' else '-'} | {rate} | {row['loads']} "
                     f"| {row['misses']} | {row['load_errors']} "
                     f"| {row['values_detected'] if targeted else '-'} | {row['values_served_wrong'] if targeted else '-'} "
                     f"| {row['values_unread'] if targeted else '-'} | {row['wrong_chunks']} |")
    lines += ["", "A load belongs to a targeted fault (corrupt, foreign-*) when it meets the injected value (a wrong "
              "chunk that decodes to it, an error or miss at its key before that key is next served correctly); "
              "otherwise to the window fault acting when it ended (writer-kill: "
              "the kill and a few seconds after; redis-restart: the outage and recovery; disk-full: while the "
              "ballast fills the tmpfs), else to `none`. A miss is a load that returned fewer chunks than the "
              "prompt has, without an error; a reported load error is a damaged chunk the store counted and "
              "evicted (or an exception). A bad value is never read when a good copy was written over it or "
              "served before it from a faster tier. Foreign values: "
              + "; ".join(f"{k}: {json.dumps(foreign_config(k, c['codec']))}" for k in FOREIGN if k in c["faults"])
              + "."]
    f = rep["final"]
    lines += ["", "After the run:", "",
              f"- temporary files left by killed writers: {f['tmp_files_left_by_kills']}; after reopening the "
              f"folder (stale_tmp_s=0): {len(f['tmp_files_after_reopen'])}; other files: {len(f['other_files'])}",
              f"- re-check of every prompt (get or fetch): {f['sweep_loads']} loads, "
              f"{len(f['sweep_wrong'])} wrong chunks still stored",
              f"- evict, write and read back a prompt: {'ok' if f['rewrite_ok'] else 'FAILED'}",
              f"- Redis client connections left: {len(f['redis_clients_left'])}",
              f"- processes left below the harness: {len(rep['processes_left'])}",
              f"- worker exit codes: {sorted(set(rep['worker_exit_codes'].values()), key=str)} (-9: killed by the "
              "writer-kill fault)"]
    if rep["skipped"]:
        lines += ["", "Skipped: " + "; ".join(rep["skipped"])]
    if rep["load_exceptions"]:
        lines += ["", "Exceptions loads raised: " + "; ".join(rep["load_exceptions"])]
    if rep["wrong"]:
        lines += ["", "Wrong chunks (first 20):", "", "| fault | injected where / what | chunk | served by | why |",
                  "|---|---|---|---|---|"]
        for w in rep["wrong"][:20]:
            inj = w.get("injected") or {}
            lines.append(f"| {w.get('fault', 'final re-check')} | {inj.get('where', '-')} {inj.get('what', '')}"
                         f"{' (exact)' if w.get('exact') else ''} | seq {w['seq']} tokens {w.get('start')}..{w.get('end')} "
                         f"| {w['mode']}{' from ' + w['tier'] if w.get('tier') else ''} | {w['why']} |")
    return "\n".join(lines) + "\n"


def run(cfg: Config, kv_paths: list[Path], out: Path | None, folder: Path | None = None,
        log=print) -> dict[str, Any]:
    """The whole run; returns the report (also written to ``out``.md/.json when ``out`` is given)."""
    from kvcodec.threads import torch_threads

    with torch_threads(1):  # the references must come from the same one-thread code path as the workers'
        return _run(cfg, kv_paths, out, folder, log)


def _run(cfg: Config, kv_paths: list[Path], out: Path | None, folder: Path | None, log) -> dict[str, Any]:
    if cfg.workers < 1 or cfg.rounds < 1:
        raise ValueError("workers and rounds must be positive")
    unknown = set(cfg.faults) - set(ALL_FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; the faults are {', '.join(ALL_FAULTS)}")
    own = folder is None
    folder = Path(tempfile.mkdtemp(prefix="kvcodec-faults-")) if own else folder
    disk = folder / "disk"
    disk.mkdir(parents=True)
    mounted, skipped = False, []
    redis_server = None
    r = None
    try:
        if "disk-full" in cfg.faults:
            why = mount_tmpfs(disk, cfg.tmpfs_mb)
            mounted = why is None
            if why:
                skipped.append(why)
                log(f"fault_load: {why}")
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH (Debian: apt-get install -y redis-server)")
        redis_server = RedisServer(exe, folder)
        redis_server.start()
        t = time.monotonic()
        prep = prepare(cfg, kv_paths, folder)
        log(f"fault_load: {len(prep['prompts'])} prompts, {len(prep['chunks'])} distinct chunks, references in "
            f"{time.monotonic() - t:.1f} s")
        spec = {**asdict(cfg), "run": str(folder), "disk": str(disk), "port": redis_server.port}
        spec_file = folder / "spec.json"
        spec_file.write_text(json.dumps(spec))
        (folder / "state.bin").write_bytes(b"\0" * SLOT.size * MAX_SLOTS)
        r = Run(cfg, folder, disk, redis_server, spec_file, skipped=skipped, tmpfs=mounted)
        fd = os.open(folder / "state.bin", os.O_RDWR)
        r.board = mmap.mmap(fd, SLOT.size * MAX_SLOTS)
        os.close(fd)
        for _ in range(cfg.workers):
            r.spawn()
        deadline = time.monotonic() + cfg.start_timeout_s
        while len(r.ready()) < cfg.workers:
            dead = [w for w, p in r.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = (folder / f"worker-{(dead or [0])[0]}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"workers did not start (exited: {dead}); log:\n{logs}")
            time.sleep(0.05)
        start = time.monotonic() + 0.2
        end = start + cfg.seconds
        (folder / "go.tmp").write_text(json.dumps({"end": end}))
        os.replace(folder / "go.tmp", folder / "go.json")
        log(f"fault_load: {cfg.workers} workers started; running {cfg.seconds:.0f} s with faults {', '.join(cfg.faults)}")
        tool = make_store(spec, str(disk), redis_server.port)
        try:
            run_faults(r, prep, start, end, tool)
        finally:
            tool.close()
        # Workers stop by themselves at `end`; one that has not after a generous grace is reported and killed.
        for wid, p in list(r.procs.items()):
            try:
                p.wait(timeout=max(1.0, end - time.monotonic()) + 120)
            except subprocess.TimeoutExpired:
                r.skipped.append(f"worker {wid} did not stop within 120 s of the end: killed")
                p.kill()
                p.wait()
        crashed = {w: p.returncode for w, p in r.procs.items()
                   if p.returncode not in (0, -signal.SIGKILL)}
        for w in crashed:
            log(f"fault_load: worker {w} exited with {crashed[w]}:\n"
                + (folder / f"worker-{w}.log").read_text(errors="replace")[-2000:])
        events = read_events(folder)
        final = final_checks(r, prep)
        redis_server.kill()
        leftovers = descendants(os.getpid())
        tallied = tally(r, events, prep["chunks"], start, end)
        rep = report(r, prep, tallied, final, events, start, end, leftovers)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
            out.with_suffix(".md").write_text(markdown(rep))
        return rep
    finally:
        if r is not None:
            for p in r.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if r.board is not None:
                r.board.close()
        if redis_server is not None:
            redis_server.kill()
        if mounted:
            unmount(disk)
        if own:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(Path(argv[1]), int(argv[2]))
        return 0
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Root is needed for the disk-full fault (a tmpfs mount); without it that "
                                        "fault is skipped with a message. Exits 1 when a wrong chunk was served or "
                                        "something was left behind.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workers", type=int, default=d.workers, help="worker processes running at once")
    ap.add_argument("--seconds", type=float, default=d.seconds, help="how long the load runs")
    ap.add_argument("--rounds", type=int, default=d.rounds, help="times every fault is injected, spread over the run")
    ap.add_argument("--codec", default=d.codec, help="the store's codec (cachegen or raw)")
    ap.add_argument("--tokens", type=int, default=d.tokens, help="tokens of each sequence that prompts are prefixes of")
    ap.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens, help="the store's chunk size")
    ap.add_argument("--faults", default=",".join(d.faults), help="comma-separated faults to inject")
    ap.add_argument("--texts", default=",".join(DEFAULT_TEXTS),
                    help="texts (kvcodec.texts names) whose real KV is dumped once into .cache/fault-load")
    ap.add_argument("--kv", action="append", type=Path, help="use these KV dumps instead of --texts (repeatable)")
    ap.add_argument("--tmpfs-mb", type=int, default=d.tmpfs_mb, help="size of the tmpfs holding the disk tier")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", type=Path, default=OUT, help="report path without suffix (.md and .json are written)")
    args = ap.parse_args(argv)
    cfg = Config(workers=args.workers, seconds=args.seconds, rounds=args.rounds, codec=args.codec, tokens=args.tokens,
                 chunk_tokens=args.chunk_tokens, faults=tuple(f for f in args.faults.split(",") if f),
                 seed=args.seed, tmpfs_mb=args.tmpfs_mb)
    kv = args.kv or [dump_kv(t, cfg.tokens, REPO / ".cache" / "fault-load") for t in args.texts.split(",")]
    try:
        rep = run(cfg, kv, args.out)
    except Exception:
        traceback.print_exc()
        return 2
    print(markdown(rep))
    f = rep["final"]
    bad = (rep["wrong_chunks_served"] or f["tmp_files_after_reopen"] or f["redis_clients_left"]
           or rep["processes_left"] or not f["rewrite_ok"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
