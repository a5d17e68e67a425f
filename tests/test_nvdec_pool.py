"""The NVDEC idle-session pool stays bounded (a stand-in decoder: NVDEC needs a GPU)."""

from __future__ import annotations

import pytest

from kvcodec.codecs.kvfetcher import nvdec


class _Nvc:
    class cudaVideoCodec:
        HEVC = "hevc"

    made = 0

    @classmethod
    def CreateDecoder(cls, **kwargs):
        cls.made += 1
        return f"session-{cls.made}"


@pytest.fixture()
def pool(monkeypatch):
    _Nvc.made = 0
    monkeypatch.setattr(nvdec, "_nvc", lambda: _Nvc)
    monkeypatch.setattr(nvdec, "_IDLE", {})
    return nvdec


def _idle(pool) -> int:
    return sum(len(v) for v in pool._IDLE.values())


def test_idle_sessions_are_bounded_across_geometries(pool):
    for rows in range(1, 13):  # twelve picture geometries, one finished stream each
        pool.NvdecStream(rows, 64, 8, 2).release()
    assert _Nvc.made == 12 and _idle(pool) == pool.MAX_IDLE_SESSIONS == 8
    assert sorted(k[3] for k in pool._IDLE) == list(range(5, 13))  # the least recently returned went first
    again = pool.NvdecStream(12, 64, 8, 2)
    assert again.dec == "session-12" and _Nvc.made == 12 and (0, 0, 8, 12, 64) not in pool._IDLE
    pool.NvdecStream(5, 64, 8, 2).release()  # reused and returned: geometry 5 is now the most recent
    again.release()
    assert _idle(pool) == 8 and list(pool._IDLE)[-2:] == [(0, 0, 8, 5, 64), (0, 0, 8, 12, 64)]


def test_idle_sessions_are_bounded_for_one_geometry(pool):
    streams = [pool.NvdecStream(16, 64, 10, 2) for _ in range(20)]  # twenty concurrent decodes
    for s in streams:
        s.release()
    assert _Nvc.made == 20 and _idle(pool) == 8 and pool._IDLE[(0, 0, 10, 16, 64)][-1] == "session-20"
    assert pool.NvdecStream(16, 64, 10, 2, reuse=False).dec == "session-21"  # reuse=False neither takes nor keeps
