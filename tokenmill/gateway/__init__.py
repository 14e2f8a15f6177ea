"""In front of the engines: several models in one server, routing a request across them, and a
semantic response cache. Knows engines and prompts, never HTTP (server/ sits above it)."""
