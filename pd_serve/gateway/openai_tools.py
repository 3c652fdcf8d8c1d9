"""A chat request's `tools` and `tool_choice`, checked, and what they ask of generation.

tool_choice (OpenAI's; default auto when tools are given):
  none      the model may not call: plain text (the tools still reach the chat template).
  auto      the model decides; the server's --tool-call-parser reads calls out of its text
            (the first only when parallel_tool_calls is false).
  required  one or more calls: a grammar makes the output a JSON array of
            {"name": <a tool>, "parameters": <its arguments schema>} (one item when
            parallel_tool_calls is false), so every call's arguments parse.
  {"type": "function", "function": {"name": N}}  a call of N: the grammar is N's arguments schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pd_serve.engine.grammar import canonical_json, check_grammar, unenforced_keyword
from pd_serve.engine.sampling_params import Grammar

_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
_NO_PARAMETERS = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")  # where a schema's "#/$defs/X" references point


class ToolsError(ValueError):
    """A bad tools / tool_choice field: the message, and the body field it names (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """How the output is read for calls: mode auto (the server's parser), required (the JSON
    array the grammar forces) or named (the whole output is `name`'s arguments); parallel:
    parallel_tool_calls (false: the first call only)."""

    mode: str
    name: str | None = None
    parallel: bool = True


@dataclass
class ToolRequest:
    """tools: the tool objects for the chat template (None: none given); choice: None when no
    call can happen; grammar: the constraint of required and named choices."""

    tools: list[dict] | None
    choice: ToolChoice | None
    grammar: Grammar | None


def parse_tools(body: dict, parser: str | None) -> ToolRequest:
    """Check `tools`, `tool_choice` and `parallel_tool_calls`. parser: --tool-call-parser
    (None: auto is refused, nothing could read the calls)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise ToolsError(f"'tools' must be a list of tool objects, got {type(tools).__name__}", "tools")
    if not tools:
        if choice is not None and choice != "none":
            raise ToolsError("tool_choice requires 'tools'", "tool_choice")
        return ToolRequest(None, None, None)
    schemas = _tool_schemas(tools)
    choice = "auto" if choice is None else choice
    parallel = body.get("parallel_tool_calls")
    if choice == "none":
        return ToolRequest(tools, None, None)
    if choice == "auto":
        if parser is None:
            raise ToolsError('tool_choice "auto" needs the server started with --tool-call-parser; '
                           'use "required" or a named function, which need none', "tool_choice")
        return ToolRequest(tools, ToolChoice("auto", parallel=parallel is not False), None)
    if choice == "required":
        # xgrammar writes properties in the schema's order: name before parameters, so a
        # stream can name each call before its arguments arrive.
        for i, (name, schema) in enumerate(schemas.items()):
            if (ref := _local_ref(schema)) is not None:
                where = f"tools[{i}].function.parameters"
                raise ToolsError(f'{where}: with tool_choice "required" each tool\'s schema sits '
                                 f"inside one array, where the reference {ref!r} points elsewhere; "
                                 "refer only to the schema's $defs / definitions, or name the tool "
                                 "in tool_choice", where)
        schemas, defs = _hoisted_defs(schemas)
        items = {"anyOf": [{"type": "object", "properties": {"name": {"enum": [name]},
                                                             "parameters": schema},
                            "required": ["name", "parameters"], "additionalProperties": False}
                           for name, schema in schemas.items()]}
        array = {"type": "array", "items": items, "minItems": 1} | defs
        if parallel is False:
            array["maxItems"] = 1
        return ToolRequest(tools, ToolChoice("required", parallel=parallel is not False),
                           _checked(array, "tools"))
    name = _named_choice(choice)
    if name not in schemas:
        raise ToolsError(f"tool_choice names function {name!r}, which is not among the tools "
                       f"({', '.join(schemas)})", "tool_choice")
    return ToolRequest(tools, ToolChoice("named", name), _checked(schemas[name], "tools"))


def _tool_schemas(tools: list) -> dict[str, dict]:
    """Each tool's name -> its parameters schema, every tool checked (a schema that does not
    compile is a 400 even when no grammar uses it: the model is shown it)."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise ToolsError(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolsError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', "
                           f"got {name!r}", f"{where}.function.name")
        if name in schemas:
            raise ToolsError(f"{where}: two tools are named {name!r}", f"{where}.function.name")
        schema = function.get("parameters")
        if schema is None:
            schema = _NO_PARAMETERS
        if not isinstance(schema, dict):
            raise ToolsError(f"{where}.function.parameters must be a JSON schema object, got "
                           f"{type(schema).__name__}", f"{where}.function.parameters")
        _checked(schema, f"{where}.function.parameters")
        if problem := strict_schema_problem(function, schema, f"{where}.function"):
            raise ToolsError(*problem)
        schemas[name] = schema
    return schemas


def _local_ref(value) -> str | None:
    """A "$ref" inside `value` into its own document other than to its root definitions
    ("#", "#/properties/a"), which nesting the schema would break; None if there is none."""
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(
                tuple(f"#/{key}/" for key in _DEFS_KEYS)):
            return ref
        value = list(value.values())
    if isinstance(value, list):
        return next((ref for v in value if (ref := _local_ref(v)) is not None), None)
    return None


def _hoisted_defs(schemas: dict[str, dict]) -> tuple[dict[str, dict], dict]:
    """The schemas without their root definitions ("$defs", "definitions"), and those merged:
    nested in the required choice's array, a schema's "#/$defs/X" resolves at the array's root,
    where they go. Two tools defining one name differently are a 400 (vLLM's rule)."""
    stripped, merged = {}, {}
    for name, schema in schemas.items():
        stripped[name] = dict(schema)
        for key in _DEFS_KEYS:
            defs = schema.get(key)
            if not isinstance(defs, dict):
                continue
            del stripped[name][key]
            for def_name, definition in defs.items():
                if merged.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise ToolsError(f"two tools define {key}/{def_name} differently; with "
                                     f'tool_choice "required" they share one set of definitions',
                                     "tools")
    return stripped, merged


def strict_schema_problem(owner: dict | None, schema: dict, where: str,
                          schema_param: str = "parameters") -> tuple[str, str] | None:
    """(message, param) of a 400, or None. owner["strict"] (a tool's function, response_format's
    json_schema) must be a boolean if given; a schema the output must follow (strict true, or
    owner None: vLLM's guided_json) may use only what the grammar enforces, as OpenAI's strict
    mode refuses keywords it does not support."""
    strict = True if owner is None else owner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        return f"{where}.strict must be a boolean, got {type(strict).__name__}", f"{where}.strict"
    param = f"{where}.{schema_param}" if owner is not None else where
    if strict and (found := unenforced_keyword(schema)):
        hint = ', or leave out "strict": true' if owner is not None else ""
        return f"{param}: {found} is not enforced by the grammar engine; remove it{hint}", param
    return None


def _named_choice(choice) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolsError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                       f'"function": {{"name": ...}}}}, got {choice!r}'[:300], "tool_choice")
    return function["name"]


def _checked(schema: dict, param: str) -> Grammar:
    grammar = Grammar("json_schema", canonical_json(schema))
    try:
        check_grammar(grammar)
    except ValueError as e:
        raise ToolsError(f"{param}: {e}", param) from None
    return grammar
