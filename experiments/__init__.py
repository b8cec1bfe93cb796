"""Thin experiment entry points: main(config) -> results."""
