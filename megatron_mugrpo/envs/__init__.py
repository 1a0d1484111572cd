"""Environments of multi-turn (agentic) rollouts.

base.py       the protocol (Problem, Turn, StepResult, Episode, Environment) and ``guarded_step``,
              which holds any environment to the ``env.*`` limits (turns, tokens, timeout, errors)
registry.py   ``register_env`` / ``build_env`` and the ``env`` config section
search.py     Search-R1's environment: <search>q</search> → <information>…</information>, over HTTP
server.py     ``mugrpo serve-search``: BM25 retrieval over a JSONL corpus behind ``POST /retrieve``
trajectory.py multi-turn trajectories (sampled + observation ids, policy mask) and their builder
episodes.py   n episodes per problem through an engine, grouped, and scored on the policy's own text
fictional.py  a seeded corpus of fictional people and cities with 1-hop and 2-hop questions
"""
