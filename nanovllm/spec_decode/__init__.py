"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the exact
verification of their drafts (see speculator.py)."""
