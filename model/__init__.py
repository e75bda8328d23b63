"""jaxinfer model: the DeepSeek-V4-Flash family in Flax NNX (see DESIGN.md for the public API).

    from model import ModelConfig, Transformer, init_random, load_checkpoint
"""

from .checkpoint import load_checkpoint
from .config import LayerSpec, ModelConfig
from .runtime import Runtime, make_runtime
from .sharded import init_random, shard_model
from .transformer import Transformer, abstract_model, parameter_count

__all__ = ["LayerSpec", "ModelConfig", "Runtime", "Transformer", "abstract_model", "init_random", "load_checkpoint",
           "make_runtime", "parameter_count", "shard_model"]
