"""Helpers for tests and examples: tiny models built in code (``tiny_models``), no hub needed,
and their command ``weightsync make-model`` (``make_model``);
bit-exact state digests (``digest``); reward and policy servers as subprocesses (``servers``).

Not imported by ``import weightsync``; ``tiny_models`` imports torch and transformers.
"""
