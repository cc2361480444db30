"""Tool calls (OpenAI's `tools` and `tool_choice`): the prompt that offers the tools, the grammar that holds the
output to a call where one is required, and the parser that reads the calls back.

How a model writes a call depends on its chat template:
- "hermes": templates that take `tools` and write calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  (Qwen2.5, Hermes, and others). The template offers the tools; with tool_choice auto the output is free and the
  calls are read out of it; required or a named function hold it to calls by a grammar.
- "llama3_json": Llama 3.1-3.3's templates, which take `tools` and ask for one call as a JSON object,
  `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or not); results come back as `ipython` turns.
- "mistral": Mistral's templates, which write calls after the control token `[TOOL_CALLS]`, as a JSON array of
  `{"name": ..., "arguments": {...}}` (or, in newer ones, `name[ARGS]{...}` per call); call ids are 9 letters or
  digits. Its reply keeps control tokens' text (skip_special_tokens false, as vLLM), so the marker is read.
- "generic": any other template (e.g. SmolLM2's), as llama.cpp's generic format: a system message offers the
  tools and asks for JSON, `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "..."}`, which a
  JSON schema enforces; earlier calls and results go back to the model in the same JSON.
Where a call is required (tool_choice required or a named function) a grammar holds the output to it: the
template's own format, or for mistral (as vLLM) the JSON array alone. tool_choice none offers no tools and reads
no calls. Plain Python: the servers use it without JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from typing import Any, Sequence

from jaxserve.sampling_params import excerpt

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function names
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's marker before a call
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"  # Mistral's markers before the calls, and (newer) the arguments
LLAMA3_MARK = '"parameters": dictionary of argument name'  # Llama 3.1's own words asking for its call format
GENERIC_PROMPT = (
    'You can call these tools. Respond in JSON: either {"tool_calls": [{"name": ..., "arguments": '
    '{...}}]} to call tools, or {"response": "..."} to answer the user.\nTools:\n'
)


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_tools(tools: Sequence[Any]) -> list[Tool]:
    """OpenAI's tools list, checked: ValueError names what is wrong."""
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        if not NAME.match(f["name"]):
            raise ValueError(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {excerpt(f['name'])}"
            )
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            json.dumps(params)
        except RecursionError:
            raise ValueError(f"tools[{i}].function.parameters is nested too deeply") from None
        description = f.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        out.append(Tool(f["name"], description, params))
    if len({t.name for t in out}) != len(out):
        raise ValueError("tools name a function twice")
    return out


def parse_choice(tool_choice: Any, tools: list[Tool]) -> str | Tool:
    """ "none", "auto", "required" or the named Tool (OpenAI's default: auto with tools, none without)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ValueError('tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}')
    for t in tools:
        if t.name == name:
            return t
    raise ValueError(f"tool_choice names {excerpt(name)}, which is not among the tools")


def template_format(template: str | None) -> str:
    """How the model's chat template writes tool calls: "hermes", "llama3_json", "mistral" or "generic"."""
    if template and "tools" in template:
        if MISTRAL_CALLS in template:
            return "mistral"
        if HERMES_OPEN in template:
            return "hermes"
        if PYTHON_TAG in template or LLAMA3_MARK in template:
            return "llama3_json"
    return "generic"


