"""kimitui's screens: load, main, settings, help and chat history."""
