"""Fixtures of the router tests: the SmolLM2 tokenizer, a pool of two in-process fake workers
(tests/testkit/router_fakes.py) and a throwaway PKI (tests/testkit/pki.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.pki import make_pki
from testkit.router_fakes import fake_pool, load_tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_tokenizer(str(smollm2_path))


@pytest.fixture(scope="module")
def pool(tok):
    with fake_pool(tok) as servers:
        yield servers


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))
