"""EAGLE-3 and EAGLE-3.1 drafters over a Kimi K2.x target's tapped hidden states: Llama-style and MLA layouts."""
