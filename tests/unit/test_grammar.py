"""Structured output: random samplers driven through grammar masks always produce valid
output (JSON schemas, regexes, Lark, DeepSeek DSML tool calls, think-first), special tokens
never leak into constrained text, padding ids stay masked, bad constraints fail at compile."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

pytest.importorskip("llguidance")
dr = pytest.importorskip("deepseek_recipe")
jsonschema = pytest.importorskip("jsonschema")

from app.engine.grammar import (  # noqa: E402
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from app.engine.request import OutputConstraint, RequestError  # noqa: E402
from app.model.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer  # noqa: E402

VOCAB = 520  # > the tokenizer's 512: ids 512..519 are padding rows of the embedding
EOS, THINK_END, DSML_ID = 1, 7, 8
SPECIAL_IDS = set(range(len(SPECIAL_TOKENS)))
MODELS = {"v41": "DeepSeek-V4.1-Flash", "v4": "DeepSeek-V4-Pro"}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def compilers(tok):
    return {arch: GrammarCompiler(tok, VOCAB, EOS, arch=arch) for arch in MODELS}


@pytest.fixture(scope="module")
def compiler(compilers):
    return compilers["v41"]


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, bitmask[row : row + 1])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def generate(compiler: GrammarCompiler, constraint: OutputConstraint, seed: int,
             forced: tuple[int, ...] = (), specials: frozenset[int] = frozenset(),
             bias: dict[int, float] | None = None, max_tokens: int = 400) -> list[int]:  # fmt: skip
    """Sample random logits (plus ``bias``) through the mask until EOS; return the tokens
    before EOS. Every step checks the mask: no padding id, no special token except EOS and
    ``specials`` (the ones the grammar names); ``forced`` tokens come first (must be allowed).
    """
    m = compiler.matcher(compiler.compile(constraint))
    bitmask = allocate_bitmask(1, VOCAB)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for step in range(max_tokens):
        m.fill_bitmask(bitmask[0])
        allowed = allowed_ids(bitmask)
        assert allowed and max(allowed) < 512, "padding ids must stay masked"
        assert not (allowed & SPECIAL_IDS) - {EOS} - specials, "special token leaked"
        if step < len(forced):
            token = forced[step]
            assert token in allowed
        else:
            logits = torch.randn(1, VOCAB, generator=gen)
            for t, b in (bias or {}).items():
                logits[0, t] += b
            apply_bitmask(logits, bitmask)
            token = int(torch.multinomial(torch.softmax(logits[0], 0), 1, generator=gen))
        assert m.accept(token), m.error
        if token == EOS:
            assert m.is_terminated()
            return out
        out.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {out}")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Bounded schemas: short strings, few items, closed objects, so a random walk ends."""
    kinds = ["string", "integer", "number", "boolean", "enum"]
    kind = rng.choice(kinds + (["array", "object"] if depth < 2 else []))
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "integer":
        return {"type": "integer", "minimum": rng.randint(-100, 0), "maximum": rng.randint(1, 999)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 2.5, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, None, True, "a b"], 3)}
    if kind == "array":
        lo = rng.randint(0, 1)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "tags", "ok", "score", "meta", "x_1"], rng.randint(1, 4))
    required = [n for n in names if rng.random() < 0.7]
    schema = {
        "type": "object",
        "properties": {n: random_schema(rng, depth) for n in names},
        "required": required,
        "additionalProperties": False,
    }
    if rng.random() < 0.3:
        schema["maxProperties"] = len(required) + 1
    return schema


@pytest.mark.parametrize("seed", range(24))
def test_random_json_schema_output_validates(compiler, tok, seed):
    schema = random_object(random.Random(seed))
    out = generate(compiler, OutputConstraint("json", json.dumps(schema)), seed)
    jsonschema.validate(json.loads(tok.decode(out)), schema)


@pytest.mark.parametrize("seed", range(3))
def test_any_json_value(compiler, tok, seed):
    out = generate(compiler, OutputConstraint("json", ""), seed)
    json.loads(tok.decode(out))


