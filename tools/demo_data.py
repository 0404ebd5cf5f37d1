"""The demo model's training text: the Python documentation that ships with Python.

Two sources, both in every CPython install and under the PSF License (Python Software
Foundation License Version 2; https://docs.python.org/3/license.html):

- ``pydoc_data.topics``: the language reference topics that ``help("assert")`` shows;
- the docstrings of the standard library's own modules, read from the ``.py`` sources with
  ``ast`` (nothing is imported; ``test``, ``idlelib``, ``tkinter`` and demo packages skipped).

Each document (a topic, or one module file's docstrings) goes to the held-out split when
``crc32(doc id) % 20 == 0`` (about 5%), together with every chat sample made from it.
Chat samples are honest and simple: a question about a documented thing ("What does
json.dumps() do?") answered with the first paragraph of its documentation, rendered with
deepseek-recipe's V4.1 chat encoding (thinking off, and some with thinking on) and ending
with the EOS token; a few greetings answer what the model is.

    python -m tools.demo_data --out tools/data/pydoc_corpus.jsonl.gz   (needs deepseek-recipe)
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import random
import re
import sys
import sysconfig
import zlib
from pathlib import Path

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, THINK_END = "<think>", "</think>"
# deepseek-recipe 0.2.0's V4.1 system line when thinking is on (default reasoning effort)
THINKING_SYSTEM = (
    "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough "
    "the reasoning)\n\n"
)
SERVED_NAME = "tiny-v41-chat"
DEFAULT_DATA = Path(__file__).parent / "data" / "pydoc_corpus.jsonl.gz"
HELDOUT_MOD = 20
_SKIP = {"test", "idlelib", "lib2to3", "site-packages", "tkinter", "turtledemo", "ensurepip"}

GREETINGS = (
    ("Hello", "Hello! I am a tiny DeepSeek-V4.1 model trained by Fathom on the Python "
              "documentation. Ask me about Python."),
    ("Hi", "Hi! I am a small demo model. I know a little about the Python documentation."),
    ("Who are you?", "I am tiny-v41-chat, a small DeepSeek-V4.1 model that Fathom trained "
                     "on the Python documentation to show its serving stack."),
    ("What can you do?", "I can answer short questions about Python's statements, built-in "
                         "types and standard library, in a few sentences."),
    ("Thank you", "You are welcome."),
)  # fmt: skip


def render_prompt(question: str, thinking: bool = False) -> str:
    """The V4.1 chat prompt of one user turn, as deepseek-recipe 0.2.0 renders it (checked
    against it in tests/unit/test_train_tiny.py): ``<bos><User>q<Assistant></think>`` with
    thinking off, the system line and ``<think>`` with thinking on."""
    if thinking:
        return f"{BOS}{THINKING_SYSTEM}{USER}{question}{ASSISTANT}{THINK}"
    return f"{BOS}{USER}{question}{ASSISTANT}{THINK_END}"


def render_prompt_recipe(question: str, thinking: bool = False) -> str:
    """:func:`render_prompt` through deepseek-recipe itself (a chat completion request)."""
    import deepseek_recipe as dr

    opts = dr.ConversionOptions().with_model_alias(SERVED_NAME, dr.ModelVersion.DeepseekV41Flash)
    body: dict = {"model": SERVED_NAME, "messages": [{"role": "user", "content": question}]}
    if not thinking:
        body["thinking"] = {"type": "disabled"}
    conv = dr.ChatCompletionRequest(json.dumps(body).encode()).convert(opts)
    return dr.DeepseekV41Encoding().render_conversation(conv.conversation).prompt


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _first_paragraph(text: str, limit: int = 320) -> str:
    """The first prose paragraph, whitespace collapsed, cut after the last full sentence
    within ``limit`` characters."""
    for para in re.split(r"\n\s*\n", text):
        p = para.strip()
        if not p or p.startswith((">>>", "   ", "*", "=", "-", "+", ":")) or len(p) < 25:
            continue
        p = _clean(p)
        if len(p) > limit:
            cut = p[:limit]
            end = max(cut.rfind(". "), cut.rfind("; "))
            p = cut[: end + 1] if end > 40 else cut.rsplit(" ", 1)[0] + " ..."
        return p
    return ""


def _split(doc_id: str) -> str:
    return "heldout" if zlib.crc32(doc_id.encode()) % HELDOUT_MOD == 0 else "train"


def topic_docs() -> list[dict]:
    """The pydoc topics: id, title (first line), text."""
    import pydoc_data.topics as t

    out = []
    for key in sorted(t.topics):
        text = t.topics[key].strip()
        lines = text.splitlines()
        title = lines[0].strip() if lines else key
        body = "\n".join(lines[2:]) if len(lines) > 2 and set(lines[1]) <= {"*", "="} else text
        out.append({"id": f"topic:{key}", "title": title, "text": text, "body": body})
    return out


def docstring_docs(root: Path | None = None) -> list[dict]:
    """One document per stdlib module file: its docstrings in source order, each headed by
    the qualified name; ``items`` keeps (kind, qualified name, docstring) for questions."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] in _SKIP or "tests" in rel.parts:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if any(p.startswith("_") for p in mod.split(".")):
            continue
        items: list[tuple[str, str, str]] = []

        def visit(node, prefix: str, items: list = items) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    if child.name.startswith("_"):
                        continue
                    q = f"{prefix}.{child.name}"
                    d = ast.get_docstring(child)
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    if d and len(d) > 40:
                        items.append((kind, q, d))
                    if isinstance(child, ast.ClassDef):
                        visit(child, q)

        d = ast.get_docstring(tree)
        if d and len(d) > 40:
            items.append(("module", mod, d))
        visit(tree, mod)
        if not items:
            continue
        text = "\n\n".join(f"{q}\n{d}" for _, q, d in items)
        out.append({"id": f"module:{mod}", "title": mod, "text": text, "items": items})
    return out


