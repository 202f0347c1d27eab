"""ModelCatalog: the models a router serves (one tokenizer and chat template each) and the LoRA
adapters registered on them; turns a request's ``model`` into (base model, adapter).

What ``GenerateRequest.model`` (and HTTP ``model``) may say:

    ""                      the default model (RouterConfig.model_name), no adapter
    "<model>"               that served model, no adapter
    "<model>:<adapter>"     that adapter, which must be registered on that model
    "<adapter>"             that adapter on the model it is registered on

Anything else is NOT_FOUND (HTTP 404) naming what was asked and what is served. Workers are
picked among the model's own (router/pipeline.py filters by the member's model), so a request is
never routed to a worker of another model.

Example::

    catalog = ModelCatalog([smol, tiny], AdapterRegistry(config.served_models))
    catalog.resolve("")                              # (smol, None)
    catalog.resolve("SmolLM2-135M-Instruct:sql")     # (smol, RegisteredAdapter(sql ...))
    catalog.resolve("gpt-4")                         # RequestError NOT_FOUND "model: unknown model 'gpt-4'; ..."
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from router.adapters import AdapterRegistry, RegisteredAdapter
from router.preprocess import RequestError, ServedModel


@dataclass(frozen=True)
class ModelCard:
    """One entry of ListModels / GET /v1/models: a base model (parent "") or an adapter."""

    name: str
    max_model_len: int
    is_default: bool = False
    parent: str = ""
    source: str = ""


class ModelCatalog:
    def __init__(self, models: Sequence[ServedModel], adapters: AdapterRegistry | None = None) -> None:
        assert models, "a catalog serves at least one model"
        self.default = models[0]
        self._models = {m.name: m for m in models}
        assert len(self._models) == len(models), "model names must be unique"
        self.adapters = adapters or AdapterRegistry([])

    @classmethod
    def single(cls, model: ServedModel) -> ModelCatalog:
        """A catalog of one model and no adapters (a router built around one ServedModel)."""
        return cls([model])

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def model(self, name: str) -> ServedModel:
        """The served model ``name`` ("" = the default); KeyError if it is not served."""
        return self.default if not name else self._models[name]

    def __contains__(self, name: str) -> bool:
        return name in self._models

    def resolve(self, requested: str) -> tuple[ServedModel, RegisteredAdapter | None]:
        """(base model, adapter or None) for a request's ``model`` (module docstring)."""
        if not requested:
            return self.default, None
        if requested in self._models:
            return self._models[requested], None
        base, sep, name = requested.partition(":")
        if sep:
            if base not in self._models:
                raise self._unknown(requested, f"no served model {base!r}")
            adapter = self.adapters.get(name)
            if adapter is None or adapter.base != base:
                raise self._unknown(requested, f"{base} has no adapter {name!r}")
            return self._models[base], adapter
        adapter = self.adapters.get(requested)
        if adapter is None:
            raise self._unknown(requested, "neither a served model nor a registered adapter")
        return self._models[adapter.base], adapter

    def _unknown(self, requested: str, why: str) -> RequestError:
        return RequestError(grpc.StatusCode.NOT_FOUND,
                            f"model: unknown model {requested!r} ({why}); served models: {', '.join(self._models)} "
                            "(adapters: ListModels or GET /v1/models; empty model = the default "
                            f"{self.default.name!r})")

    def cards(self) -> list[ModelCard]:
        """Every base model (the default first), then every adapter by base and name."""
        out = [ModelCard(m.name, m.max_model_len, is_default=m is self.default) for m in self._models.values()]
        out += [ModelCard(a.name, self._models[a.base].max_model_len, parent=a.base, source=a.spec.source)
                for a in self.adapters.adapters() if a.base in self._models]
        return out
