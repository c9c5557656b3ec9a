"""One data-parallel rank of `lm_coupling.evaluate`, on CPU with gloo.

``python dp_worker.py RANK WORLD_SIZE PORT MODEL DATA_DIR OUTPUT_PATH``

lm-eval 0.4.13 shards documents across ranks only for accelerate-launched
GPU runs. Here each process joins a gloo process group and lm-eval's model
is told its rank and world size right after it loads, with ``all_gather``
and ``barrier`` on the same group; everything else (lm-eval's sharding of
documents, its gathers, lm-coupling's `CouplingHFLM.gather_object` and the
session's export and merge of records) is the real code.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

TASKS = ["lmc_arc_easy_offline", "lmc_winogrande_offline"]
METRIC_ARGS = "coupling_docs=3"


def make_data_parallel(rank: int, world_size: int) -> None:
    """Give lm-eval's loaded model this process's rank, on the gloo group."""
    from lm_coupling.harness.model import CouplingHFLM

    stock_init = CouplingHFLM.__init__

    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        self._rank, self._world_size = rank, world_size
        os.environ["RANK"] = str(rank)  # rank 0 alone refreshes the leaderboard

    def all_gather(self, tensor):
        parts = [torch.zeros_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    CouplingHFLM.__init__ = __init__
    CouplingHFLM.all_gather = all_gather
    CouplingHFLM.barrier = lambda self: dist.barrier()


def main(argv: list[str]) -> None:
    rank, world_size, port = (int(a) for a in argv[:3])
    model, data_dir, output_path = argv[3:6]
    if world_size > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        make_data_parallel(rank, world_size)
    import lm_coupling

    lm_coupling.evaluate(
        model_args={"pretrained": model},
        tasks=TASKS,
        metrics="all",
        metric_args=METRIC_ARGS,
        batch_size=2,
        device="cpu",
        output_path=output_path,
        # Zero-shot: lm-eval draws few-shot examples per rank, so a sharded
        # run's prompts would differ from a single process's.
        num_fewshot=0,
        log_samples=True,
        metadata={"lmc_data_dir": data_dir},
    )
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
