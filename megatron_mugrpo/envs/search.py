"""The Search-R1 environment (``env.kind: search``): the policy searches a corpus over HTTP, then answers.

The format is Search-R1's. The policy writes ``<search>query</search>``; the environment asks the
retrieval server (``mugrpo serve-search``, or any server with Search-R1's ``POST /retrieve`` API) for
the top-k documents and appends

    \\n\\n<information>Doc 1(Title: T1) text 1\\nDoc 2(Title: T2) text 2\\n</information>\\n\\n

and the policy ends the episode with ``<answer>…</answer>`` (reason 'answered'). A turn with neither
tag ends it with 'no_action'. A retrieval that fails after ``env.search.retries`` retries raises, and
the guard (``envs/base.py``) ends the trajectory with 'env_error'.

How observations are tokenised: alone, with ``add_special_tokens=False`` and no chat-template turn
markers (Search-R1 writes the information block inside the assistant's turn). The head
``\\n\\n<information>``, the documents and the tail ``</information>\\n\\n`` are encoded separately and
concatenated, so a cut to ``env.max_observation_tokens`` shortens the documents and keeps both tags.

    env = SearchEnvironment(tokenizer=tok, limits=EnvLimits(), options=SearchOptions(url="http://127.0.0.1:8000"))
    episode = env.start(Problem(prompt=..., answer=...))
    episode.step(Turn(token_ids=ids, text="I need X. <search>capital of Veloria</search>"))
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_mugrpo.envs.base import EnvError, EnvLimits, Problem, StepResult, Turn
from megatron_mugrpo.errors import require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFO_HEAD, INFO_TAIL = "\n\n<information>", "</information>\n\n"
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
PLACEHOLDER_SUFFIX = ".invalid"
"""A host under the reserved ``.invalid`` domain (RFC 2606) is a placeholder (``configs/paper/``'s
``http://retriever.invalid:8000``): refused until a real retrieval server's address replaces it."""


def is_placeholder_url(url: str) -> bool:
    """Whether ``url`` is a placeholder (its host is under ``.invalid``)."""
    return (urllib.parse.urlsplit(url).hostname or "").endswith(PLACEHOLDER_SUFFIX)


@dataclass(kw_only=True)
class SearchOptions:
    """``env.search.*``: the retrieval server and how it is called."""

    url: str = ""
    """Base URL of the retrieval server (``http://host:port``); ``POST {url}/retrieve`` is called."""
    corpus: str = ""
    """Without ``url``: a JSONL corpus ({"id", "title", "text"} rows) that the environment serves itself on
    loopback (``mugrpo serve-search``'s app in a thread), started with it and stopped by ``close()``."""
    topk: int = 3
    """Documents per search."""
    latency_s: float = 0.0
    """A fixed delay added to every search (a benchmark sets it so that the environment dominates)."""
    request_timeout_s: float = 5.0
    """Bound of one HTTP request."""
    retries: int = 2
    """Retries of a failed request (connection refused, timeout, HTTP 5xx) before the search fails."""
    backoff_s: float = 0.2
    """Wait before retry k: backoff_s * 2**k."""

    def __post_init__(self) -> None:
        require(
            not self.url or self.url.startswith(("http://", "https://")),
            f"env.search.url={self.url!r} must start with http:// or https:// (the retrieval server's address)",
        )
        require(
            not is_placeholder_url(self.url),
            f"env.search.url={self.url!r} is a placeholder: start a retrieval server (`mugrpo serve-search --corpus "
            "CORPUS.jsonl --port N`, or Search-R1's) and set env.search.url=http://HOST:N",
        )
        require(
            not (self.url and self.corpus),
            "env.search.url and env.search.corpus are both set; set url for a running server or corpus to serve "
            "one on loopback, not both",
        )
        require(
            not self.corpus or Path(self.corpus).is_file(),
            f"env.search.corpus={self.corpus!r} does not exist; give a JSONL file of {{'id', 'title', 'text'}} rows",
        )
        require(self.topk >= 1, f"env.search.topk={self.topk} must be >= 1")
        require(self.latency_s >= 0, f"env.search.latency_s={self.latency_s} must be >= 0 (seconds)")
        require(self.request_timeout_s > 0, f"env.search.request_timeout_s={self.request_timeout_s} must be > 0")
        require(self.retries >= 0, f"env.search.retries={self.retries} must be >= 0")
        require(self.backoff_s >= 0, f"env.search.backoff_s={self.backoff_s} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Document:
    """One retrieved document, as the server returns it."""

    id: str
    title: str
    text: str
    score: float


class SearchClient:
    """``POST {url}/retrieve {"queries": [...], "topk": k}`` → one list of ``Document`` per query, best first."""

    def __init__(self, options: SearchOptions, url: str = "") -> None:
        url = url or options.url
        if not url:
            raise EnvError(
                "env.search.url is empty: start `mugrpo serve-search --corpus C.jsonl --port N` and set it, or set "
                "env.search.corpus to serve a corpus on loopback"
            )
        self.options = options
        self.endpoint = url.rstrip("/") + "/retrieve"

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Document]]:
        """Top-``topk`` documents per query; raises ``EnvError`` once every retry failed."""
        body = json.dumps({"queries": list(queries), "topk": topk}).encode()
        last: Exception | None = None
        for attempt in range(self.options.retries + 1):
            if attempt:
                time.sleep(self.options.backoff_s * 2 ** (attempt - 1))
            try:
                payload = self._post(body)
            except (urllib.error.URLError, TimeoutError, ConnectionError, _RetryableError) as error:
                last = error
                continue
            return parse_results(payload, len(queries))
        raise EnvError(f"retrieval at {self.endpoint} failed {self.options.retries + 1} times; last: {last}")

    def _post(self, body: bytes) -> Any:
        request = urllib.request.Request(
            self.endpoint, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.options.request_timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code >= 500:  # the server's trouble: worth a retry; a 4xx is ours and would repeat
                raise _RetryableError(f"HTTP {error.code}") from error
            raise EnvError(f"retrieval at {self.endpoint} refused the request: HTTP {error.code}") from error


class _RetryableError(Exception):
    """A server-side failure (HTTP 5xx)."""


def parse_results(payload: Any, queries: int) -> list[list[Document]]:
    """The server's ``{"result": [[{"id","title","text","score"}, ...], ...]}``, checked."""
    result = payload.get("result") if isinstance(payload, dict) else None
    if not isinstance(result, list) or len(result) != queries:
        raise EnvError(f"the retrieval server answered {str(payload)[:200]!r}, not one result list per query")
    try:
        return [
            [
                Document(id=str(d["id"]), title=str(d["title"]), text=str(d["text"]), score=float(d["score"]))
                for d in hits
            ]
            for hits in result
        ]
    except (KeyError, TypeError, ValueError) as error:
        raise EnvError(f"the retrieval server answered a malformed document ({error})") from error


def format_documents(documents: Sequence[Document]) -> str:
    """Search-R1's layout of the retrieved documents: ``Doc i(Title: t) text`` lines."""
    return "".join(f"Doc {i + 1}(Title: {d.title}) {d.text}\n" for i, d in enumerate(documents))


def last_tag(pattern: re.Pattern[str], text: str) -> str | None:
    """The content of the last complete tag of ``pattern`` in ``text`` (stripped), or None."""
    matches = pattern.findall(text)
    return matches[-1].strip() if matches else None


class SearchEnvironment:
    """Search-R1's environment (see the module docstring); one per run, its episodes share the client."""

    stop_strings = (SEARCH_CLOSE, ANSWER_CLOSE)

    def __init__(
        self, *, tokenizer: PreTrainedTokenizerBase, limits: EnvLimits, options: SearchOptions, client: Any = None
    ) -> None:
        self.tokenizer, self.limits, self.options = tokenizer, limits, options
        head, tail = self._encode(INFO_HEAD), self._encode(INFO_TAIL)
        if len(head) + len(tail) >= limits.max_observation_tokens:
            raise EnvError(
                f"env.max_observation_tokens={limits.max_observation_tokens} leaves no room for a document "
                f"inside the {len(head) + len(tail)} tokens of the <information> tags; raise it"
            )
        self._head, self._tail = head, tail
        self._server: Any = None
        if client is None and not options.url and options.corpus:
            from megatron_mugrpo.envs.server import LocalSearchServer, load_corpus

            self._server = LocalSearchServer(load_corpus(options.corpus)).start()
        self.client = client if client is not None else SearchClient(options, self._server.url if self._server else "")

    def start(self, problem: Problem) -> SearchEpisode:
        return SearchEpisode(self)

    def close(self) -> None:
        """Stop the loopback server the environment started (if any)."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation(self, documents: Sequence[Document]) -> tuple[int, ...]:
        """The information block's token ids, the documents cut to fit ``env.max_observation_tokens``."""
        budget = self.limits.max_observation_tokens - len(self._head) - len(self._tail)
        body = self._encode(format_documents(documents))[:budget]
        return (*self._head, *body, *self._tail)


class SearchEpisode:
    """One question's searches; stateless between turns (the trajectory holds the history)."""

    def __init__(self, env: SearchEnvironment) -> None:
        self.env = env

    def step(self, turn: Turn) -> StepResult:
        if last_tag(_ANSWER, turn.text) is not None:
            return StepResult(done=True, reason="answered")
        query = last_tag(_SEARCH, turn.text)
        if not query:
            return StepResult(done=True, reason="no_action")
        if self.env.options.latency_s:
            time.sleep(self.env.options.latency_s)
        documents = self.env.client.retrieve([query], self.env.options.topk)[0]
        return StepResult(observation_ids=self.env.observation(documents), done=False, info={"tool_calls": 1})
