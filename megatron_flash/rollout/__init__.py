"""Rollout side: engine client (SGLang native HTTP contract), engine launchers, the CPU engine server
(`cpu_server` over `cpu_engine`), proxy, and scheduling.

Nothing here imports Megatron; submodules are imported lazily by their users (no heavy imports here).
"""
