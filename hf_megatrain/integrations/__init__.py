"""Optional integrations with other Hugging Face trainers (imported on demand).

``hf_megatrain.integrations.trl``: :class:`MegaSFTTrainer` and :class:`MegaSFTConfig` (needs
``pip install trl``).
"""
