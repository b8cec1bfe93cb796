"""Strict JAX settings for the whole suite (as Equinox does): silent rank promotion hides shape bugs."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
