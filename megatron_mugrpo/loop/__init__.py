"""The training loops and the actions they are made of, one job per module.

* ``run``: ``Run``, one rank's view of a run, the type every loop takes.
* ``opening``: how each verb opens a run (``Opening``): its weights, its metrics, its history entry.
* ``setup``: the composition root. ``open_run`` locks the run directory, reads and checks the
  inputs, builds the models and returns a ``Run``.
* ``staged``: the staged μ-GRPO loop (``train``; ``rollout_phase`` and ``optimize_stage`` for the
  phase verbs).
* ``asynchronous``: the trainer's loop in async mode (``train_async``).
* ``actions``: what both loops do with groups: train on them, evaluate, checkpoint, summarise.
* ``cadence``: when both loops evaluate and checkpoint.
* ``engines``: weight sync to the rollout engines, releasing them, the behaviour policy context.
* ``export``: exporting the policy as Hugging Face tensors (engines, publications, the final model).
* ``data``: one stage's data: the rollout store, log π_old and the replayed groups.
* ``hdr``: Headroom-Drift Replay's orchestration (its math is ``algorithms/replay.py``).
* ``preemption``: SIGTERM / SIGUSR1 → checkpoint at the next safe point → exit 75 (requeue, resume).
"""
