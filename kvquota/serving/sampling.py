"""How the next token is chosen: the `Sampling` settings and the jitted sampler."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
      temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
      top_k: if > 0, sample only among the k most likely tokens.
      seed: seeds the sampler; step s of a generation uses fold_in(key(seed), s).
    """

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@functools.partial(jax.jit, static_argnames=("temperature", "top_k"))
def sample_tokens(logits, key, *, temperature: float, top_k: int):
    """Next tokens i32[B] from logits [B, V]: greedy when temperature == 0."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
