"""How the platform is stood up and operated: the ``thaw`` CLI (and, in later issues, the gateway).

Public API: `main` (the console-script entry point).
"""

from infra.cli import main

__all__ = ["main"]
