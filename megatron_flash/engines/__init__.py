"""Everything about an engine process: the HTTP client for SGLang's native API (`client`), the launcher
that starts and supervises SGLang or CPU engine servers (`launcher`), the weight-update process group
helper (`process_group`), and the local engine server (`cpu_server` over `cpu_engine`: transformers
continuous batching behind the same HTTP contract).

Nothing here imports Megatron or the rollout package; submodules are imported lazily by their users.
"""
