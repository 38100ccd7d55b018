"""The demo model's training text, taken from what ships with CPython, in a fixed order."""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pydoc_data.topics

MIN_DOCSTRING_CHARS = 80
MAX_ANSWER_CHARS = 700
QUESTIONS = ("Tell me about {}.", "What is {}?", "Explain {}.", "How does {} work?")
SYSTEM_PROMPT = "You are a helpful assistant that knows Python."


@dataclass(frozen=True, slots=True)
class Corpus:
    documents: tuple[str, ...]
    conversations: tuple[tuple[dict[str, str], ...], ...]

    @property
    def num_chars(self) -> int:
        return sum(map(len, self.documents)) + sum(
            len(m["content"]) for c in self.conversations for m in c)


def topic_texts() -> list[tuple[str, str]]:
    """(title, body) for each pydoc topic, sorted by topic key."""
    topics = pydoc_data.topics.topics
    out = []
    for key in sorted(topics):
        lines = topics[key].strip().splitlines()
        # A topic opens with its title underlined by a row of "*".
        if len(lines) > 2 and set(lines[1]) == {"*"}:
            out.append((lines[0].strip(), "\n".join(lines[2:]).strip()))
        else:
            out.append((key.replace("-", " "), "\n".join(lines)))
    return out


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) from the top-level stdlib modules, parsed not imported."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        out.extend(_docstrings(tree, path.stem))
    return out


def _docstrings(node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef,
                prefix: str) -> list[tuple[str, str]]:
    out = []
    doc = ast.get_docstring(node, clean=True)
    if doc and len(doc) >= MIN_DOCSTRING_CHARS:
        out.append((prefix, doc))
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.extend(_docstrings(child, f"{prefix}.{child.name}"))
    return out


def first_paragraphs(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str:
    out = ""
    for paragraph in text.split("\n\n"):
        if out and len(out) + len(paragraph) > max_chars:
            break
        out = f"{out}\n\n{paragraph}" if out else paragraph
    return out[:max_chars].strip()


def conversation(index: int, subject: str, answer: str) -> tuple[dict[str, str], ...]:
    if subject.startswith("The "):
        subject = "the " + subject[4:]
    question = QUESTIONS[index % len(QUESTIONS)].format(subject)
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if index % 8 == 0:
        turns.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return tuple(turns)


def load_corpus() -> Corpus:
    """Plain documents (every topic and docstring) plus one short Q&A chat per item."""
    items = topic_texts() + [(f"`{name}`", doc) for name, doc in stdlib_docstrings()]
    documents = tuple(f"{subject}\n\n{body}" for subject, body in items)
    conversations = tuple(conversation(i, subject, first_paragraphs(body))
                          for i, (subject, body) in enumerate(items))
    return Corpus(documents, conversations)
