"""Continuous batching over a paged KV block pool: `Engine`, `SamplingParams`, `RequestOutput`."""
