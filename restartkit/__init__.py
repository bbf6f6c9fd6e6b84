"""restartkit: bring LLM inference engines back fast after a restart, and prove which path it took."""
__version__ = "0.3.0"
