"""Asynchronous (disaggregated) μ-GRPO: rollout workers and trainers on separate ranks.

``mode: async`` splits the ranks of a launch: the last ``async.rollout_ranks`` ranks are rollout
workers, the others train (``roles``). Workers generate prompt groups continuously with the latest
weights they have received and append them to a bounded rollout queue on disk
(``megatron_mugrpo.rollout.queue``), each group tagged with its behaviour policy version. The trainer
takes B_mini groups per update in arrival order, drops groups more than ``async.max_lag`` updates
old (counted), and publishes its weights every ``async.sync_every`` updates (``publish``): broadcast
from memory over a process group of its own (``transport``; async.publish=memory, the default) or
written to the run directory (async.publish=disk). Otherwise the two sides share nothing but the run
directory: trainer and workers watch each other's heartbeats (``liveness``), so a dead rank stops
the run with a message naming it instead of a hang.

    torchrun --nproc_per_node 2 -m megatron_mugrpo.cli train --config configs/demo_async_cpu.yaml --run-dir runs/a

Modules: ``config`` (the ``async`` section), ``roles`` (which rank does what), ``liveness``
(heartbeats), ``publish`` (weight publication and pick-up), ``transport`` (the publication group,
buckets on the wire), ``worker`` (the rollout worker's loop),
``batches`` (which prompts each batch takes). The trainer's loop is ``megatron_mugrpo.loop.asynchronous``.
"""
