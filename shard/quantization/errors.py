"""The error of a quantization pytgi refuses at start-up (a method, bits, layout or model family
it does not serve, a --quantize that contradicts the checkpoint, a shard split that would cut a
quantization group).

Its message is the whole story, one line a user can act on: the shard logs it without a
traceback and exits, and the launcher shows that line as the reason the shard did not start.
"""

from __future__ import annotations


class QuantizationError(ValueError):
    """A refused quantization; the message names what and, where there is one, the way out."""
