"""Errors of the HTTP layer itself, in the same `{"error", "error_type"}` shape as InferError.

TGI answers these in plain text (framework rejections) or not at all; pytgi answers every one of
them in JSON so that clients have a single error shape to parse.
"""

from __future__ import annotations

from pytgi_router.core.errors import InferError


class BadRequestError(InferError):
    """Malformed JSON or a body that is not UTF-8."""

    status_code = 400
    error_type = "invalid_request"
    metric_label = "validation"


class UnauthorizedError(InferError):
    status_code = 401
    error_type = "unauthorized"

    def __init__(self) -> None:
        super().__init__("Unauthorized: send `Authorization: Bearer <api key>`")


class NotFoundError(InferError):
    status_code = 404
    error_type = "not_found"


class MethodNotAllowedError(InferError):
    status_code = 405
    error_type = "method_not_allowed"


class PayloadTooLargeError(InferError):
    status_code = 413
    error_type = "payload_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body exceeds the payload limit of {limit} bytes")


class ToolError(InferError):
    status_code = 422
    error_type = "tool_error"
    metric_label = "validation"

    def __init__(self, reason: str) -> None:
        super().__init__(f"Tool error: {reason}")


class IncompleteGenerationStreamError(InferError):
    status_code = 500
    error_type = "incomplete_generation_stream"
    metric_label = "incomplete"

    def __init__(self) -> None:
        super().__init__("Incomplete generation stream")


class CompletionRequestError(InferError):
    """/v1/completions' own 422s, whose error_type TGI spells as a phrase."""

    status_code = 422
    metric_label = "validation"

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class ShuttingDownError(InferError):
    status_code = 503
    error_type = "unhealthy"
    metric_label = "unhealthy"

    def __init__(self) -> None:
        super().__init__("Server is shutting down")


class NotReadyError(InferError):
    """/health during the grace period after SIGTERM: the replica still serves what reaches it,
    but balancers polling /health must take it out now, before it stops admitting."""

    status_code = 503
    error_type = "unhealthy"
    metric_label = "unhealthy"

    def __init__(self, grace_s: float) -> None:
        super().__init__(
            f"Server is shutting down: not ready, still serving requests for {grace_s:g} s "
            "before it stops admitting them"
        )
