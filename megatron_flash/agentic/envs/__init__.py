"""Built-in text environments (registered by name on import; see ``agentic.registry``).

All render observations in ``base.ALPHABET`` (the CPU test tokenizer's characters) by default.
"""
