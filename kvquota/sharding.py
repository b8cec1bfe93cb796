"""The state and the model across devices with `jax.sharding` (DESIGN.md "Scale")."""
