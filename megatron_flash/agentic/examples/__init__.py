"""Example agents for `agentic.workflow` (written against the OpenAI API, as users write theirs)."""