@pytest.mark.parametrize(
    "pattern", [r"\d{3}-[a-z]{2,4}", r"(yes|no)( [A-Z]{1,3})?", r"[^\n]{1,5}\.json"]
)
def test_regex_output_fullmatches(compiler, tok, pattern):
    for seed in range(3):
        text = tok.decode(generate(compiler, OutputConstraint("regex", pattern), seed))
        assert re.fullmatch(pattern, text), (pattern, text)


def test_lark_grammar_output(compiler, tok):
    lark = 'start: item ("," item){0,3}\nitem: NUM | WORD\nNUM: /[0-9]{1,3}/\nWORD: /[a-z]{1,5}/'
    for seed in range(4):
        text = tok.decode(generate(compiler, OutputConstraint("grammar", lark), seed))
        assert re.fullmatch(r"([0-9]{1,3}|[a-z]{1,5})(,([0-9]{1,3}|[a-z]{1,5})){0,3}", text)


def test_think_first_then_json(compiler, tok):
    schema = random_object(random.Random(99))
    constraint = OutputConstraint("json", json.dumps(schema), think_first=True)
    free = tuple(tok.encode("Let me think <b> about it\n").ids)
    for seed in range(4):
        out = generate(compiler, constraint, seed, forced=(*free, THINK_END),
                       specials=frozenset({THINK_END}))  # fmt: skip
        k = out.index(THINK_END)
        assert out[:k] == list(free) and THINK_END not in out[k + 1 :]
        jsonschema.validate(json.loads(tok.decode(out[k + 1 :])), schema)


def test_think_first_masks_before_think_end(compiler, tok):
    m = compiler.matcher(compiler.compile(OutputConstraint("regex", "ok", think_first=True)))
    bitmask = allocate_bitmask(1, VOCAB)
    for t in tok.encode("reasoning ").ids:
        m.fill_bitmask(bitmask[0])
        assert (allowed_ids(bitmask) & SPECIAL_IDS) == {THINK_END}  # no EOS while reasoning
        assert m.accept(t)
    for t in tok.encode("</think").ids:  # the plain-text spelling must not end reasoning
        assert m.accept(t)
    m.fill_bitmask(bitmask[0])
    assert tok.token_to_id(">") not in allowed_ids(bitmask)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    }}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "number", "minimum": -100, "maximum": 100},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            "opts": {"type": "object", "properties": {"fast": {"type": "boolean"}},
                     "required": ["fast"], "additionalProperties": False},
        },
        "required": ["a", "b"],
    }}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object",
                                                                    "properties": {}}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def chat_request(arch: str, tool_choice: str) -> dict:
    return {
        "model": MODELS[arch],
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "thinking": {"type": "disabled"},
    }


def parse_tool_response(tok, arch: str, tool_choice: str, tokens: list[int]) -> dict:
    """Run tokens through deepseek-recipe's stream parser; return the Chat Completions message."""
    body = chat_request(arch, tool_choice)
    request = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    gen = dr.ChatCompletionRequest.chunk_generator(request, "id", MODELS[arch])
    sp = dr.StreamProcessor(gen, request.parsing_options, dr.Tokenizer.from_str(tok.to_str()))
    resp = dr.ChatCompletionResponse("id", MODELS[arch], 0, 1, 0)
    chunks = [dr.InferenceChunk.ready(), dr.InferenceChunk.tokens(tokens),
              dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)]  # fmt: skip
    for chunk in chunks:
        for c in sp.push(chunk):
            resp.accumulate(c)
    for c in sp.finish():
        resp.accumulate(c)
    return json.loads(resp.to_json())["choices"][0]


def recipe_constraint(arch: str, tool_choice: str) -> OutputConstraint:
    body = chat_request(arch, tool_choice)
    oc = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions()).inference_options
    return OutputConstraint(oc.output_constraint.kind, oc.output_constraint.schema)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_tool_call_required_parses_as_valid_dsml_calls(compilers, tok, arch):
    constraint = recipe_constraint(arch, "required")
    assert constraint.kind == "tool_call_required"
    for seed in range(4):
        # favour "/" so that "</｜DSML｜ calls>" eventually closes the list of calls
        out = generate(compilers[arch], constraint, seed, specials=frozenset({DSML_ID}),
                       bias={tok.token_to_id("/"): 3.0})  # fmt: skip
        choice = parse_tool_response(tok, arch, "required", out)
        calls = choice["message"]["tool_calls"]
        assert (
            choice["finish_reason"] == "tool_calls" and calls and not choice["message"]["content"]
        )
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])  # fmt: skip


