"""How the platform is stood up, served and operated: the ``thaw`` CLI (`infra.cli`), the
platform ``thaw serve`` runs (`infra.platform`: Ray, the controller with its node stores, the
gateway), and the gateway itself: an OpenAI-compatible HTTP app (`infra.gateway_app`) served by
Ray Serve (`infra.gateway_deployment`) that routes requests to the controller's instances
(`infra.ray_gateway_backend`), with its access checks, admin API and metrics.

Public API: `main` (the console-script entry point). Nothing else in Thaw imports this folder:
it is the top of the stack. Its other modules are imported by path only within it (a gateway
replica imports the app it serves), by the tests, and by the benchmarks (`bench/` starts a
`Platform` from a `PlatformConfig`).
"""

__all__ = ["main"]


def __getattr__(name: str):
    """`main` on first use (PEP 562): importing the package does not import the CLI, so
    ``python -m infra.cli`` runs it once, without runpy's warning that it was imported already."""
    if name == "main":
        from infra.cli import main

        return main
    raise AttributeError(f"module 'infra' has no attribute {name!r}")
