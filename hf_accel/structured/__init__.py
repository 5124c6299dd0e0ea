"""Structured outputs: generated text constrained to a JSON schema, a regex, a choice or a grammar (xgrammar)."""
