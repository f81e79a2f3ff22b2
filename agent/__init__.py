"""lakeshard: pool idle office laptops into one LLM."""

__version__ = "0.1.0"
