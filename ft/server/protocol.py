"""The OpenAI request bodies the server accepts, and its error body.

Fields are typed strictly (a string is not a number, 1.5 is not an integer) and floats must be
finite, so a malformed request fails here with a message that names the field, before anything
reaches the engine. Unknown fields are ignored: clients send many we have no use for. Fields
beyond OpenAI's are vLLM's names for the same things (``top_k``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``return_token_ids``,
``add_special_tokens``).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_LOGPROBS = 20
MAX_N = 128
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class APIError(Exception):
    """An error answer: HTTP status and an OpenAI-style body naming the problem."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI's schema lets clients send ``null`` for "the default"; many do."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_tokens: int = Field(0, ge=0)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # either way: the detokenizer (transformers' decode) puts no space between special tokens, nor
    # does vLLM's for a fast tokenizer, whatever this says; typed, so that a wrong value is named
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # vLLM's extension, as min_p
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    return_token_ids: bool = False
    response_format: dict | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") != "text":
            raise ValueError(
                f"type {v.get('type')!r} is not supported, only 'text': JSON output needs constrained "
                "decoding, which this server does not do"
            )
        return v

    @field_validator("stream_options")
    @classmethod
    def _streams_only(cls, v: StreamOptions, info) -> StreamOptions:
        if not info.data.get("stream"):  # as OpenAI and vLLM: a client asking usage chunks of no stream
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v: dict | None) -> dict | None:
        for key in v or {}:
            # ASCII digits only ("²" is a digit to isdigit() but not to int()), and no more than an
            # Int64 holds (int() refuses numbers past 4300 digits)
            if not (key.isascii() and key.isdigit() and len(key) <= 19 and int(key) < 2**63):
                raise ValueError(f"logit_bias keys are token ids, got {key[:24]!r}")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> None:
        if v is not None:
            raise ValueError("suffix is not supported: this server does not fill in the middle")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of is not supported (use n)")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # roles and extra keys (name, tool_calls, ...) are the chat template's business
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # one text, its parts a line apart, as vLLM joins them
            out["content"] = "\n".join(part.text for part in self.content)
        calls = out.get("tool_calls")
        if self.role == "assistant" and isinstance(calls, list):
            out["tool_calls"] = [_with_object_arguments(call) for call in calls]
        return out


def _with_object_arguments(call):
    """An assistant's earlier call as tool-use templates take it (and vLLM passes it): OpenAI sends
    ``function.arguments`` as JSON text, a template writes ``arguments | tojson``, which would quote
    that text again. Arguments that are not a JSON object stay as the client wrote them."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    text = function["arguments"]
    try:
        args = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        return call
    return call | {"function": function | {"arguments": args}} if isinstance(args, dict) else call


class FunctionSpec(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema, for the template to show the model
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class _ChatTemplate(_Strict):
    """What a chat's prompt is made of: its messages through the template, with these."""

    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[Tool] | None = None
    # "auto" (the default with tools): the model may call them; "none": the template is not shown
    # them and the output is not parsed for calls
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: the first call is answered, later ones dropped

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template(cls, v: dict | None) -> dict | None:
        # a template is code the server would run: one of ``range(10**5)`` loops nested renders
        # for ever and fills the memory (vLLM refuses it too, unless --trust-request-chat-template)
        if v is not None and "chat_template" in v:
            raise ValueError("a request may not replace the model's chat template (chat_template)")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, v):
        if v in ("none", "auto"):
            return v
        if v == "required" or isinstance(v, dict):
            raise ValueError(
                "only 'auto' and 'none' are supported: 'required' and a named function need "
                "constrained decoding, which this server does not do"
            )
        raise ValueError("should be 'auto' or 'none'")

    @property
    def calls_tools(self) -> bool:
        """Whether the template is shown the tools and the output parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_kwargs(self) -> dict:
        """The chat template's arguments beyond the messages."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.calls_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return kwargs


class ChatCompletionRequest(_SamplingRequest, _ChatTemplate):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=0)
    add_special_tokens: bool = False


class TokenizeRequest(_ChatTemplate):  # POST /tokenize (vLLM's): a prompt, or a chat's as /v1/chat makes it
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template's)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):  # POST /detokenize
    model: str | None = None
    tokens: list[Int64]


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body; an APIError(400) naming the first bad field otherwise."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _bad_request(e.errors(include_url=False)) from None


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part[:1].isupper())


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _bad_request(errors: list[dict]) -> APIError:
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return APIError(400, "the request body must be a JSON object")
    loc = first["loc"]
    tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag is None:
        param = ".".join(str(p) for p in loc)
        message = f"{param}: {first['msg'].removeprefix('Value error, ')}"
    else:  # a union: say which forms are accepted rather than why the first one failed
        prefix = loc[:tag]
        forms = dict.fromkeys(
            e["loc"][tag] for e in errors if e["loc"][:tag] == prefix and len(e["loc"]) > tag
        )
        param = ".".join(str(p) for p in prefix)
        message = f"{param}: should be {' or '.join(forms)}"
    return APIError(400, message, param=param or None)
