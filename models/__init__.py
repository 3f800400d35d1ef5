"""The architectures, built from megalite's tensor-parallel layers (shipped as megalite.models).

- one package per architecture (`gpt/`, `llama/`): its record, model, Hugging Face mapping and
  formulas; `megalite.architectures` lists the packages.
- `partition`: which layers each pipeline chunk holds; `flops`: the model FLOPs per token.
- `layers`: the shared parallel blocks (norms, rotary, attention, dropout); `causal_lm`: the
  pipeline chunk every model is; `factory.build_chunks`: the one way to build a model.
- `hugging_face`, `formulas`: what an architecture's mapping and formulas implement (and the
  shared blocks' own formulas).

This package imports nothing on its own: `megalite.config` reads the architectures' records
before torch is imported.
"""