def _embedded(t: Tool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tool's parameters to embed in a larger schema, and its definitions for that schema's root: a
    `$ref` to `#/$defs/X` (or `#/definitions/X`, as Pydantic writes them) becomes `#/$defs/<tool>.X`."""
    params = dict(t.parameters)
    defs = {**(params.pop("definitions", None) or {}), **(params.pop("$defs", None) or {})}

    def moved(x: Any) -> Any:
        if isinstance(x, list):
            return [moved(v) for v in x]
        if not isinstance(x, dict):
            return x
        out = {k: moved(v) for k, v in x.items()}
        ref = out.get("$ref")
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(ref, str) and ref.startswith(prefix):
                out["$ref"] = f"#/$defs/{t.name}.{ref[len(prefix) :]}"
        return out

    return moved(params), {f"{t.name}.{k}": moved(v) for k, v in defs.items()}


def _rooted(schema: dict[str, Any], tools: list[Tool]) -> dict[str, Any]:
    """A schema embedding the tools' parameters, with their definitions at its root."""
    defs = {k: v for t in tools for k, v in _embedded(t)[1].items()}
    return {**schema, "$defs": defs} if defs else schema


def _call_schema(t: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": _embedded(t)[0]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _calls_schema(tools: list[Tool], exactly_one: bool) -> dict[str, Any]:
    item = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    return {"type": "array", "items": item, "minItems": 1, **({"maxItems": 1} if exactly_one else {})}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools as the engine sees them: the messages and tools the template renders, the
    output's grammar (StructuredOutput's fields, or None), and how to read calls out of the output (None: no
    calls are read); forced: the output must be calls (tool_choice required or a named function); control_text:
    the reply must keep control tokens' text (its calls open with one)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    structured_output: dict[str, Any] | None
    format: str | None
    forced: bool = False
    control_text: bool = False


def plan(
    messages: list[dict[str, Any]], tools: list[Tool], choice: str | Tool, template: str | None, parallel: bool = True
) -> ToolPlan:
    """The prompt and grammar of a chat request with tools (messages: role, content, and OpenAI's tool_calls and
    tool_call_id where they have them). parallel: several calls in one reply may be made (else at most one)."""
    fmt = template_format(template)
    one = isinstance(choice, Tool) or not parallel
    if choice == "none":
        return ToolPlan(_plain_history(messages), None, None, None)
    offered = tools if isinstance(choice, str) else [choice]
    if fmt == "hermes":
        grammar = None
        if choice != "auto":  # the template's own format, each call's JSON held to its tool's schema
            call = json.dumps(_rooted(_calls_schema(offered, False)["items"], offered))
            repeat = "" if one else "+"
            grammar = {
                "grammar": f'start: ("{_lark(HERMES_OPEN)}\\n" call "\\n{_lark(HERMES_CLOSE)}"){repeat}\n'
                f"call: %json {call}"
            }
        return ToolPlan(_template_history(messages), [_openai_tool(t) for t in tools], grammar, fmt, choice != "auto")
    if fmt == "mistral":
        grammar = None if choice == "auto" else {"json": _rooted(_calls_schema(offered, one), offered)}
        return ToolPlan(
            _mistral_history(messages),
            [_openai_tool(t) for t in tools],
            grammar,
            fmt,
            choice != "auto",
            control_text=True,
        )
    if fmt == "llama3_json":  # one call a reply (its templates refuse more)
        grammar = None
        if choice != "auto":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "parameters": _embedded(t)[0]},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in offered
            ]
            grammar = {"json": _rooted(items[0] if len(items) == 1 else {"anyOf": items}, offered)}
        return ToolPlan(_template_history(messages), [_openai_tool(t) for t in tools], grammar, fmt, choice != "auto")
    calls = {
        "type": "object",
        "properties": {"tool_calls": _calls_schema(offered, one)},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    answer = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    schema = {"anyOf": [calls, answer]} if choice == "auto" else calls
    schema = _rooted(schema, offered)
    listing = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in tools
    )
    history = _generic_history(messages)
    system = GENERIC_PROMPT + listing
    if history and history[0]["role"] == "system":
        history[0] = {"role": "system", "content": history[0]["content"] + "\n\n" + system}
    else:
        history.insert(0, {"role": "system", "content": system})
    return ToolPlan(history, None, {"json": schema}, fmt, choice != "auto")


def _lark(text: str) -> str:
    return json.dumps(text)[1:-1]


def _openai_tool(t: Tool) -> dict[str, Any]:
    return {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as a template reads them: a JSON object (OpenAI sends them as JSON text)."""
    args = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _template_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates that know tools take them (as transformers passes them)."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {"type": "function", "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _mistral_id(raw: Any) -> str:
    """A call id as Mistral's templates require (9 ASCII letters or digits): one that is not becomes a hash of
    it, the same for the call and for its result."""
    raw = "" if raw is None else str(raw)
    if len(raw) == 9 and raw.isascii() and raw.isalnum():
        return raw
    return hashlib.sha256(raw.encode()).hexdigest()[:9]


def _mistral_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As _template_history, with each call's id and each result's tool_call_id as Mistral's templates take them."""
    out = _template_history(messages)
    for m, given in zip(out, messages):
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "id": _mistral_id(g.get("id"))} for c, g in zip(m["tool_calls"], given["tool_calls"])
            ]
        if m["role"] == "tool":
            m["tool_call_id"] = _mistral_id(m.get("tool_call_id"))
    return out


def _mistral_calls(body: str) -> list[ToolCall]:
    """The calls after [TOOL_CALLS]: a JSON array of {"name", "arguments"}, or name[ARGS]{...} per call (each
    after its own marker); none if it is neither."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        doc = [doc]
    if isinstance(doc, list):
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in doc):
            return []
        return [_new_call(c["name"], c.get("arguments", c.get("parameters", {}))) for c in doc]
    calls = []
    for piece in body.split(MISTRAL_CALLS):
        name, sep, args = piece.partition(MISTRAL_ARGS)
        if not sep or not NAME.match(name.strip()):
            return []
        try:
            calls.append(_new_call(name.strip(), json.loads(args)))
        except (ValueError, RecursionError):
            return []
    return calls


def _generic_history(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages for a template that knows no tools: calls and results as the JSON the model answers in."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls})})
        elif m["role"] == "assistant":
            out.append({"role": "assistant", "content": json.dumps({"response": m.get("content") or ""})})
        elif m["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": json.dumps(
                        {"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": m.get("content") or ""}}
                    ),
                }
            )
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


def _plain_history(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages without tools: a call as the text of its JSON, a result as a user's message."""

    def text(m: dict[str, Any]) -> str:
        calls = [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in m.get("tool_calls") or ()]
        return m.get("content") or (json.dumps(calls) if calls else "")

    return [{"role": "user" if m["role"] == "tool" else m["role"], "content": text(m)} for m in messages]


