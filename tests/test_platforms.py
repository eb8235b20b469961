"""jaxserve.platforms: the CPU without probing accelerators only where none is attached."""

from __future__ import annotations

import jaxserve.platforms as platforms


def test_no_accelerator_means_the_cpu(monkeypatch) -> None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platforms.glob, "glob", lambda pattern: [])
    assert platforms.select_jax_platforms() == "cpu"


def test_an_accelerator_or_the_users_choice_is_left_to_jax(monkeypatch) -> None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platforms.glob, "glob",
                        lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    assert platforms.select_jax_platforms() is None
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setattr(platforms.glob, "glob", lambda pattern: [])
    assert platforms.select_jax_platforms() == "tpu"
