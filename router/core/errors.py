"""The errors a request can end with, each mapped to TGI's HTTP status and `error_type`."""

from __future__ import annotations


class InferError(Exception):
    """Base: `str(err)` is the message clients see in `{"error": ..., "error_type": ...}`."""

    status_code: int = 500
    error_type: str = "generation"
    # The `err` label of tgi_request_failure.
    metric_label: str = "generation"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


class ValidationError(InferError):
    """A request that breaks a limit or a rule, or JSON of the wrong shape (a missing field, a
    wrong type): TGI answers all of them as the same 422."""

    status_code = 422
    error_type = "validation"
    metric_label = "validation"

    def __init__(self, reason: str) -> None:
        super().__init__(f"Input validation error: {reason}")


class OverloadedError(InferError):
    status_code = 429
    error_type = "overloaded"
    metric_label = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class GenerationError(InferError):
    status_code = 424
    error_type = "generation"
    metric_label = "generation"

    def __init__(self, reason: str) -> None:
        super().__init__(f"Request failed during generation: {reason}")


class IncompleteGenerationError(InferError):
    status_code = 500
    error_type = "incomplete_generation"
    metric_label = "incomplete"

    def __init__(self) -> None:
        super().__init__("Incomplete generation")


class UnhealthyError(InferError):
    status_code = 503
    error_type = "healthcheck"
    metric_label = "unhealthy"

    def __init__(self, message: str = "unhealthy") -> None:
        super().__init__(message)


class TemplateError(InferError):
    status_code = 422
    error_type = "template_error"
    metric_label = "template"

    def __init__(self, reason: str) -> None:
        super().__init__(f"Template error: {reason}")
