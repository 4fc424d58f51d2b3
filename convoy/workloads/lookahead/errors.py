"""What a user can get wrong with lookahead decoding."""

from __future__ import annotations

from convoy.errors import ConvoyError


class DecodingError(ConvoyError):
    """A decoding request or model cannot be served as asked (empty prompt, too long, no EOS, no KV cache)."""
