"""The chat pane, its messages and the prompt input."""
