"""A tiny GPT with Megatron-like parameter names, for tests, benchmarks and the demo.

Pre-LN (the layout the NormFormer question is about) or Post-LN transformer layers under
``layers.N.``; the embedding, final norm and head outside them become named buckets.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class TinyGPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    hidden: int = 32
    num_layers: int = 4
    num_heads: int = 4
    pre_ln: bool = True
    tie_embeddings: bool = False


class TransformerLayer(nn.Module):
    """Self-attention and MLP, normalised before (Pre-LN) or after (Post-LN) each residual."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.pre_ln = config.pre_ln
        self.num_heads = config.num_heads
        self.input_layernorm = nn.LayerNorm(config.hidden)
        self.query_key_value = nn.Linear(config.hidden, 3 * config.hidden)
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden)
        self.dense_h_to_4h = nn.Linear(config.hidden, 4 * config.hidden)
        self.dense_4h_to_h = nn.Linear(4 * config.hidden, config.hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.query_key_value(x).view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(batch, seq, hidden))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.attention(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        x = self.input_layernorm(x + self.attention(x))
        return self.post_attention_layernorm(x + self.mlp(x))


class TinyGPT(nn.Module):
    """Token and position embedding, ``num_layers`` transformer layers, final norm, LM head."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_embed = nn.Embedding(config.seq_len, config.hidden)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` (batch, seq_len + 1)."""
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.embed(inputs) + self.pos_embed(positions)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.final_layernorm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def synthetic_batch(config: TinyGPTConfig, batch_size: int, seed: int) -> torch.Tensor:
    """Token sequences with learnable structure (each token follows from the previous), reproducible."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=generator)
    step = torch.randint(1, 4, (batch_size, 1), generator=generator)
    tokens = (start + step * torch.arange(config.seq_len + 1)) % config.vocab_size
    noise = torch.rand(tokens.shape, generator=generator) < 0.1
    return torch.where(noise, torch.randint_like(tokens, config.vocab_size, generator=generator), tokens)


class EmbeddingPipe(nn.Module):
    """Token and position embedding as a pipeline stage: tokens in, hidden states out."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_embed = nn.Embedding(config.seq_len, config.hidden)

    @property
    def embed_weight(self) -> nn.Parameter:
        """The weight the head ties to, by an attribute name as Megatron's ``word_embeddings_weight``
        (DeepSpeed before 0.15 cannot tie a dotted path such as ``embed.weight``)."""
        return self.embed.weight

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.embed(inputs) + self.pos_embed(torch.arange(inputs.shape[1], device=inputs.device))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _tied_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, embedding.embed_weight)


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tiny_gpt_pipe_specs(config: TinyGPTConfig, first_layer_index: int = 3) -> list:
    """Layer specs laid out like Megatron-DeepSpeed's ``GPTModelPipe``.

    Functions pad the front so that the first transformer layer sits at spec index
    ``first_layer_index``: 3 as in the BigScience fork, 2 as in the Microsoft fork. With
    ``config.tie_embeddings`` the head reuses the embedding through ``TiedLayerSpec``s, as there.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if first_layer_index not in (2, 3):
        raise ValueError(f"first_layer_index={first_layer_index}: expected 2 or 3")
    if config.tie_embeddings:
        embedding = TiedLayerSpec("embed", EmbeddingPipe, config, tied_weight_attr=["embed_weight"])
        head = TiedLayerSpec("embed", EmbeddingPipe, config, forward_fn=_tied_logits,
                             tied_weight_attr=["embed_weight"])
    else:
        embedding = LayerSpec(EmbeddingPipe, config)
        head = LayerSpec(nn.Linear, config.hidden, config.vocab_size, bias=False)
    specs = [_identity, embedding] + [_identity] * (first_layer_index - 2)
    specs += [LayerSpec(TransformerLayer, config) for _ in range(config.num_layers)]
    return specs + [LayerSpec(nn.LayerNorm, config.hidden), head]


def tiny_gpt_pipe(config: TinyGPTConfig, num_stages: int, first_layer_index: int = 3):
    """The tiny GPT as a DeepSpeed ``PipelineModule``; feed it ``(tokens[:, :-1], tokens[:, 1:])``."""
    from deepspeed.pipe import PipelineModule

    return PipelineModule(layers=tiny_gpt_pipe_specs(config, first_layer_index), loss_fn=_lm_loss,
                          num_stages=num_stages, partition_method="uniform")
