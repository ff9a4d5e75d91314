"""Offline long-context quality suite (issue 4)."""
