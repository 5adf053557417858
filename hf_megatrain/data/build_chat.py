"""Rebuild ``chat.jsonl``, the bundled conversations of ``recipes/sft.py``, from ``corpus.txt``.

    python3 hf_megatrain/data/build_chat.py

Deterministic and offline: the only input is the committed ``corpus.txt`` (PSF-licensed Python
documentation text, see README.md), so any Python 3.10+ writes the same bytes. Every section of the
corpus with an underlined heading and at least one prose paragraph (not indented grammar or code)
gives one conversation, in corpus order, duplicate headings skipped, at most ``MAX_CONVERSATIONS``
(the committed corpus has 90 such sections):

  user:       a question about the heading, from a fixed rotation of phrasings
  assistant:  the first sentences of the section's first prose paragraph (up to ~300 characters)
  and, in every other conversation whose section has a second prose paragraph, a second turn:
  user:       a follow-up ("Tell me more." ...)
  assistant:  the first sentences of that second paragraph

Multi-turn rows matter: an assistant-only loss must mask the second user turn too, not only the
prefix before the first answer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_CONVERSATIONS = 100
MAX_ANSWER_CHARS = 300
QUESTIONS = [
    "What does the Python reference say about {}?",
    "Can you explain {} briefly?",
    "Give me a short summary of the section on {}.",
    "I am reading about {}. What is the key point?",
]
FOLLOW_UPS = ["Tell me more.", "What else should I know?", "Go on, please."]
_UNDERLINE = re.compile(r"[*=\-]{3,}")


def sections(corpus: str) -> list[tuple[str, list[str]]]:
    """(heading, prose paragraphs) of every underlined heading, in corpus order."""
    lines = corpus.split("\n")
    starts = [
        i - 1
        for i in range(1, len(lines))
        if _UNDERLINE.fullmatch(lines[i]) and len(lines[i]) == len(lines[i - 1].rstrip())
    ]
    out = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        body = "\n".join(lines[start + 2 : end])
        prose = []
        for block in body.split("\n\n"):
            # Indented blocks are grammar rules, code or tables; keep running text only.
            if block.strip() and not block.startswith((" ", "\t")):
                text = " ".join(block.split())
                if len(text) >= 60 and text.endswith((".", ":")):
                    prose.append(text)
        out.append((lines[start].strip(), prose))
    return out


def first_sentences(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """Whole sentences from the start of ``text`` while they fit in ``limit`` (at least one)."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", text)
    answer = parts[0]
    for part in parts[1:]:
        if len(answer) + 1 + len(part) > limit:
            break
        answer += " " + part
    return answer.rstrip(":") + ("." if answer.endswith(":") else "")


def build(corpus: str) -> list[dict]:
    rows, seen = [], set()
    for heading, prose in sections(corpus):
        if heading in seen or not prose:
            continue
        seen.add(heading)
        n = len(rows)
        messages = [
            {"role": "user", "content": QUESTIONS[n % len(QUESTIONS)].format(heading)},
            {"role": "assistant", "content": first_sentences(prose[0])},
        ]
        if n % 2 == 1 and len(prose) > 1:
            messages += [
                {"role": "user", "content": FOLLOW_UPS[n % len(FOLLOW_UPS)]},
                {"role": "assistant", "content": first_sentences(prose[1])},
            ]
        rows.append({"messages": messages})
        if len(rows) == MAX_CONVERSATIONS:
            break
    return rows


def main() -> None:
    rows = build((HERE / "corpus.txt").read_text(encoding="utf-8"))
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (HERE / "chat.jsonl").write_text(text, encoding="utf-8")
    turns = sum(len(r["messages"]) // 2 for r in rows)
    print(f"chat.jsonl: {len(rows)} conversations, {turns} assistant turns, {len(text)} bytes")


if __name__ == "__main__":
    main()
