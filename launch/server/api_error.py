"""The OpenAI-shaped error of a request the server refuses (the client's mistake, or an overload), and
the runtime's refusals of a prompt turned into it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shardserve.runtime.input_processor import InvalidPromptError


class APIError(Exception):
    """An error the client caused (or an overload): becomes an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.error_type = error_type or {400: "invalid_request_error",
                                         401: "authentication_error",
                                         404: "not_found_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.status}}

    @property
    def outcome(self) -> str:
        """The request's outcome label in shardserve_requests_total."""
        if self.status < 500:
            return "rejected"
        return "unavailable" if self.error_type == "service_unavailable" else "error"


def shutting_down() -> APIError:
    """The 503 of a server that is draining (SIGTERM): for new requests, and those its drain ended."""
    return APIError(503, "the server is shutting down; send the request to another server",
                    error_type="service_unavailable")


@contextmanager
def as_api_error(prompt_param: str, structured_param: str | None = None) -> Iterator[None]:
    """The runtime's refusals as 400s; `prompt_param` names the prompt in this endpoint and
    `structured_param` the field that asked for a grammar."""
    try:
        yield
    except InvalidPromptError as e:
        names = {"prompt": prompt_param, "response_format": structured_param or "response_format"}
        raise APIError(400, str(e), names.get(e.field, e.field)) from None
    except ValueError as e:  # SamplingParams' own checks (InvalidSamplingParamsError names its field)
        raise APIError(400, str(e), getattr(e, "field", None)) from None
