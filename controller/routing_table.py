"""The routing table: for each model, its ready instances and their load, under a version.

The gateway keeps a copy and routes from it, so a warm model never waits on the controller; it
asks for a new copy when the version it holds is no longer current (``routing_table(known)``
on the controller, which can also wait for the next change: a long poll, as Ray Serve's
routers do). The version increases on every change -- an instance added or removed, a load
figure moved -- and never otherwise, so an unchanged version means an unchanged table.

Only READY instances are listed: an instance still loading would make the gateway wait on it
instead of queueing, and one being stopped must receive no new request.

A route is `wire.InstanceRoute` (here called `Route`): the gateway reads the table's route dicts
with the same record that wrote them.
"""

from __future__ import annotations

from wire import InstanceRoute as Route


class RoutingTable:
    """Model id -> routes (sorted by instance id), with a version bumped on every change."""

    def __init__(self) -> None:
        self._routes: dict[str, tuple[Route, ...]] = {}
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def set_routes(self, model_id: str, routes: list[Route]) -> bool:
        """Replace the routes of one model; True (and a new version) if anything differs."""
        ordered = tuple(sorted(routes, key=lambda route: route.instance_id))
        if self._routes.get(model_id, ()) == ordered:
            return False
        if ordered:
            self._routes[model_id] = ordered
        else:
            self._routes.pop(model_id, None)
        self._version += 1
        return True

    def remove_model(self, model_id: str) -> bool:
        return self.set_routes(model_id, [])

    def routes(self, model_id: str) -> tuple[Route, ...]:
        return self._routes.get(model_id, ())

    def snapshot(self) -> tuple[int, dict[str, list[dict[str, object]]]]:
        """(version, model id -> list of route dicts): plain data for the gateway."""
        return self._version, {model_id: [route.to_dict() for route in routes]
                               for model_id, routes in sorted(self._routes.items())}
