"""Speculative decoding: the drafters (a cheap guess of the next k tokens per sequence) and the rule that verifies them against the target in one forward."""
