"""GPT and Llama, built from megalite's tensor-parallel layers (shipped as megalite.models)."""

from megalite.models.common import BuildContext, CausalLM
from megalite.models.gpt import GPT
from megalite.models.llama import Llama

ARCHITECTURES: dict[str, type[CausalLM]] = {"gpt": GPT, "llama": Llama}

__all__ = ["ARCHITECTURES", "GPT", "BuildContext", "CausalLM", "Llama"]
