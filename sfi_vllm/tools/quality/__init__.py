"""Offline long-context quality suite: tasks, runner, teacher forcing, fidelity and reports."""
