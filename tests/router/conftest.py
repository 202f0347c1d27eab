"""Fixtures of the router tests: the SmolLM2 tokenizer, a pool of two in-process fake workers
(tests/testkit/router_fakes.py), a throwaway PKI (tests/testkit/pki.py) and a Pipeline over an
in-memory worker directory (tests/testkit/pipeline_fakes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.admission import AdmissionController
from router.config import RouterConfig
from router.hold import WorkerHold
from router.pipeline import Pipeline
from router.policies import make_policy
from router.preprocess import ServedModel
from testkit.pipeline_fakes import FakeDirectory
from testkit.pki import make_pki
from testkit.router_fakes import SCRIPT, fake_pool, load_tokenizer


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


@pytest.fixture
def fake_pipeline(smollm2_path, tok):
    """fake_pipeline(roles={"w0": "colocated", ...}, hold=None, **RouterConfig overrides) -> (Pipeline,
    FakeDirectory); hold: the pipeline's router.hold.WorkerHold (default: one without a waker). Defaults: three colocated workers w0..w2, least_loaded (ties go to the lowest
    id, so w0 first), worker_wait_s=0.3, every prompt disaggregated when prefill workers exist
    (disagg_min_prompt_tokens=0). The fake workers replay SCRIPT's SmolLM2 tokenization + EOS.
    When the test ends it checks that no worker lease, admission slot or worker call was left
    open."""
    script = tok.encode(SCRIPT, add_special_tokens=False) + [tok.eos_token_id]
    made: list[tuple[Pipeline, FakeDirectory]] = []

    def make(roles: dict[str, str] | None = None, hold: WorkerHold | None = None,
             **overrides: object) -> tuple[Pipeline, FakeDirectory]:
        config = RouterConfig(**{"tokenizer_path": str(smollm2_path), "policy": "least_loaded", "worker_wait_s": 0.3,
                                 "disagg_min_prompt_tokens": 0, **overrides})  # type: ignore[arg-type]
        directory = FakeDirectory(script, roles or {"w0": "colocated", "w1": "colocated", "w2": "colocated"})
        model = ServedModel(config.model_name, tok, 8192, len(tok))
        pipeline = Pipeline(config, model, directory, make_policy("least_loaded"),  # type: ignore[arg-type]
                            AdmissionController(config.max_in_flight, config.max_queue), hold=hold)
        made.append((pipeline, directory))
        return pipeline, directory

    yield make
    for pipeline, directory in made:
        assert not directory.leases, "a worker lease was left open"
        assert pipeline.admission.stats()["in_flight"] == 0, "an admission slot was left held"
        assert all(call.done() for w in directory.workers.values() for call in w.calls), "a worker call left open"
