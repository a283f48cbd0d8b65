"""What each rank runs in the encoder-decoder test: tiny random Hugging Face T5 and BART under ZeRO-2.

Each model is built from a small config (nothing is downloaded), trained a few steps with SGD at lr=1
and active clipping; each step records ``get_layer_grad_norms()``, the global norm, the update the
optimizer applied and, on rank 0, the plain-PyTorch reference statistics of the step.
"""

import logging
from typing import Any, Dict, List

import torch

from reference import bucket_stats, encoder_decoder_bucket, mean_gradients
from zero_workers import install_feature

MICRO_BATCH = 2
VOCAB = 32
CLIP = 0.05  # well below the models' gradient norms: every step is clipped


def tiny_model(kind: str) -> torch.nn.Module:
    """A random T5 or BART with 2 encoder and 3 decoder layers and tied embeddings, without dropout."""
    import transformers

    torch.manual_seed(0)
    if kind == "t5":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                       num_decoder_layers=3, num_heads=2, dropout_rate=0.0, tie_word_embeddings=True,
                                       decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(config)
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=3,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0, tie_word_embeddings=True)
    return transformers.BartForConditionalGeneration(config)


def batch(seed: int) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (MICRO_BATCH, 8), generator=generator),
            "labels": torch.randint(3, VOCAB, (MICRO_BATCH, 6), generator=generator)}


def loss_of(model: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).loss


def ds_config(block: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": {"enabled": True, **block},
    }


def train(kind: str, steps: int) -> Dict[str, Any]:
    """Train ``kind`` under ZeRO-2; the record of every step (the reference on rank 0 only)."""
    import deepspeed
    from deepspeed import comm as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = tiny_model(kind)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=ds_config({}))
    record: Dict[str, List] = {"measured": [], "global_norm": [], "applied": [], "reference": []}
    for step in range(steps):
        before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        engine.backward(loss_of(engine, batch(100 * step + rank)))
        engine.step()
        after = {name: p.detach() for name, p in engine.module.named_parameters()}
        record["applied"].append(bucket_stats({n: before[n] - after[n] for n in before}, encoder_decoder_bucket))
        record["measured"].append(engine.get_layer_grad_norms())
        record["global_norm"].append(float(engine.get_global_grad_norm()))
        if rank == 0:
            reference = tiny_model(kind)
            with torch.no_grad():
                for name, param in reference.named_parameters():
                    param.copy_(before[name])
            grads = mean_gradients(reference, loss_of, [batch(100 * step + r) for r in range(world_size)])
            record["reference"].append(bucket_stats(grads, encoder_decoder_bucket))
    record["names"] = [name for name, _ in engine.module.named_parameters()]
    engine.destroy()
    return record


def refusal() -> str:
    """The error ``deepspeed.initialize`` raises for two layer stacks that cannot be told apart."""
    import deepspeed

    model = torch.nn.Module()
    model.add_module("0", torch.nn.Linear(4, 4))  # layer 0 of the stack '' under the pattern below
    model.add_module("encoder", torch.nn.Module())
    model.encoder.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    config = ds_config({"layer_pattern": r"(?:^|\.layers\.)(\d+)\."})
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config)
    except Exception as error:  # the test checks its type by name
        return f"{type(error).__name__}: {error}"
    return "no error"


def run_encoder_decoder(steps: int) -> Dict[str, Any]:
    install_feature()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return {"t5": train("t5", steps), "bart": train("bart", steps), "refusal": refusal()}
