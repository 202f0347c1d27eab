"""spawn_gang's ranks (workers/parallel/launch.py) fork from one fork server per calling process,
which imported torch and transformers before the first rank: ranks start in a fraction of a second
instead of importing both again, and each takes the caller's environment as it is at the call."""

from __future__ import annotations

import os

from testkit.launch_cases import where_rank
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang

VAR = "DUET_TEST_LAUNCH_ENV"


def test_ranks_fork_from_one_preloaded_server_with_the_callers_environment(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    first = spawn_gang(where_rank, ParallelConfig(tp_size=2), args=(VAR,))
    monkeypatch.setenv(VAR, "set after the server started")
    second = spawn_gang(where_rank, ParallelConfig(tp_size=2), args=(VAR,))
    assert [r["rank"] for r in first + second] == [0, 1, 0, 1]
    parents = {r["parent"] for r in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # one server, reused; not this process
    assert len({r["pid"] for r in first + second}) == 4  # a fresh process per rank
    assert all(r["transformers"] for r in first + second)  # imported by the server, not by the rank
    assert [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in second] == ["set after the server started"] * 2
