"""Serving engines: OpenAI-compatible clients, a vLLM server owned by a job, vLLM hidden states and acceptance."""
