"""Shared test setup: strict rank promotion, one CPU device in this process.

Tests that need several devices run in a subprocess with XLA_FLAGS set there.
"""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def key():
    return jax.random.key(0)
