"""Speculative decoding: speed tables, launch counts, and the trainers of the tiny drafter pairs the tests use."""
