"""Tiny offline models and sample tasks: the embedded default and test fixtures."""
