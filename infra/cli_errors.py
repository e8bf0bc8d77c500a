"""The ``thaw`` CLI's two failures, shared by its parts (`infra.cli` and the `cli_*` command
modules) so that no part imports another for them: bad input (`UsageError`, exit status 2) and a
failed call to the platform's admin API (`AdminCommandError`, with the exit status it means)."""

from __future__ import annotations

__all__ = ["AdminCommandError", "UsageError"]


class UsageError(Exception):
    """Bad input from the command line: exit status 2."""


class AdminCommandError(Exception):
    """A failed admin call, with the exit status it means (2 bad input, 1 otherwise)."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status
