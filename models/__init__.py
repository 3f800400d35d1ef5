"""GPT and Llama, built from megalite's tensor-parallel layers (shipped as megalite.models);
`build_chunks` is the one way the rest of megalite builds them."""

from megalite.models.common import BuildContext, CausalLM
from megalite.models.factory import ARCHITECTURES, build_chunks
from megalite.models.gpt import GPT
from megalite.models.llama import Llama

__all__ = ["ARCHITECTURES", "GPT", "BuildContext", "CausalLM", "Llama", "build_chunks"]
