"""Speculative decoding: draft proposers, the verification step, rejection sampling and the adaptive policy."""
