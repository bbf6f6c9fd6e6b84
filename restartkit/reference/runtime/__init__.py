"""The reference engine's runtime: the engine that owns the model and its KV cache, sleep mode, tensor-parallel workers."""
