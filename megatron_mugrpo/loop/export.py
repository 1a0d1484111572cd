"""The trained policy as a Hugging Face directory at the end of a run (``RUN_DIR/hf_final``).

The export is collective over the model-parallel ranks; ``conversion.export_policy`` runs it on every
rank and hands the stream to rank 0, which writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_mugrpo.conversion.live import NamedTensors
    from megatron_mugrpo.loop.run import Run

FINAL_HF_DIR = "hf_final"


def export_final(run: Run) -> None:
    """Write the trained policy as a Hugging Face directory, ``RUN_DIR/hf_final`` (replacing an older one)."""
    import shutil

    from megatron_mugrpo.conversion import export_policy, save_hf_dir

    target = run.run_dir / FINAL_HF_DIR

    def write(tensors: NamedTensors) -> None:
        shutil.rmtree(target, ignore_errors=True)
        save_hf_dir(((name, tensor.cpu()) for name, tensor in tensors), target, run.origin.hf_config, run.origin.hf_dir)

    export_policy(run.policy, run.origin.hf_config, run.groups, consume=run.is_writer, use=write)
    run.hosts.barrier()
