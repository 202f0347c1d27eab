"""Several models and LoRA adapters at the router, without a server: the catalog's name resolution
(router/catalog.py), the adapter registry's three origins (router/adapters.py), adapter-affinity
routing (router/policies/adapter_affinity.py) and prefix matching keyed by adapter."""

from __future__ import annotations

import grpc
import pytest

from router.adapters import CONFIG, DIRECTORY, RUNTIME, AdapterError, AdapterRegistry
from router.catalog import ModelCatalog
from router.config import AdapterSpec, ModelSpec, RouterConfig, RouterConfigError
from router.policies import NoWorkersAvailable, RouteRequest, WorkerState, make_policy
from router.policies.adapter_affinity import AdapterAffinityPolicy
from router.prefix_index import BlockReport, PrefixIndex
from router.preprocess import RequestError, ServedModel
from workers.block_hash import adapter_root, chain_hashes

SMOL, TINY = "SmolLM2-135M-Instruct", "tiny"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def catalog(tok, tmp_path):
    specs = [ModelSpec(SMOL, "unused", adapters=(AdapterSpec("sql", "/adapters/sql", pinned=True),)),
             ModelSpec(TINY, "unused", adapter_dir=str(tmp_path / "tiny-adapters"))]
    models = [ServedModel(SMOL, tok, 8192, len(tok)), ServedModel(TINY, tok, 256, len(tok))]
    return ModelCatalog(models, AdapterRegistry(specs, clock=Clock()))


def _adapter_dir(root, name: str) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')


def test_a_request_model_resolves_to_its_base_and_adapter(catalog):
    assert catalog.resolve("") == (catalog.default, None)
    assert catalog.resolve(SMOL)[0].name == SMOL and catalog.resolve(TINY)[0].name == TINY
    model, adapter = catalog.resolve("sql")
    assert (model.name, adapter.name, adapter.base, adapter.origin) == (SMOL, "sql", SMOL, CONFIG)
    model, adapter = catalog.resolve(f"{SMOL}:sql")
    assert (model.name, adapter.spec.source) == (SMOL, "/adapters/sql")
    for bad, why in (("gpt-4", "neither a served model"), (f"{TINY}:sql", "tiny has no adapter 'sql'"),
                     ("nope:sql", "no served model 'nope'")):
        with pytest.raises(RequestError) as e:
            catalog.resolve(bad)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert e.value.message.startswith(f"model: unknown model {bad!r}") and why in e.value.message
        assert f"served models: {SMOL}, {TINY}" in e.value.message


def test_cards_list_every_model_then_every_adapter_with_its_parent(catalog, tmp_path):
    _adapter_dir(tmp_path / "tiny-adapters", "poet")
    cards = catalog.cards()
    assert [(c.name, c.parent, c.is_default, c.max_model_len) for c in cards] == [
        (SMOL, "", True, 8192), (TINY, "", False, 256), ("sql", SMOL, False, 8192), ("poet", TINY, False, 256)]
    assert cards[3].source == str((tmp_path / "tiny-adapters" / "poet").resolve())


def test_watched_directory_adds_and_removes_adapters(tmp_path):
    root = tmp_path / "adapters"
    clock = Clock()
    reg = AdapterRegistry([ModelSpec(SMOL, "x", adapter_dir=str(root))], clock=clock)
    assert reg.get("poet") is None  # the directory does not exist yet: a warning, no adapters
    _adapter_dir(root, "poet")
    (root / "not-an-adapter").mkdir()  # no adapter_config.json: ignored
    clock.now += 0.2
    assert reg.get("poet") is None  # a miss rescans at most every miss_rescan_s (0.5 s)
    clock.now += 0.4
    poet = reg.get("poet")
    assert poet is not None and (poet.base, poet.origin) == (SMOL, DIRECTORY)
    assert reg.get("not-an-adapter") is None
    (root / "poet" / "adapter_config.json").unlink()
    clock.now += 10  # listing rescans every rescan_s
    assert reg.adapters() == []
    with pytest.raises(AdapterError) as e:
        reg.unregister("poet")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_runtime_registration_and_its_refusals(tmp_path):
    root = tmp_path / "adapters"
    _adapter_dir(root, "poet")
    reg = AdapterRegistry([ModelSpec(SMOL, "x", adapters=(AdapterSpec("sql", "/a/sql"),), adapter_dir=str(root)),
                           ModelSpec(TINY, "y")])
    chat = reg.register(AdapterSpec("chat", "/a/chat"), TINY)
    assert (chat.base, chat.origin) == (TINY, RUNTIME) and reg.get("chat") is chat
    refusals = [(AdapterSpec("sql", "/b"), SMOL, grpc.StatusCode.ALREADY_EXISTS, "already registered on "
                 f"{SMOL} (from config"), (AdapterSpec("chat", "/b"), SMOL, grpc.StatusCode.ALREADY_EXISTS, "runtime"),
                (AdapterSpec(TINY, "/b"), SMOL, grpc.StatusCode.ALREADY_EXISTS, "served model's name"),
                (AdapterSpec("x", "/b"), "nope", grpc.StatusCode.NOT_FOUND, "unknown model 'nope'")]
    for spec, base, code, words in refusals:
        with pytest.raises(AdapterError) as e:
            reg.register(spec, base)
        assert e.value.code == code and words in e.value.message, e.value.message
    for name, words in (("sql", "comes from the config"), ("poet", "the watched directory")):
        with pytest.raises(AdapterError) as e:
            reg.unregister(name)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and words in e.value.message
    assert reg.unregister("chat").name == "chat" and reg.get("chat") is None
    assert [a.name for a in reg.adapters()] == ["poet", "sql"]


