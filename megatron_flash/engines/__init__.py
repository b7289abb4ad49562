"""Everything about an engine process: the HTTP client for SGLang's native API (`client`), the launcher
that starts and supervises SGLang or local engine servers (`launcher`), the weight-update process group
helper (`process_group`), and the local engine server (`local_server` over `local_engine`: transformers
continuous batching behind the same HTTP contract).

Nothing here imports Megatron or the rollout package; submodules are imported lazily by their users.
"""