def rendered_answer(arch: str, content: str) -> str:
    """The assistant turn deepseek-recipe renders for these calls (thinking off)."""
    calls = [
        dr.ToolCall("c1", "get_weather", json.dumps({"city": 'Pa</b>"\n', "unit": "celsius"})),
        dr.ToolCall(
            "c2", "add", json.dumps({"a": -1.5, "b": 3, "tags": ["x"], "opts": {"fast": True}})
        ),  # fmt: skip
        dr.ToolCall("c3", "ping", "{}"),
    ]
    conv = dr.Conversation([dr.UserMessage("hi"), dr.AssistantMessage(content, tool_calls=calls)],
                           thinking_mode=False)  # fmt: skip
    enc = dr.DeepseekV41Encoding() if arch == "v41" else dr.DeepseekV4Encoding()
    prompt = enc.render_conversation(conv).prompt
    return prompt.split("<｜Assistant｜></think>")[1].split(SPECIAL_TOKENS[EOS])[0]


def feed(compiler: GrammarCompiler, constraint: OutputConstraint, tokens: list[int]) -> bool:
    m = compiler.matcher(compiler.compile(constraint))
    return all(m.accept(t) for t in tokens) and m.accept(EOS) and m.is_terminated()


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_tool_grammars_accept_recipe_rendering(compilers, tok, arch):
    c, spec = compilers[arch], json.dumps(TOOLS)
    answer = rendered_answer(arch, "Let me check <b>.")
    opener = answer[answer.index("\n\n<") : answer.index(">\n<") + 2]  # "\n\n<｜DSML｜ calls>\n"
    assert feed(c, OutputConstraint("tool_call", spec), tok.encode(answer).ids)
    assert feed(c, OutputConstraint("tool_call", spec), tok.encode("Just text <i>").ids)
    body = tok.encode(answer.split(opener)[1]).ids
    assert feed(c, OutputConstraint("tool_call_required", spec), body)
    thought = [*tok.encode("hmm").ids, THINK_END, *tok.encode(opener).ids, *body]
    assert feed(c, OutputConstraint("tool_call_required", spec, think_first=True), thought)
    # the other architecture's spelling is rejected
    other = compilers["v4" if arch == "v41" else "v41"]
    assert not feed(other, OutputConstraint("tool_call", spec), tok.encode(answer).ids)


def test_tool_call_rejects_bad_calls(compiler, tok):
    spec = json.dumps(TOOLS)
    good = rendered_answer("v41", "")
    for bad in [
        good.replace('name="ping"', 'name="pong"'),  # unknown tool
        good.replace('name="city"', 'name="town"'),  # unknown parameter
        good.replace('string="false">3<', 'string="false">300<'),  # b > maximum
        good.replace('string="true">celsius<', 'string="true">kelvin<'),  # not in the enum
    ]:
        assert bad != good
        assert not feed(compiler, OutputConstraint("tool_call", spec), tok.encode(bad).ids)
    city = re.search(r"<｜DSML｜ parameter name=\"city\".*?parameter>\n", good, re.S)
    missing = good.replace(city.group(0), "")  # a required parameter left out
    assert not feed(compiler, OutputConstraint("tool_call", spec), tok.encode(missing).ids)


