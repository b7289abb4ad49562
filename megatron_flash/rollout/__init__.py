"""Rollout side, client of the engines: the prompt dataset, the scheduler (queue scheduling, prompt
replication, redundant prompts), the proxy that routes requests over engines, dynamic filters, and the
runtime that runs it all on rank 0.

Nothing here imports Megatron, the trainer, weight sync or agentic; submodules are imported lazily.
"""
