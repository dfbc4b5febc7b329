"""Activation extraction on the ranks: captured rows, host memory, the safetensors files."""
