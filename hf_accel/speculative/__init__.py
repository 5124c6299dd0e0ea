"""Speculative decoding: candidate generators and their custom_generate entry points (draft model, Medusa heads)."""
