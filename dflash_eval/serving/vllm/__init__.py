"""vLLM: hidden states from a server (cache.source: vllm), its acceptance measured on a DFlash server, and the CPU work-arounds the server loads."""
