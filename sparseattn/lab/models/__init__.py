"""Small models for experiments (docs/architecture.md, "Layout and import direction")."""

from .encoder import Encoder, EncoderConfig

__all__ = ["Encoder", "EncoderConfig"]
