"""Hugging Face integration: Trainer subclass, arguments, model streaming, checkpoints."""
