"""Benchmarks: hf_megatrain vs DeepSpeed ZeRO-3 offload vs stock in-GPU training (issue 3)."""
