"""jaxinfer sampling: token sampling and the jitted generation loop."""

from .generate import GenerateOutput, generate
from .sampler import sample

__all__ = ["GenerateOutput", "generate", "sample"]
