"""CRIU snapshots of a whole initialized engine: driver, CUDA checkpoint API, image store."""
