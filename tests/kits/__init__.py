"""Helpers shared by the test packages: each builds one kind of fixture (tiny models, tokenizers, chat templates, hub caches, runs of the workflow or of stages)."""
