"""What each rank runs in the DistributedDataParallel test of the plain-PyTorch API."""

from typing import Any, Dict

import torch

from deepspeed_patch.plain import LayerGradNorms
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch
from reference import averaged_gradients, bucket_stats
from setup_workers import counting_collectives


def ddp_measure(steps: int) -> Dict[str, Any]:
    from deepspeed import comm as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = TinyGPTConfig()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(config))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = LayerGradNorms(model, layers="0,-1")
    record = {"measured": [], "reference": [], "collectives": 0}
    for step in range(steps):
        weights = {name: p.detach().clone() for name, p in model.module.named_parameters()}
        batches = [synthetic_batch(config, 2, seed=10 * step + r) for r in range(world_size)]
        optimizer.zero_grad()
        model(batches[rank]).backward()
        with counting_collectives() as calls:
            record["measured"].append(norms.clip_grad_norm_(0.5))
        record["collectives"] += calls[0]
        optimizer.step()
        record["reference"].append(bucket_stats(averaged_gradients(weights, config, torch.float32, batches)))
    return record


def torchrun_dump(rank: int, world_size: int, port: int, dump_path: str, steps: int, queue) -> None:
    """One rank of a DDP run started the way ``torchrun`` starts it: its environment variables and
    ``torch.distributed.init_process_group``, without DeepSpeed's communication set-up."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.distributed.init_process_group("gloo")
    config = TinyGPTConfig()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(config))
    norms = LayerGradNorms(model, dump={"path": dump_path})
    steps_measured = []
    for step in range(steps):
        model.zero_grad()
        model(synthetic_batch(config, 2, seed=10 * step + rank)).backward()
        steps_measured.append(norms.measure()["step"])
    torch.distributed.destroy_process_group()
    queue.put((rank, steps_measured))
