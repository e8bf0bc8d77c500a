"""`MigrationOutcome` (how one live migration went) and its `MigrationMethod` / `MigrationStatus`
now live in `wire/` (`wire.migration_outcome`).

The migration driver returns the outcome to the controller (and through it the CLI) across a
process boundary, so it is a wire record, defined once in the `wire` package (tagged, checked
again on arrival). This module re-exports the three for this folder's protocols and for callers
of ``migration.migration_outcome``; ``from migration import MigrationOutcome`` works as before.
"""

from wire.migration_outcome import MigrationMethod, MigrationOutcome, MigrationStatus

__all__ = ["MigrationMethod", "MigrationOutcome", "MigrationStatus"]
