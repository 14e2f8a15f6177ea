"""Errors as OpenAI returns them: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause is an APIError raised where it is found; the app's handlers
turn it, pydantic's validation errors and malformed JSON into that body, and anything else
into a 500 for that one request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.server.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return JSONResponse(
            ErrorResponse(error=self.info).model_dump(),
            status_code=self.status_code,
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def internal_error(exc: BaseException) -> APIError:
    return APIError(
        500,
        f"the server failed while processing this request: {type(exc).__name__}: {exc}",
        type="server_error",
        code="internal_error",
    )


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 for the first of pydantic's errors, naming the top-level field it concerns."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and _is_field(part)]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}")
    if not loc:
        return bad_request(f"the request body must be a JSON object: {first.get('msg')}")
    return bad_request(f"{'.'.join(loc)}: {first.get('msg')}", param=loc[0])


def _is_field(part: str | int) -> bool:
    """Pydantic adds the union member it tried ("str", "list[int]") to an error's location."""
    return isinstance(part, int) or (
        part.isidentifier() and part not in {"str", "int", "float", "bool", "list", "dict"}
    )


def param_named_in(message: str, fields: Sequence[str], fallback: str | None) -> str | None:
    """SamplingParams errors start with the field they concern ("top_p must be ...")."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in fields else fallback