def test_router_config_refuses_a_name_used_twice():
    with pytest.raises(RouterConfigError, match="'sql': the name is used twice"):
        RouterConfig(tokenizer_path="x", adapters=(AdapterSpec("sql", "/a"),),
                     models=(ModelSpec(TINY, "y", adapters=(AdapterSpec("sql", "/b"),)),))
    with pytest.raises(RouterConfigError, match="name='a:b': must be letters"):
        AdapterSpec("a:b", "/a")
    with pytest.raises(RouterConfigError, match="name='m:x': must be a non-empty name without ':'"):
        ModelSpec("m:x", "/a")


def _worker(wid: str, load: int = 0, adapters: tuple[str, ...] = (), healthy: bool = True,
            lora: bool = True) -> WorkerState:
    return WorkerState(wid, healthy=healthy, outstanding_tokens=load, adapters=frozenset(adapters),
                       max_loaded_adapters=4 if lora else 0)


def test_adapter_affinity_prefers_a_holder_unless_overloaded():
    policy = AdapterAffinityPolicy(make_policy("least_loaded"))
    req = RouteRequest("r", [1, 2, 3], 4, adapter="sql")
    # w1 holds it: chosen although w0 is idler (900 - 100 <= 4096)
    assert policy.select(req, [_worker("w0", 100), _worker("w1", 900, ("sql",))]) == "w1"
    # of two holders the inner policy (least_loaded) picks the idler one
    assert policy.select(req, [_worker("w0", 0), _worker("w1", 900, ("sql",)), _worker("w2", 500, ("sql",))]) == "w2"
    # the holder is overloaded (6000 - 1000 > 4096 and 6000 > 1.5 x 1000): the least-loaded worker loads it
    assert policy.select(req, [_worker("w0", 1000), _worker("w1", 6000, ("sql",))]) == "w0"
    # nobody holds it: the least-loaded one
    assert policy.select(req, [_worker("w0", 300), _worker("w1", 200, ("other",))]) == "w1"
    # an unhealthy holder is no holder
    assert policy.select(req, [_worker("w0", 300), _worker("w1", 0, ("sql",), healthy=False)]) == "w0"
    # a worker without adapter support is no candidate, however idle
    assert policy.select(req, [_worker("w0", 0, lora=False), _worker("w1", 800)]) == "w1"
    with pytest.raises(NoWorkersAvailable):
        policy.select(req, [_worker("w0", 0, lora=False)])
    # no adapter: the inner policy alone (holding "sql" does not attract base requests)
    assert policy.select(RouteRequest("b", [1, 2, 3]), [_worker("w0", 900, ("sql",)), _worker("w1", 100)]) == "w1"
    assert policy.counters() == {"adapter_hits": 2, "adapter_cold": 3, "adapter_overload_fallbacks": 1}


def test_prefix_aware_never_matches_a_prefix_across_adapters():
    """A worker holding a prompt's prefix computed for the base model (or another adapter) is no
    prefix hit for an adapter request: the hashes chain from the adapter's root, as the workers'."""
    index = PrefixIndex()
    prompt = list(range(1, 65))  # 4 blocks of 16
    index.apply("w0", "i0", BlockReport(1, True, chain_hashes(prompt, 16)), block_size=16)
    index.apply("w1", "i1", BlockReport(1, True, chain_hashes(prompt, 16, root=adapter_root("sql"))), block_size=16)
    index.apply("w2", "i2", BlockReport(1, True, ()), block_size=16)
    policy = make_policy("prefix_aware", index, pending_s=0.0)
    workers = [_worker("w0", 500), _worker("w1", 500), _worker("w2", 0)]
    assert policy.select(RouteRequest("base", prompt), workers) == "w0"
    assert policy.select(RouteRequest("sql", prompt, adapter="sql"), workers) == "w1"
    assert policy.select(RouteRequest("chat", prompt, adapter="chat"), workers) == "w2"  # no match: least loaded
    assert index.match(prompt, root=adapter_root("sql")) == {"w1": 4}
    assert index.match(prompt) == {"w0": 4}


def test_prefix_tree_keys_blocks_by_adapter():
    """Without reported holdings (the router's own tree) the same holds: a prompt sent under one
    adapter is no hit for another."""
    policy = make_policy("prefix_aware")
    prompt = list(range(1, 65))
    workers = [_worker("w0"), _worker("w1")]
    first = policy.select(RouteRequest("a", prompt, adapter="sql"), workers)
    loaded = [_worker(w.worker_id, 100 if w.worker_id == first else 0) for w in workers]
    assert policy.select(RouteRequest("b", prompt, adapter="sql"), loaded) == first  # hit
    other = policy.select(RouteRequest("c", prompt), loaded)  # the base model: no hit, least loaded
    assert other != first
