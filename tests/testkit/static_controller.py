"""A stand-in for cluster.deploy.controller.Controller where a test serves membership
(cluster.deploy.membership_service.serve_membership) to real routers over a fixed member list:
every worker colocated, in no drafter pool, serving the default model (the library's StaticMembers)."""

from __future__ import annotations

from cluster.deploy.membership_service import StaticMembers as StaticController

__all__ = ["StaticController"]
