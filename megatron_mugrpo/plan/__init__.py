"""`mugrpo plan`: memory, time and staleness of a run before it starts (docs/plan.md).

models.py    model shapes, the paper models' published configs, the tensors of one trainer rank
memory.py    bytes per role: trainer weights / gradients / optimizer state / activations / logits,
             rollout engine weights and KV cache
timing.py    rollout roofline, optimizer phase at an assumed MFU, T_total, async idle and lag
gpus.py      the GPU table (memory, bf16 / FP8 FLOPs, HBM bandwidth) with its sources
inputs.py    the model's config.json fields and stand-ins for placeholder paths
planner.py   a run's plan from its config sections and the hardware, and its checks
suggest.py   the smallest config change that makes a role fit, with its own plan
output.py    the table and the JSON
command.py   the `plan` verb's arguments (cli.py wires it)
"""
