"""Traces of multi-tenant workloads and the metadata-only load test (DESIGN.md §2 `sim/`)."""
