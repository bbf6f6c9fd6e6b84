"""The reference engine's model and checkpoint code: the Llama-style decoder, config.json, checkpoints, weights."""
