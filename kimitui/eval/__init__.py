"""Fidelity measurements: is a serving path the model? (KL against a reference path; recall.)

Plain Python over ``engine`` and HTTP; no UI, so the command line and the TUI share it."""
