"""Optional integrations with other Hugging Face trainers (imported on demand).

``hf_megatrain.integrations.trl``: :class:`MegaSFTTrainer`, :class:`MegaDPOTrainer` and
:class:`MegaGRPOTrainer` with their configs (needs ``pip install trl``).
"""