def test_single_call_grammar(compiler, tok):
    """``parallel_calls=False`` (parallel_tool_calls false): one invoke per calls block, in
    every start; the default takes several; a non-tool constraint refuses the flag."""
    spec = json.dumps(TOOLS)
    answer = rendered_answer("v41", "Checking.")  # three invokes
    first_end = answer.index("</｜DSML｜ invoke>\n") + len("</｜DSML｜ invoke>\n")
    one = answer[:first_end] + "</｜DSML｜ calls>"
    for kind, required in (("tool_call", False), ("tool_call_required", True)):
        single = OutputConstraint(kind, spec, parallel_calls=False)
        body = (lambda a: a.split(">\n", 1)[1]) if required else (lambda a: a)
        assert feed(compiler, single, tok.encode(body(one)).ids)
        assert not feed(compiler, single, tok.encode(body(answer)).ids)
        assert feed(compiler, OutputConstraint(kind, spec), tok.encode(body(answer)).ids)
    assert compiler.compile(single) is not compiler.compile(OutputConstraint(kind, spec))
    with pytest.raises(RequestError, match="parallel_calls"):
        OutputConstraint("json", "", parallel_calls=False)


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json", '{"type": "nonsense"}'),
        ("json", "{not json"),
        ("json", "[1, 2]"),
        ("regex", "("),
        ("grammar", "start: undefined_rule"),
        ("grammar", "start: /[/"),
        ("tool_call", "[]"),
        ("tool_call", '[{"type": "function"}]'),
        ("tool_call_required", "not json"),
    ],
)
def test_invalid_constraints_raise_at_compile(compiler, kind, spec):
    with pytest.raises(GrammarError):
        compiler.compile(OutputConstraint(kind, spec))


def test_compile_cache(tok):
    c = GrammarCompiler(tok, VOCAB, EOS, cache_size=2)
    a = c.compile(OutputConstraint("regex", "a+"))
    assert c.compile(OutputConstraint("regex", "a+")) is a
    assert c.compile(OutputConstraint("regex", "a+", think_first=True)) is not a
    c.compile(OutputConstraint("regex", "b+"))  # evicts "a+" (least recently used)
    assert c.compile(OutputConstraint("regex", "a+")) is not a
    m1, m2 = c.matcher(a), c.matcher(a)  # matchers from one compiled grammar are independent
    assert m1.accept(tok.token_to_id("a")) and m1.must_stop() is False and not m2.is_terminated()


def test_must_stop_rollback_and_rejection(compiler, tok):
    m = compiler.matcher(compiler.compile(OutputConstraint("regex", "ab")))
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    bitmask = allocate_bitmask(1, VOCAB)
    assert m.validate_tokens([a, b, EOS]) == 3 and m.validate_tokens([b]) == 0
    assert m.accept(a) and m.accept(b) and m.must_stop() and not m.is_terminated()
    m.fill_bitmask(bitmask[0])
    assert allowed_ids(bitmask) == {EOS}
    m.rollback(1)
    assert not m.must_stop()
    m.fill_bitmask(bitmask[0])
    assert allowed_ids(bitmask) == {b}
    assert not m.accept(a) and m.error


def test_fill_bitmasks_batch_matches_single(compiler, tok):
    constraints = [OutputConstraint("regex", r"[0-9]+"), OutputConstraint("json", ""),
                   OutputConstraint("regex", "x|yz")]  # fmt: skip
    matchers: list[GrammarMatcher] = [compiler.matcher(compiler.compile(c)) for c in constraints]
    matchers[2].accept(tok.token_to_id("y"))
    batch = allocate_bitmask(4, VOCAB)
    fill_bitmasks(matchers, batch, rows=[2, 0, 3])
    assert (batch[1] == -1).all()  # an unconstrained row is left as is
    for m, row in zip(matchers, [2, 0, 3], strict=True):
        single = allocate_bitmask(1, VOCAB)
        m.fill_bitmask(single[0])
        assert torch.equal(single[0], batch[row])


def test_apply_bitmask_rows_and_wide_logits():
    bitmask = torch.zeros(3, 16, dtype=torch.int32)  # 512 ids; row r masks logits row r
    bitmask[0, 0] = 0b101  # word 0, bits 0 and 2: tokens 0 and 2
    bitmask[2, 15] = -(2**31)  # word 15, bit 31 (the sign bit): token 511
    logits = torch.randn(3, 530)  # wider than the mask: 512..529 are always masked
    before = logits.clone()
    apply_bitmask(logits, bitmask, rows=[0, 2])
    assert torch.equal(logits[1], before[1])  # row not listed: untouched
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {0, 2}
    assert set(torch.isfinite(logits[2]).nonzero().flatten().tolist()) == {511}
    full = torch.randn(3, 512)
    apply_bitmask(full, bitmask)
    assert torch.isfinite(full).sum().item() == 3
