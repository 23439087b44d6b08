"""OpenAI tools: `tool_choice` as a grammar, and the constrained output back as tool calls.

As TGI does (vLLM instead parses a model's free text with a per-model parser): the model
writes `{"name": <a tool's name>, "arguments": <that tool's parameters>}` in compact JSON,
held to the grammar, so a call always parses and its arguments validate. `required`
allows any of the tools, a named function only that one, and `auto` any of them or the
pseudo-tool `no_tool`, whose `content` is answered as plain text. `none` constrains
nothing. Each choice makes at most one call."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from deployments import grammar
from deployments.openai_schema import ChatRequest, NamedToolChoice, bad, output_constraints

NO_TOOL = "no_tool"
_NO_TOOL_PARAMETERS = {"type": "object", "properties": {"content": {"type": "string"}},
                       "required": ["content"], "additionalProperties": False}
_CALL = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":', re.DOTALL)


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(req: ChatRequest) -> str | None:
    """The grammar `tools` and `tool_choice` ask for (None: free text)."""
    choice = req.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        choice = NamedToolChoice(function={"name": choice})  # TGI's: a function's bare name
    if not req.tools:
        if choice not in (None, "none"):
            raise bad("tool_choice needs tools")
        return None
    if output_constraints(req):
        raise bad("Grammar and tools are mutually exclusive")
    choice = choice or "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return None
    functions = {t.function.name: t.function for t in req.tools}
    if len(functions) < len(req.tools):
        raise bad("tools must have distinct function names")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in functions:
            raise bad(f"tool_choice names function {choice.function.name!r}, "
                       "which is not in tools")
        functions = {choice.function.name: functions[choice.function.name]}
    options = [_call_schema(f.name, f.parameters) for f in functions.values()]
    if choice == "auto":
        if NO_TOOL in functions:
            raise bad(f"the tool name {NO_TOOL!r} is reserved with tool_choice \"auto\"")
        options.append(_call_schema(NO_TOOL, _NO_TOOL_PARAMETERS))
    try:
        return grammar.json_schema(options[0] if len(options) == 1 else {"anyOf": options})
    except grammar.InvalidGrammar as exc:
        raise bad(f"Invalid tools: {exc}") from exc


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # the model's JSON text, as written


def parse(text: str) -> Call | None:
    """The call in a complete output (None: not one, e.g. cut short by max_tokens)."""
    match = _CALL.match(text)
    if match is None or not text.endswith("}"):
        return None
    arguments = text[match.end() : -1]
    try:
        json.loads(arguments)
    except ValueError:
        return None
    return Call(json.loads(match.group(1)), arguments)


def message(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished choice. A call cut short (max_tokens) whose name
    is complete is still a call, with the arguments written so far, as its stream sent it;
    a cut `no_tool` answer, or one cut inside the name, is the raw text."""
    call = parse(text)
    if call is None:
        match = _CALL.match(text)
        name = json.loads(match.group(1)) if match else NO_TOOL
        if name == NO_TOOL:
            return text, []
        call = Call(name, text[match.end():])
    elif call.name == NO_TOOL:
        return json.loads(call.arguments)["content"], []
    return None, [{"id": new_call_id(), "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}]


class CallStream:
    """One choice's streamed text as OpenAI deltas: the call's id and name once the name
    is complete, then the arguments as they come (the closing brace held back)."""

    def __init__(self) -> None:
        self.text = ""
        self.args_start: int | None = None
        self.sent = 0
        self.no_tool = False
        self.called = False

    def feed(self, piece: str, finished: bool) -> list[dict]:
        self.text += piece
        deltas: list[dict] = []
        if self.args_start is None:
            match = _CALL.match(self.text)
            if match is None:
                return [{"content": self.text}] if finished and self.text else []
            name = json.loads(match.group(1))
            self.args_start, self.no_tool = match.end(), name == NO_TOOL
            if not self.no_tool:
                self.called = True
                deltas.append({"tool_calls": [{"index": 0, "id": new_call_id(),
                                               "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
        if self.no_tool:  # its content is a JSON string: answered whole, at the end
            if finished:
                content, _ = message(self.text)
                deltas.append({"content": content})
            return deltas
        complete = finished and parse(self.text) is not None
        end = len(self.text) - 1 if complete or not finished else len(self.text)
        start = self.args_start + self.sent
        if end > start:
            deltas.append({"tool_calls": [{"index": 0,
                                           "function": {"arguments": self.text[start:end]}}]})
            self.sent += end - start
        return deltas

    def chunks(self, output, finish: str | None, logprobs: dict | None) -> list[tuple]:
        """(delta, finish_reason, logprobs) of each chunk for one engine output: the finish
        reason is "tool_calls" when the choice ends with a complete call."""
        deltas = self.feed(output.text, output.finished)
        if output.finished:
            if self.called and parse(self.text) is not None:
                finish = "tool_calls"
            deltas.append({})
        elif logprobs and not deltas:
            deltas.append({})
        chunks = [(delta, None, None) for delta in deltas]
        if chunks:
            chunks[-1] = (chunks[-1][0], finish, logprobs)
        return chunks
