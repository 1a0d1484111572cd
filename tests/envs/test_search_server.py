"""``mugrpo serve-search``: the corpus reader, BM25 ranking, the HTTP API on loopback and the client's retries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.cli import main
from megatron_mugrpo.envs.base import EnvError, EnvLimits, Problem, Turn
from megatron_mugrpo.envs.search import INFO_HEAD, SearchClient, SearchEnvironment, SearchOptions
from megatron_mugrpo.envs.server import Bm25Index, CorpusDocument, CorpusError, LocalSearchServer, load_corpus
from megatron_mugrpo.errors import MissingInputError

DOCS = [
    CorpusDocument(id="d0", title="Veloria", text="Veloria is a city in Norland. Its mayor is Ada Quill."),
    CorpusDocument(id="d1", title="Ada Quill", text="Ada Quill was born in Tarsk in 1901."),
    CorpusDocument(id="d2", title="Omm", text="The river Omm flows through Tarsk."),
]


def post(url, body):
    request = urllib.request.Request(
        url + "/retrieve", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def write_corpus(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_corpus_reader_names_the_bad_line(tmp_path):
    rows = [{"id": d.id, "title": d.title, "text": d.text} for d in DOCS]
    assert load_corpus(write_corpus(tmp_path / "ok.jsonl", rows)) == DOCS
    with pytest.raises(MissingInputError, match="does not exist"):
        load_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "title": "a", "text": "b"}\n{oops\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2 is not JSON"):
        load_corpus(tmp_path / "bad.jsonl")
    for name, bad in (("notext", {"id": 1, "title": "a"}), ("noid", {"title": "a", "text": "b"})):
        with pytest.raises(CorpusError, match=rf"{name}\.jsonl:1 needs"):
            load_corpus(write_corpus(tmp_path / f"{name}.jsonl", [bad]))
    with pytest.raises(CorpusError, match="repeats id '1'"):
        load_corpus(write_corpus(tmp_path / "dup.jsonl", [rows[0] | {"id": 1}, rows[1] | {"id": "1"}]))
    with pytest.raises(CorpusError, match="holds no document"):
        load_corpus(write_corpus(tmp_path / "empty.jsonl", []))


def test_bm25_ranks_the_document_that_holds_the_query_terms_first():
    index = Bm25Index(DOCS)
    [mayor, river] = index.search(["who is the mayor of Veloria", "river through Tarsk"], topk=2)
    assert (mayor[0]["id"], river[0]["id"]) == ("d0", "d2")
    assert mayor[0]["score"] > mayor[1]["score"] and set(mayor[0]) == {"id", "title", "text", "score"}
    assert len(index.search(["Tarsk"], topk=50)[0]) == 3  # topk past the corpus returns the corpus
    assert index.search([], topk=3) == []


def test_the_http_api_answers_in_search_r1_shape_and_the_environment_uses_it():
    with LocalSearchServer(DOCS) as server:
        assert server.url.startswith("http://127.0.0.1:")
        answer = post(server.url, {"queries": ["mayor of Veloria", "Omm"], "topk": 1})
        assert [[d["id"] for d in hits] for hits in answer["result"]] == [["d0"], ["d2"]]
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(server.url, {"queries": ["x"], "topk": 0})
        assert refused.value.code == 422
        env = SearchEnvironment(
            tokenizer=build_char_tokenizer(), limits=EnvLimits(), options=SearchOptions(url=server.url, topk=1)
        )
        result = env.start(Problem(prompt="q", answer="a")).step(Turn(token_ids=(1,), text="<search>Omm</search>"))
        assert env.tokenizer.decode(list(result.observation_ids)).startswith(INFO_HEAD + "Doc 1(Title: Omm) The river")


class Flaky(BaseHTTPRequestHandler):
    """Answers HTTP 503 to the first ``failures`` requests, then one result per query."""

    failures = 0
    calls = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        if type(self).calls <= type(self).failures:
            self.send_response(503)
            self.end_headers()
            return
        payload = {"result": [[{"id": "x", "title": q, "text": "t", "score": 1.0}] for q in body["queries"]]}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_client_retries_server_failures_and_then_gives_up(flaky_server):
    url = f"http://127.0.0.1:{flaky_server.server_address[1]}"
    Flaky.calls, Flaky.failures = 0, 2
    client = SearchClient(SearchOptions(url=url, retries=2, backoff_s=0.0))
    assert client.retrieve(["q"], 1)[0][0].title == "q" and Flaky.calls == 3
    Flaky.calls, Flaky.failures = 0, 5
    with pytest.raises(EnvError, match="failed 3 times; last: HTTP 503"):
        client.retrieve(["q"], 1)
    assert Flaky.calls == 3


def test_a_refused_connection_is_an_env_error_after_the_retries():
    with LocalSearchServer(DOCS) as server:
        url = server.url
    client = SearchClient(SearchOptions(url=url, retries=1, backoff_s=0.0, request_timeout_s=2.0))
    with pytest.raises(EnvError, match="failed 2 times"):
        client.retrieve(["q"], 1)


def test_the_cli_refuses_a_missing_corpus_and_a_bad_port(tmp_path, capsys):
    assert main(["serve-search", "--corpus", str(tmp_path / "none.jsonl"), "--port", "0"]) == 2
    assert "error: --corpus" in capsys.readouterr().err
    corpus = write_corpus(tmp_path / "c.jsonl", [{"id": "a", "title": "t", "text": "x"}])
    assert main(["serve-search", "--corpus", str(corpus), "--port", "70000"]) == 2
    assert "--port 70000 is not a TCP port" in capsys.readouterr().err


def test_the_cli_serves_until_stopped(tmp_path):
    rows = [{"id": d.id, "title": d.title, "text": d.text} for d in DOCS]
    corpus = write_corpus(tmp_path / "c.jsonl", rows)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "megatron_mugrpo.cli", "serve-search", "--corpus", str(corpus), "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()  # printed once it listens
        assert line.startswith("serving 3 documents at http://127.0.0.1:"), (line, process.stderr.read())
        url = line.split(" at ")[1].split(" ")[0]
        assert post(url, {"queries": ["Ada Quill born"], "topk": 1})["result"][0][0]["id"] == "d1"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_without_a_url_the_environment_serves_its_corpus_on_loopback_and_stops_it(tmp_path):
    from megatron_mugrpo.envs.fictional import corpus_rows, make_world
    from megatron_mugrpo.rewards.qa import score_answer

    world = make_world(7, people=8, cities=3, countries=2)
    corpus = write_corpus(tmp_path / "corpus.jsonl", corpus_rows(world))
    tokenizer = build_char_tokenizer()
    env = SearchEnvironment(
        tokenizer=tokenizer, limits=EnvLimits(max_observation_tokens=400), options=SearchOptions(corpus=str(corpus))
    )
    person = world.people[0]
    try:
        url = env.client.endpoint
        assert url.startswith("http://127.0.0.1:")
        turn = f"<search>{person.name} born</search>"
        result = env.start(Problem(prompt="q", answer="a")).step(Turn(token_ids=(1,), text=turn))
        observation = tokenizer.decode(list(result.observation_ids))
        assert f"(Title: {person.name}) {person.name} is" in observation
        # The whole trajectory's text, scored as the reward reads it: the answer from the retrieved document.
        text = turn + observation + f"<answer>{person.city.name}</answer>"
        assert tuple(score_answer(text, json.dumps([person.city.name]), "answered")) == (1.0, "correct")
    finally:
        env.close()
    with pytest.raises(EnvError, match="failed"):
        SearchClient(SearchOptions(url=url.removesuffix("/retrieve"), retries=0)).retrieve(["x"], 1)


def test_url_and_corpus_are_exclusive_and_the_corpus_must_exist(tmp_path):
    from megatron_mugrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="both set"):
        SearchOptions(url="http://127.0.0.1:1", corpus=str(write_corpus(tmp_path / "c.jsonl", [])))
    with pytest.raises(ConfigError, match="does not exist"):
        SearchOptions(corpus=str(tmp_path / "missing.jsonl"))
