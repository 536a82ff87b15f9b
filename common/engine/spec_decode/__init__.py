"""Speculative decoding: drafting tokens cheaply and verifying them against the target model."""
