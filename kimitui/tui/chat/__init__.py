"""The chat feature's state: chats of the session, generation settings, what the model panel shows, energy per token."""
