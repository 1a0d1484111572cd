"""``mugrpo serve-search``: BM25 retrieval over a local JSONL corpus, behind Search-R1's HTTP API.

    mugrpo serve-search --corpus corpus.jsonl --port 8000 [--host 127.0.0.1]
    curl -s localhost:8000/retrieve -H 'content-type: application/json' \\
         -d '{"queries": ["mayor of Veloria"], "topk": 3}'
    → {"result": [[{"id": "d3", "title": "Veloria", "text": "...", "score": 2.71}, ...]]}

The corpus has one ``{"id", "title", "text"}`` object per line. Title and text are indexed together
(Search-R1's "title\\ntext" contents) with ``bm25s`` (English stop words, no stemming); a query
gets the ``topk`` best documents, best first (``topk`` larger than the corpus returns the corpus).
The server is FastAPI under uvicorn; ``GET /health`` answers ``{"documents": N}``.

Tests and runs without ``env.search.url`` start the same app in a thread on loopback:

    with LocalSearchServer(load_corpus("corpus.jsonl")) as server:
        server.url    # http://127.0.0.1:<free port>
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_mugrpo.errors import InputError, MissingInputError

if TYPE_CHECKING:  # fastapi, uvicorn and bm25s are imported when a server is built, not with the CLI
    from fastapi import FastAPI

MAX_TOPK = 100
"""Largest topk a request may ask for: a bound on one response's size."""
STARTUP_TIMEOUT_S = 30.0
"""How long ``LocalSearchServer`` waits for uvicorn to listen before it gives up."""


class CorpusError(InputError, ValueError):
    """The corpus file is not a JSONL of ``{"id", "title", "text"}`` rows."""


@dataclass(frozen=True, kw_only=True)
class CorpusDocument:
    id: str
    title: str
    text: str


def load_corpus(path: str | Path) -> list[CorpusDocument]:
    """The documents of a JSONL corpus; a bad line is an error naming the file, the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"--corpus {path} does not exist (a JSONL file of {{'id', 'title', 'text'}} rows)")
    documents, seen = [], set()
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"{where} is not JSON ({error.msg}); one object per line") from error
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("title", "text")):
                raise CorpusError(f"{where} needs string fields 'title' and 'text' (and 'id')")
            if "id" not in row or not isinstance(row["id"], str | int):
                raise CorpusError(f"{where} needs an 'id' (a string or an integer)")
            doc_id = str(row["id"])
            if doc_id in seen:
                raise CorpusError(f"{where} repeats id {doc_id!r}; ids must be unique")
            seen.add(doc_id)
            documents.append(CorpusDocument(id=doc_id, title=row["title"], text=row["text"]))
    if not documents:
        raise CorpusError(f"{path} holds no document")
    return documents


class Bm25Index:
    """BM25 (``bm25s``) over the documents' title and text."""

    def __init__(self, documents: list[CorpusDocument]) -> None:
        import bm25s

        self.documents = documents
        self._bm25s = bm25s
        self._retriever = bm25s.BM25()
        contents = [f"{d.title}\n{d.text}" for d in documents]
        self._retriever.index(bm25s.tokenize(contents, stopwords="en", show_progress=False), show_progress=False)

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        """One list per query of ``{"id", "title", "text", "score"}``, best first."""
        if not queries:
            return []
        k = min(topk, len(self.documents))
        tokens = self._bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
        indices, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [
            [
                {"id": doc.id, "title": doc.title, "text": doc.text, "score": float(score)}
                for doc, score in ((self.documents[int(i)], s) for i, s in zip(row, row_scores))
            ]
            for row, row_scores in zip(indices, scores)
        ]


def create_app(index: Bm25Index) -> FastAPI:
    """The FastAPI app: ``POST /retrieve`` and ``GET /health``."""
    from fastapi import FastAPI
    from pydantic import BaseModel, Field

    class RetrieveRequest(BaseModel):
        queries: list[str]
        topk: int = Field(default=3, ge=1, le=MAX_TOPK)

    app = FastAPI(title="mugrpo serve-search")

    def retrieve(request: RetrieveRequest) -> dict[str, Any]:  # sync: FastAPI runs it in its thread pool
        return {"result": index.search(request.queries, request.topk)}

    # Postponed annotations are strings that FastAPI resolves in the module's globals, where this local
    # model is not: hand it the class itself, or the body would be read as a query parameter.
    retrieve.__annotations__["request"] = RetrieveRequest
    app.post("/retrieve")(retrieve)

    @app.get("/health")
    def health() -> dict[str, int]:
        return {"documents": len(index.documents)}

    return app


class LocalSearchServer:
    """The app served by uvicorn in a daemon thread on ``host`` (loopback) and a free port; a context manager."""

    def __init__(self, documents: list[CorpusDocument], *, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        config = uvicorn.Config(create_app(Bm25Index(documents)), host=host, port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="search-server", daemon=True)
        self.url = ""

    def start(self) -> LocalSearchServer:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise InputError("the local search server did not start (is the port free?)")
            time.sleep(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C stops it)."""
        try:
            while self._thread.is_alive():
                self._thread.join(timeout=1.0)
        except KeyboardInterrupt:
            self.stop()

    def __enter__(self) -> LocalSearchServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_serve_search_parser(verbs: argparse._SubParsersAction) -> None:
    serve = verbs.add_parser(
        "serve-search",
        help="serve BM25 retrieval over a JSONL corpus (Search-R1's POST /retrieve), for env.search.url",
        description="Index CORPUS.jsonl ({'id', 'title', 'text'} per line) with BM25 and answer "
        'POST /retrieve {"queries": [...], "topk": k} with {"result": [[{"id", "title", "text", "score"}, ...]]}.',
    )
    serve.add_argument("--corpus", type=Path, required=True, help="JSONL corpus of {'id', 'title', 'text'} rows")
    serve.add_argument("--port", type=int, required=True, help="TCP port (0: a free one, printed at start)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")


def run_serve_search(args: argparse.Namespace) -> int:
    """Serve until interrupted; prints the URL once it listens."""
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port} is not a TCP port (0..65535)")
    documents = load_corpus(args.corpus)
    server = LocalSearchServer(documents, host=args.host, port=args.port).start()
    print(f"serving {len(documents)} documents at {server.url} (POST /retrieve)", flush=True)
    server.wait()
    return 0
