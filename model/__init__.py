"""jaxinfer model: the DeepSeek-V4-Flash family in Flax NNX (see DESIGN.md for the public API)."""

from .config import LayerSpec, ModelConfig
from .transformer import Transformer, abstract_model, init_random, parameter_count

__all__ = ["LayerSpec", "ModelConfig", "Transformer", "abstract_model", "init_random", "parameter_count"]
