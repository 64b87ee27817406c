"""How the TUI reaches a model: the Bridge interface (base), an engine in this process (local), an
OpenAI-compatible server (remote)."""
