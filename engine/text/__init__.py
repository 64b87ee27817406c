"""Text in and out: tokenizers, the K2 chat format, K3's XTML, reply parsing."""
