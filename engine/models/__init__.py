"""Model definitions and weight loading (HF checkpoints)."""
from cuttle.engine.models.loader import load_model, load_weights
from cuttle.engine.models.transformer import CausalLM

__all__ = ["CausalLM", "load_model", "load_weights"]
