"""The serving benchmark runs against the router tests' in-process fake workers
(tests/testkit/router_fakes.py)."""

from __future__ import annotations

import pytest

from testkit.router_fakes import fake_pool, load_tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_tokenizer(str(smollm2_path))


@pytest.fixture(scope="module")
def pool(tok):
    with fake_pool(tok) as servers:
        yield servers
