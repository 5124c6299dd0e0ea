"""Speculative decoding in `generate`: the drafters (draft model, EAGLE head, Medusa heads, n-gram matcher), their
`custom_generate` loops, and what those loops share (verification rules, the round cost model, the ragged batch)."""
