"""Pallas paged-attention kernels, each beside its plain-JAX reference."""
