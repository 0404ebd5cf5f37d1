"""Lark grammars of DeepSeek DSML tool calls (the text llguidance compiles, built here without
llguidance), as ``deepseek-recipe`` renders and parses them (V4.1; V4 spells the tags
``｜DSML｜tool_calls``, ``｜DSML｜invoke``, ``｜DSML｜parameter``)::

    free text<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

A string argument goes raw (``string="true"``), anything else as JSON following the tool's
schema (``string="false"``). ``app.engine.grammar`` compiles these.

With ``tool_choice: "auto"`` (start "text") the calls block sits behind a trigger, in the
special-token form of llguidance's tool-call grammars: free text runs unconstrained, save
that it never spells ``｜DSML｜`` as plain text (special tokens stay out of every lexeme),
until ``<`` then the DSML token; from there the block follows the grammar to its end. So no
DSML reaches ``content`` (no half tag, no tag the parser would skip) and every call's
arguments parse.
"""

from __future__ import annotations

import json
from typing import Any

DSML = "｜DSML｜"  # deepseek-recipe SpecialToken.Dsml.default_str()
# DSML tag words per architecture (ModelConfig.arch): calls block, one call, one argument.
DSML_TAGS = {
    "v41": {"calls": " calls", "invoke": " invoke", "parameter": " parameter"},
    "v4": {"calls": "tool_calls", "invoke": "invoke", "parameter": "parameter"},
}
# Compact JSON in the style deepseek-recipe renders tool arguments: {"a": 1, "b": [true]}.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """An output constraint that cannot be compiled (reject the request at admission)."""


def lit(s: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(s, ensure_ascii=False)


def free_text(forbidden: str) -> str:
    """Terminal expression: any text that does not spell ``forbidden`` as plain text (a parser
    reading decoded text would take it for the special token)."""
    return f"(ANY & ~(ANY {lit(forbidden)} ANY))"


class ToolGrammar:
    """Lark grammar for DSML tool calls whose arguments follow each tool's JSON schema.

    Parameters appear in schema order, required ones always, optional ones at most once, no
    others; a schema without "properties" (e.g. ``{"type": "object"}``) takes any names and
    values, a missing or empty one no parameters.
    """

    def __init__(self, tools: list[Any], arch: str, dsml_id: int):
        self.words = DSML_TAGS[arch]
        self.dsml = f"<[{dsml_id}]>"
        self.rules: list[str] = []
        self.invokes = [self._invoke(i, t) for i, t in enumerate(tools)]

    def _tag(self, word: str, rest: str = ">") -> str:
        """The DSML token, then the tag word and ``rest`` as plain text."""
        return f"{self.dsml} {lit(self.words[word] + rest)}"

    def lark(self, start: str, parallel: bool = True) -> str:
        """``start``: "text" (free text, then optionally a calls block: the trigger is ``<``
        then the DSML token), "block" (inside the block the prompt opened) or "open" (the
        answer opens the block itself). ``parallel``: False allows one call in the block."""
        opened = self._tag("calls", ">\n") + " calls"
        first = {
            "text": f"start: TEXT | TEXT_LT {opened}",
            "block": "start: calls",
            "open": f'start: "\\n\\n<" {opened}',
        }[start]
        return "\n".join(
            [
                first,
                f'calls: invoke{"+" if parallel else ""} "</" {self._tag("calls")}',
                "invoke: " + " | ".join(self.invokes),
                *self.rules,
                "ANY: /(?s:.*)/",
                f"TEXT: {free_text(DSML)}",
                'TEXT_LT: TEXT "<"',
                'RAW: TEXT "</"',
                'NAME: /[^"<>\\n]+/',
            ]
        )

    def _invoke(self, i: int, tool: Any) -> str:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GrammarError(f"tool {i}: expected a function tool with a name")
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise GrammarError(f"tool {fn['name']!r}: parameters must be a JSON schema object")
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        args = []
        for j, (name, schema) in enumerate(props.items()):
            self._param(f"p{i}_{j}", name, schema if isinstance(schema, dict) else {}, defs)
            args.append(f"p{i}_{j}" if name in required else f"p{i}_{j}?")
        if params and "properties" not in params and params.get("additionalProperties", True):
            self._param(f"p{i}_any", None, {}, defs)
            args.append(f"p{i}_any*")
        head = self._tag("invoke", f' name="{fn["name"]}">\n')
        body = " ".join(args)
        if not required.intersection(props):  # no arguments: V4.1 renders an empty line, V4 not
            body = f'("\\n" | {body})' if body else '"\\n"?'
        end = self._tag("invoke", ">\n")
        self.rules.append(f'i{i}: "<" {head} {body} "</" {end}')
        return f"i{i}"

    def _param(self, rule: str, name: str | None, schema: dict[str, Any], defs: dict) -> None:
        """One argument (``name`` None: any name): a string goes raw (``string="true"``, the
        text runs to ``</｜DSML｜ parameter>``), anything else as JSON (``string="false"``)."""
        key = "NAME" if name is None else lit(name)
        open_ = '"<" ' + self._tag("parameter", ' name="') + " " + key
        close = self._tag("parameter", ">\n")
        alts = []
        raw = _raw_string(schema)
        if raw is not None:
            self.rules.append(f"{rule.upper()}_RAW: {raw}")
            alts.append(f'{open_} "\\" string=\\"true\\">" {rule.upper()}_RAW {close}')
        if raw is None or _admits_non_string(schema):
            self.rules.append(f"{rule}_json: %json {json.dumps(_tool_schema({**schema, **defs}))}")
            alts.append(f'{open_} "\\" string=\\"false\\">" {rule}_json "</" {close}')
        self.rules.append(f"{rule}: " + " | ".join(alts))


def _tool_schema(schema: dict[str, Any]) -> dict[str, Any]:
    # client tool schemas are loose: unsupported keywords are ignored rather than rejected
    return {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}}


def _raw_string(schema: dict[str, Any]) -> str | None:
    """Terminal for a raw (``string="true"``) value followed by ``</``, or None when the value
    must go as JSON (not a string, or string rules a raw regex cannot express here)."""
    values = (
        schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    )
    if values is not None:
        strs = [v for v in values if isinstance(v, str)]
        return f'({" | ".join(lit(v) for v in strs)}) "</"' if strs else None
    types = schema.get("type")
    if types is None:
        composite = any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "not"))
        return None if composite else "RAW"
    if "string" not in ([types] if isinstance(types, str) else types):
        return None
    if "pattern" in schema or "format" in schema:
        return None
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is None and hi is None:
        return "RAW"
    span = f"{{{int(lo or 0)},{'' if hi is None else int(hi)}}}"
    return f'(/(?s:.){span}/ & {free_text(DSML)}) "</"'


def _admits_non_string(schema: dict[str, Any]) -> bool:
    if "enum" in schema or "const" in schema:
        vals = schema.get("enum", [schema.get("const")])
        return any(not isinstance(v, str) for v in vals)
    types = schema.get("type")
    if types is None:
        return True
    return any(t != "string" for t in ([types] if isinstance(types, str) else types))
