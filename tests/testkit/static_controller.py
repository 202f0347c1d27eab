"""A stand-in for cluster.deploy.controller.Controller where a test serves membership
(cluster.deploy.membership_service.serve_membership) to real routers over a fixed member list:
every worker colocated, in no drafter pool, serving the default model."""

from __future__ import annotations

from collections.abc import Callable


class StaticController:
    """What serve_membership needs of the controller, for a static member list of (id, endpoint)."""

    def __init__(self, members: list[tuple[str, str]]) -> None:
        self.members = members

    def role_of(self, worker_id: str) -> str:
        return "colocated"

    def drafter_pool_of(self, worker_id: str) -> str:
        return ""

    def model_of(self, worker_id: str) -> str:
        return ""  # the default model

    def subscribe(self, push: Callable[[list[tuple[str, str]]], None], *, detailed: bool = False) -> None:
        push(self.members)
