"""Small models for experiments (docs/architecture.md, "Layout and import direction");
:mod:`.checkpoints` builds Longformer and BigBird at their checkpoints' sizes for the
benchmarks (it imports transformers, so it is not imported here).
"""

from .encoder import Encoder, EncoderConfig

__all__ = ["Encoder", "EncoderConfig"]
