"""The target: loading it (HF or GGUF, fla kernels for hybrid layers, device maps), its fingerprint, and its timed costs."""
