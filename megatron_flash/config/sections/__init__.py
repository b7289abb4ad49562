"""The config schema, one module per section (config/schema.py assembles them into RunConfig)."""
