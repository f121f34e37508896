"""Small models for experiments (DESIGN §4: ``models/``)."""

from .encoder import Encoder, EncoderConfig

__all__ = ["Encoder", "EncoderConfig"]
