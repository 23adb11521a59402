"""An engine's load on one of several replicas: it pauses the engine's sessions only
while it leads the engine. Interpreted, apart from :mod:`kvproxy.replication.ledger`
(compiled with the request path), because it subclasses a Python class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvproxy.admission.program.engagement import Load


def _always() -> bool:
    return True


@dataclass(slots=True)
class SyncedLoad(Load):
    """An engine's load on a replica that pauses its sessions only while it leads the
    engine (``pauser``): with several replicas, one pauses for the fleet (each ticking
    on its own would pause at N times the rate), and the others apply its pauses."""

    pauser: Callable[[], bool] = _always

    @property
    def pauses_undone(self) -> bool:
        return bool(Load.pauses_undone.fget(self)) or not self.pauser()  # type: ignore[attr-defined]
