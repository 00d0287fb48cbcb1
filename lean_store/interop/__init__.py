"""Readers and writers for checkpoint files of other ML frameworks."""
