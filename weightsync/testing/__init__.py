"""Helpers for tests and examples: tiny models built in code (``tiny_models``), no hub needed.

Not imported by ``import weightsync``; ``tiny_models`` imports torch and transformers.
"""