def _new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, text)


@dataclasses.dataclass
class _Partial:
    """A call as far as the output has written it: its name once whole, where its arguments' JSON starts in the
    scanned text and where it ends (None: still open)."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


_ARGUMENTS = ("arguments", "parameters")


def _scan_calls(text: str, root: str) -> list[_Partial]:
    """The calls in a JSON document written so far, by its `root`: "call" (the document is one call, {"name":
    ..., "arguments": ...}; llama3 says "parameters"), "array" (an array of calls: mistral) or "document" (an
    object whose "tool_calls" array holds them: the generic format). A stack of the open containers, each with
    its role and the key its next value belongs to."""
    calls: list[_Partial] = []
    stack: list[list] = []  # [kind "{" or "[", role, key, expecting a key]
    i, n = 0, len(text)

    def begins(at: int, opening: str | None) -> str | None:
        """A value starts at `at` in the innermost container: what it is for (the role of a container it opens)."""
        if not stack:
            if root == "array":
                return "calls" if opening == "[" else None
            if opening == "{":
                if root == "document":
                    return "document"
                calls.append(_Partial())
                return "call"
            return None
        _, role, key, _ = stack[-1]
        if role == "document" and key == "tool_calls" and opening == "[":
            return "calls"
        if role == "calls" and opening == "{":
            calls.append(_Partial())
            return "call"
        if role == "call" and key in _ARGUMENTS and calls[-1].args_start is None:
            calls[-1].args_start = at
            return "arguments"
        return None

    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                return calls  # the string is still being written
            top = stack[-1] if stack else None
            if top is not None and top[0] == "{" and top[3]:  # a key
                try:
                    top[2], top[3] = json.loads(text[i : j + 1]), False
                except ValueError:
                    return calls
            else:
                role = begins(i, None)
                if top is not None and top[1] == "call" and top[2] == "name" and calls:
                    try:
                        calls[-1].name = json.loads(text[i : j + 1])
                    except ValueError:
                        return calls
                if role == "arguments":
                    calls[-1].args_end = j + 1
            i = j + 1
            continue
        if c in "{[":
            role = begins(i, c)
            stack.append([c, role, None, c == "{"])
        elif c in "}]":
            if not stack:
                return calls
            kind, role, _, _ = stack.pop()
            if role == "arguments":
                calls[-1].args_end = i + 1
            if not stack:
                return calls  # the document is whole
        elif c == ",":
            if stack and stack[-1][0] == "{":
                stack[-1][3] = True
        elif c not in " \t\r\n:" and stack and not (stack[-1][0] == "{" and stack[-1][3]):
            j = i  # a number, true, false or null
            while j < n and text[j] not in ",}] \t\r\n":
                j += 1
            if begins(i, None) == "arguments" and j < n:
                calls[-1].args_end = j
            i = j
            continue
        i += 1
    return calls


class Reader:
    """Reads one choice's output as it streams: `feed` returns the content that is surely not part of a call
    (held back while it may be), `deltas` the calls' streamed pieces (OpenAI's: a call's id and name once its
    name is whole, then its arguments' JSON text as it grows), `finish` the rest of the content and the calls."""

    def __init__(self, fmt: str | None, forced: bool = False):
        """forced: the output must be calls; one cut short is no content either."""
        self.format, self.forced = fmt, forced
        self._text = ""
        self._sent = 0  # content characters given out
        self._streamed: list[list] = []  # per call streamed: [id, arguments' characters given out]

    def feed(self, text: str) -> str:
        if self.format is None:  # no calls: all of it is content, nothing kept
            return text
        self._text += text
        if self.format == "generic":  # the whole output is one JSON document, read at the end
            return ""
        if self.format == "llama3_json":  # a reply that may open a call is held back whole; any other streams
            head = self._text.lstrip()
            if self._sent == 0 and (head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)):
                return ""
            out, self._sent = self._text[self._sent :], len(self._text)
            return out
        if self.format == "mistral" and self.forced:  # the reply is the calls' array alone
            return ""
        marker = MISTRAL_CALLS if self.format == "mistral" else HERMES_OPEN
        at = self._text.find(marker)
        end = len(self._text) if at < 0 else at
        if at < 0:  # hold back a tail that may open a call
            for k in range(min(len(marker) - 1, len(self._text)), 0, -1):
                if marker.startswith(self._text[-k:]):
                    end -= k
                    break
        out, self._sent = self._text[self._sent : max(end, self._sent)], max(end, self._sent)
        return out

    def _partials(self) -> list[tuple[_Partial, str]]:
        """The calls written so far, each with the text its offsets index."""
        if self.format == "generic":
            return [(c, self._text) for c in _scan_calls(self._text, "document")]
        if self.format == "llama3_json":
            if self._sent:
                return []
            head = self._text.lstrip().removeprefix(PYTHON_TAG)
            return [(c, head) for c in _scan_calls(head, "call")[:1]]
        if self.format == "mistral":
            at = self._text.find(MISTRAL_CALLS)
            if at < 0 and not self.forced:
                return []
            body = self._text[at + len(MISTRAL_CALLS) :] if at >= 0 else self._text
            return [(c, body) for c in _scan_calls(body, "array")]
        if self.format != "hermes":
            return []
        out, at = [], self._text.find(HERMES_OPEN)
        while at >= 0:
            start = at + len(HERMES_OPEN)
            end = self._text.find(HERMES_CLOSE, start)
            block = self._text[start:] if end < 0 else self._text[start:end]
            out += [(c, block) for c in _scan_calls(block, "call")[:1]]
            at = -1 if end < 0 else self._text.find(HERMES_OPEN, end)
        return out

    def deltas(self) -> list[dict[str, Any]]:
        """The calls' pieces written since the last call (streaming): a new call's index, id, type and name
        (arguments ""), then arguments' text as fragments that join to its JSON."""
        out = []
        for k, (call, text) in enumerate(self._partials()):
            if k == len(self._streamed):
                if call.name is None:
                    break
                self._streamed.append([f"call_{uuid.uuid4().hex[:24]}", 0])
                out.append(
                    {
                        "index": k,
                        "id": self._streamed[k][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            if call.args_start is not None:
                args = text[call.args_start : len(text) if call.args_end is None else call.args_end]
                if len(args) > self._streamed[k][1]:
                    out.append({"index": k, "function": {"arguments": args[self._streamed[k][1] :]}})
                    self._streamed[k][1] = len(args)
        return out

    def finish_deltas(self) -> tuple[str, list[dict[str, Any]], bool]:
        """Streaming's end: the content not given out, the calls' last pieces (a call none of whose pieces went
        out goes whole), and whether the reply is calls."""
        rest, calls = self.finish()
        out = self.deltas()
        out += [c.openai(index=k) for k, c in enumerate(calls) if k >= len(self._streamed)]
        return rest, out, bool(calls)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not given out yet, and the calls (a call that does not parse stays content, unless calls
        were forced: then it is the unfinished call, never the reply's text)."""
        rest, calls = self._finish()
        return ("", calls) if self.forced else (rest, calls)

    def _finish(self) -> tuple[str, list[ToolCall]]:
        if self.format is None:
            return "", []
        if self.format == "llama3_json":
            rest = self._text[self._sent :]
            if self._sent:
                return rest, []
            try:
                call = json.loads(rest.strip().removeprefix(PYTHON_TAG))
            except (ValueError, RecursionError):
                return rest, []
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                return "", [_new_call(call["name"], call.get("parameters", call.get("arguments", {})))]
            return rest, []
        if self.format == "mistral":
            rest = self._text[self._sent :]
            at = rest.find(MISTRAL_CALLS)
            if at < 0 and not self.forced:
                return rest, []
            content, body = (rest[:at], rest[at + len(MISTRAL_CALLS) :]) if at >= 0 else ("", rest)
            calls = _mistral_calls(body.strip())
            return (content.strip(), calls) if calls else (rest, [])
        if self.format == "generic":
            try:
                doc = json.loads(self._text)
            except (ValueError, RecursionError):
                return self._text, []
            if isinstance(doc, dict) and isinstance(doc.get("tool_calls"), list):
                return "", [
                    _new_call(c["name"], c.get("arguments", {}))
                    for c in doc["tool_calls"]
                    if isinstance(c, dict) and isinstance(c.get("name"), str)
                ]
            return (
                doc["response"] if isinstance(doc, dict) and isinstance(doc.get("response"), str) else self._text
            ), []
        rest, calls, content = self._text[self._sent :], [], []
        pattern = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)
        last = 0
        for m in pattern.finditer(rest):
            content.append(rest[last : m.start()])
            last = m.end()
            try:
                call = json.loads(m.group(1))
                calls.append(_new_call(call["name"], call.get("arguments", call.get("parameters", {}))))
            except (ValueError, KeyError, TypeError, RecursionError):
                content.append(m.group(0))
        content.append(rest[last:])
        return "".join(content).strip() if calls else "".join(content), calls