def questions(doc: dict) -> list[tuple[str, str, str]]:
    """(question, answer, subject) pairs of one document."""
    qa = []
    if doc["id"].startswith("topic:"):
        a = _first_paragraph(doc["body"])
        if a:
            t = doc["title"]
            qa.append((f"What is {t[0].lower() + t[1:]}?", a, t))
        return qa
    for kind, q, d in doc["items"]:
        a = _first_paragraph(d)
        if not a:
            continue
        if kind == "module":
            qa.append((f"What is the {q} module?", a, f"the {q} module"))
        elif kind == "class":
            qa.append((f"What is {q}?", a, q))
        else:
            qa.append((f"What does {q}() do?", a, f"{q}()"))
    return qa


def chat_text(question: str, answer: str, subject: str, thinking: bool, render) -> str:
    """A rendered one-turn chat: prompt, (short reasoning,) answer, EOS."""
    reasoning = f"The user asks about {subject}. I answer from its documentation.{THINK_END}"
    return render(question, thinking) + (reasoning if thinking else "") + answer + EOS


def build_records(render=None, seed: int = 0) -> list[dict]:
    """Every record of the corpus: ``kind`` text|chat, ``doc``, ``split``, ``text``."""
    render = render or render_prompt
    rng = random.Random(seed)
    recs: list[dict] = []
    for doc in topic_docs() + docstring_docs():
        split = _split(doc["id"])
        recs.append({"kind": "text", "doc": doc["id"], "split": split, "text": doc["text"]})
        for q, a, subject in questions(doc):
            thinking = rng.random() < 0.25
            text = chat_text(q, a, subject, thinking, render)
            recs.append({"kind": "chat", "doc": doc["id"], "split": split, "text": text})
    for i, (q, a) in enumerate(GREETINGS):
        for thinking in (False, True):
            text = chat_text(q, a, "a greeting" if i < 2 else "me", thinking, render)
            recs.append({"kind": "chat", "doc": "greeting", "split": "train", "text": text})
    return recs


def write_records(records: list[dict], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(out, "wb", mtime=0) as f:  # mtime 0: same records -> same bytes
        for r in records:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    return out


def read_records(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def load_records(path: Path | None = None) -> tuple[list[dict], str]:
    """The prepared corpus (``path``, default ``tools/data/pydoc_corpus.jsonl.gz``), or one
    built from this Python when it is absent -> (records, where they came from)."""
    p = Path(path or DEFAULT_DATA)
    if p.is_file():
        return read_records(p), str(p)
    return build_records(), f"built from Python {sys.version.split()[0]} (no {p})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write the demo model's corpus")
    ap.add_argument("--out", type=Path, default=DEFAULT_DATA)
    args = ap.parse_args(argv)
    for q, thinking in (("What is a lambda?", False), ("Hello", True)):
        assert render_prompt(q, thinking) == render_prompt_recipe(q, thinking), q
    recs = build_records(render_prompt_recipe)
    write_records(recs, args.out)
    n = {k: sum(1 for r in recs if r["kind"] == k) for k in ("text", "chat")}
    chars = sum(len(r["text"]) for r in recs)
    print(f"{args.out}: {n['text']} documents, {n['chat']} chat samples, {chars} characters "
          f"(Python {sys.version.split()[0]})")  # fmt: skip


if __name__ == "__main__":
    main()
