"""Prompt sets, completions (token ids) and where completions come from."""
