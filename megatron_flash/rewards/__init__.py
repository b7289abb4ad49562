"""Reward functions and synthetic verifiable tasks (never imports Megatron)."""
