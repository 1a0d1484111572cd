"""Latency of the search environment's retrieval server, and whether BM25 finds the entity a question names.

Builds the fictional-entity corpus (``megatron_mugrpo.envs.fictional``) at two sizes, serves each with
``mugrpo serve-search``'s app on loopback, and sends --requests sequential ``POST /retrieve`` calls, one
"In which city was NAME born?" query each (topk 3), as the search environment does. Prints the index
time, the median and p90 latency of a call, and how often the named person's own document ranks first.

    python benchmarks/search_retrieval.py                     # < 30 s on a CPU

Last line: ``docs=<larger corpus> index_s= median_ms= p90_ms= top1=<fraction>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

from megatron_mugrpo.envs.fictional import make_world, world_documents
from megatron_mugrpo.envs.server import Bm25Index, CorpusDocument, LocalSearchServer


def measure(people: int, requests: int) -> dict[str, float]:
    world = make_world(0, people=people, cities=max(40, people // 5))
    documents = world_documents(world)
    start = time.perf_counter()
    Bm25Index(documents)
    index_s = time.perf_counter() - start
    latencies, top1 = [], 0
    asked = [world.people[i % len(world.people)] for i in range(requests)]
    with LocalSearchServer(documents) as server:
        for person in asked:
            body = json.dumps({"queries": [f"In which city was {person.name} born?"], "topk": 3}).encode()
            request = urllib.request.Request(
                server.url + "/retrieve", data=body, headers={"Content-Type": "application/json"}
            )
            start = time.perf_counter()
            with urllib.request.urlopen(request, timeout=10) as response:
                hits = json.loads(response.read())["result"][0]
            latencies.append(time.perf_counter() - start)
            top1 += hits[0]["title"] == person.name
    latencies.sort()
    return {
        "docs": len(documents),
        "index_s": index_s,
        "median_ms": 1000 * statistics.median(latencies),
        "p90_ms": 1000 * latencies[int(0.9 * (len(latencies) - 1))],
        "top1": top1 / len(asked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", type=int, nargs="+", default=[200, 5000], help="corpus sizes (people)")
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    Bm25Index([CorpusDocument(id="0", title="warm", text="up")])  # imports bm25s before any timing
    for people in args.people:
        result = measure(people, args.requests)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
