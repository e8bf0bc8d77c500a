"""Placeholder: filled in by its own issue."""
