"""The reference engine's scheduler: which sequences join, run and leave the batch, step by step."""
