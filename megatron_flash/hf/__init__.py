"""Hugging Face checkpoints: the architecture spec read from config.json, the declarative Megatron ⇄ HF
name map per family, the TP shard layouts, and load / stage / export of a Megatron model's weights.

The trainer (loading and exporting) and weight sync (staging HF tensors for the engines) both use
this package; neither imports the other.
"""
