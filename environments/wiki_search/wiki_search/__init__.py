"""wiki-search: answer questions about a small shipped encyclopedia by searching it through tools (tool use).

The corpus (30 articles about a fictional archipelago, so answers cannot come from pretraining) and the questions ship
in `data/` (pinned by sha256). The harness offers two in-process tools, `search_wiki(query)` (BM25 over titles and
text, top 3 hits) and `read_article(title)`. The model ends with `Answer: <answer>`; reward 1.0 when the normalised
answer equals the reference or one of its aliases, else 0.0.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import verifiers.v1 as vf

from primerl.orchestrator.envkit import ChatHarness, Tool, read_pinned

ARTICLES_SHA256 = "d0a88617ca0a02f604f0e08e0f418969b1a83cd21cb3f1ca2cbe16132e3f4afb"
QUESTIONS_SHA256 = "bcf2b376d9afee3cc9b0556ee9e755324452ec6ad6543a8c726935cd99ea6a55"
SYSTEM_PROMPT = (
    "Answer the question using the encyclopedia tools: search_wiki finds articles, read_article returns one in full. "
    "When you know the answer, reply with a final line of the form `Answer: <answer>`."
)
_WORD = re.compile(r"[a-z0-9]+")
_ANSWER = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace(",", ""))


@dataclass(frozen=True)
class Article:
    title: str
    text: str


class Corpus:
    """The articles with a BM25 index over title + text."""

    def __init__(self, articles: list[Article], k1: float = 1.5, b: float = 0.75) -> None:
        self.articles = {article.title.lower(): article for article in articles}
        self._docs = [(article, Counter(tokens(f"{article.title} {article.text}"))) for article in articles]
        lengths = [sum(counts.values()) for _, counts in self._docs]
        self._avg_len = sum(lengths) / len(lengths)
        df = Counter(term for _, counts in self._docs for term in counts)
        n = len(self._docs)
        self._idf = {term: math.log(1 + (n - f + 0.5) / (f + 0.5)) for term, f in df.items()}
        self._k1, self._b = k1, b

    def search(self, query: str, limit: int = 3) -> list[Article]:
        terms = tokens(query)
        scored = []
        for article, counts in self._docs:
            length = sum(counts.values())
            score = sum(
                self._idf.get(t, 0.0)
                * counts[t]
                * (self._k1 + 1)
                / (counts[t] + self._k1 * (1 - self._b + self._b * length / self._avg_len))
                for t in terms
            )
            if score > 0:
                scored.append((score, article.title, article))
        scored.sort(key=lambda hit: (-hit[0], hit[1]))
        return [article for _, _, article in scored[:limit]]


@cache
def corpus() -> Corpus:
    lines = read_pinned(__name__, "data/articles.jsonl", ARTICLES_SHA256).decode().splitlines()
    return Corpus([Article(**json.loads(line)) for line in lines])


def search_wiki(query: str) -> str:
    if not isinstance(query, str) or not query.strip():
        raise ValueError("query must be a non-empty string")
    hits = corpus().search(query)
    if not hits:
        return f"No article matches {query!r}."
    return "\n".join(f"{hit.title}: {hit.text.split('. ')[0]}." for hit in hits)


def read_article(title: str) -> str:
    if not isinstance(title, str):
        raise TypeError("title must be a string")
    article = corpus().articles.get(title.strip().lower())
    return article.text if article else f"No article titled {title!r}; use search_wiki to find titles."


TOOLS = [
    Tool(
        name="search_wiki",
        description="Search the encyclopedia; returns the titles and first sentences of the 3 best matching articles.",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "description": "search words"}},
            "required": ["query"],
        },
        fn=search_wiki,
    ),
    Tool(
        name="read_article",
        description="Return the full text of the article with this exact title.",
        parameters={
            "type": "object",
            "properties": {"title": {"type": "string", "description": "article title"}},
            "required": ["title"],
        },
        fn=read_article,
    ),
]


class WikiSearchHarness(ChatHarness):
    """The chat harness with the encyclopedia tools."""

    def tools(self) -> list[Tool]:
        return TOOLS


def normalise(answer: str) -> str:
    words = tokens(answer)
    return " ".join(word for word in words if word not in {"the", "a", "an"})


def final_answer(reply: str) -> str:
    """The text after the last `Answer:` in a reply (the whole reply when there is none)."""
    matches = _ANSWER.findall(reply)
    return matches[-1] if matches else reply


def answer_matches(reply: str, answer: str, aliases: list[str]) -> bool:
    predicted = normalise(final_answer(reply))
    return bool(predicted) and predicted in {normalise(a) for a in [answer, *aliases]}


class WikiSearchData(vf.TaskData):
    answer: str
    aliases: list[str]


class WikiSearchTask(vf.Task[WikiSearchData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct_answer(self, task: WikiSearchData, trace: vf.Trace) -> float:
        return float(answer_matches(trace.last_reply, task.answer, task.aliases))

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class WikiSearchTaskset(vf.Taskset[WikiSearchTask, vf.TasksetConfig]):
    def load(self) -> Iterator[WikiSearchTask]:
        corpus()  # verify the corpus before any rollout needs it
        lines = read_pinned(__name__, "data/questions.jsonl", QUESTIONS_SHA256).decode().splitlines()
        for row in map(json.loads, lines):
            yield WikiSearchTask(
                WikiSearchData(
                    id=row["id"],
                    prompt=row["question"],
                    system_prompt=SYSTEM_PROMPT,
                    answer=row["answer"],
                    aliases=row["aliases"],
                ),
                self.config.task,
            )


__all__ = ["WikiSearchData", "WikiSearchHarness", "WikiSearchTask", "WikiSearchTaskset"]
