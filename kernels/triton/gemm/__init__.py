"""Triton GEMMs over quantised weights, dequantised in the tile loop: FP8 blocks, INT4 groups, MXFP4."""
