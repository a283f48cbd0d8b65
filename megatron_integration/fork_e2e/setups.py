"""The set-ups the end-to-end run trains: the fork's command-line flags and the ds_config of each.

Every set-up is a tiny GPT (4 layers, hidden 64, 4 heads, sequence 32) on 2 CPU ranks (8 in the 3D set-ups:
tensor parallel 2 x pipeline parallel 2 x data parallel 2; 4 in ``pipe-stage0``: pipeline parallel 2 x data
parallel 2), global batch 8, micro batch 2, gradient clipping at 1.0, with ``--log-layer-grad-norms
--layer-grad-norms-layers all`` so that the root-sum-square of the buckets can be checked against the fork's
own grad norm, or, where the fork logs none (fp32 without ZeRO), against the reference of ``reference.py``.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List

NUM_LAYERS, HIDDEN, HEADS, SEQ_LEN = 4, 64, 4, 32
MICRO_BATCH, GLOBAL_BATCH = 2, 8  # a micro batch of 2: the attention shim matters (see shims.py)
VOCAB_SIZE = 100

CPU_FLAGS = [
    # the fused CUDA kernels and the async all-reduce have no CPU path; gloo is the CPU backend
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--no-async-tensor-model-parallel-allreduce",
    "--distributed-backend", "gloo",
]


@dataclass(frozen=True)
class Setup:
    name: str
    description: str
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    zero_stage: int = 1
    bf16: bool = False
    optimizer: str = "DeepSpeedZeroOptimizer"
    """The class ``deepspeed.initialize`` returns for this set-up: the code path it is about."""
    extra_ds_config: Dict[str, Any] = field(default_factory=dict)
    world_size: int = 2
    """The number of CPU ranks the launcher starts."""
    rss_against: str = "fork"
    """What the root-sum-square of the buckets must equal: ``fork``, the fork's own grad norm (DeepSpeed's
    ``get_global_grad_norm()``), or ``reference``, the plain-torch norm ``reference.py`` prints, where the
    fork logs no grad norm (fp32 without ZeRO: the engine keeps none)."""

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    def ds_config(self) -> Dict[str, Any]:
        config = {
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": GLOBAL_BATCH // (MICRO_BATCH * self.data_parallel),
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": self.zero_stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if self.bf16:
            config["bf16"] = {"enabled": True}
        config.update(self.extra_ds_config)
        return config

    def fork_flags(self) -> List[str]:
        flags = ["--tensor-model-parallel-size", str(self.tensor_parallel),
                 "--pipeline-model-parallel-size", str(self.pipeline_parallel),
                 "--zero-stage", str(self.zero_stage)]
        if self.pipeline_parallel == 1:
            flags.append("--no-pipeline-parallel")  # the fork's GPTModel and DeepSpeedEngine, not GPTModelPipe
        if self.bf16:
            flags.append("--bf16")
        return flags


BF16_FP32_ACCUMULATION = {"data_types": {"grad_accum_dtype": "fp32"}}  # with bf16 and ZeRO-1: BF16_Optimizer

SETUPS = {
    setup.name: setup
    for setup in (
        Setup("zero1", "ZeRO-1, fp32, data parallel 2"),
        Setup("zero2", "ZeRO-2, fp32, data parallel 2", zero_stage=2),
        Setup("bloom", "the BLOOM set-up: bf16, ZeRO-1, grad_accum_dtype fp32 (BF16_Optimizer), pipeline parallel 2",
              pipeline_parallel=2, bf16=True, optimizer="BF16_Optimizer", extra_ds_config=BF16_FP32_ACCUMULATION),
        Setup("tp2", "tensor parallel 2, ZeRO-1, fp32", tensor_parallel=2),
        Setup("bloom3d", "the BLOOM set-up in 3D: bf16, ZeRO-1, grad_accum_dtype fp32 (BF16_Optimizer), "
              "tensor parallel 2 x pipeline parallel 2 x data parallel 2", tensor_parallel=2, pipeline_parallel=2,
              bf16=True, optimizer="BF16_Optimizer", extra_ds_config=BF16_FP32_ACCUMULATION, world_size=8),
        Setup("zero1-3d", "ZeRO-1, fp32, tensor parallel 2 x pipeline parallel 2 x data parallel 2",
              tensor_parallel=2, pipeline_parallel=2, world_size=8),
        Setup("pipe-stage0", "fp32 without ZeRO (stage 0), pipeline parallel 2 x data parallel 2",
              pipeline_parallel=2, zero_stage=0, optimizer="Adam", world_size=4, rss_against="reference"),
    )
}


def model_flags(train_iters: int, layers: str) -> List[str]:
    """The flags every set-up shares: model size, schedule, data, logging."""
    return [
        "--num-layers", str(NUM_LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ_LEN), "--max-position-embeddings", str(SEQ_LEN),
        "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
        "--train-iters", str(train_iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE), "--split", "98,2,0",
        "--eval-interval", str(10 * train_iters), "--eval-iters", "1",
        "--log-interval", "5", "--tensorboard-log-interval", "1",
        "--log-layer-grad-norms", "--layer-grad-norms-layers", layers,
    ] + CPU_FLAGS
