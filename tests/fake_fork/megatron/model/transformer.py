"""A Megatron-shaped GPT: ``language_model.encoder.layers.N.`` parameter names, attention through
``CoreAttention``, which ``.view``s its inputs as the fork's does; ``ParallelAttention`` hands it heads sliced
out of the fused qkv projection, which are not viewable across a batch of more than one (the fork's failure)
unless the harness shim makes them contiguous."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class CoreAttention(nn.Module):
    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        seq, batch, heads, head_dim = query_layer.shape
        query = query_layer.view(seq, batch * heads, head_dim).transpose(0, 1)
        key = key_layer.view(seq, batch * heads, head_dim).transpose(0, 1)
        value = value_layer.view(seq, batch * heads, head_dim).transpose(0, 1)
        scores = torch.bmm(query, key.transpose(1, 2)) / math.sqrt(head_dim)
        probs = F.softmax(scores.masked_fill(attention_mask, float("-inf")), dim=-1)
        context = torch.bmm(probs, value).transpose(0, 1)
        return context.reshape(seq, batch, heads * head_dim)


class ParallelAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.core_attention = CoreAttention()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, attention_mask):
        batch, seq, hidden = hidden_states.shape
        mixed = self.query_key_value(hidden_states.transpose(0, 1))  # [s, b, 3h], as the fork lays it out
        query, key, value = (mixed[:, :, part * hidden:(part + 1) * hidden].reshape(seq, batch, self.heads, -1)
                             for part in range(3))
        return self.dense(self.core_attention(query, key, value, attention_mask).transpose(0, 1))


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = ParallelAttention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Encoder(nn.Module):
    def __init__(self, num_layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ParallelTransformerLayer(hidden, heads) for _ in range(num_layers))
        self.final_layernorm = nn.LayerNorm(hidden)

    def forward(self, hidden_states, attention_mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.final_layernorm(hidden_states)


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, seq_len: int, num_layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.embedding = nn.ModuleDict({"word_embeddings": nn.Embedding(vocab, hidden),
                                        "position_embeddings": nn.Embedding(seq_len, hidden)})
        self.encoder = Encoder(num_layers, hidden, heads)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        hidden_states = self.embedding["word_embeddings"](tokens) + self.embedding["position_embeddings"](positions)
        mask = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)
        return self.encoder(hidden_states, mask)


class GPTModel(nn.Module):
    """Mean next-token cross-entropy of ``tokens`` (batch, seq_len + 1); the output weight is the embedding's."""

    def __init__(self, vocab: int, seq_len: int, num_layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.language_model = LanguageModel(vocab, seq_len, num_layers, hidden, heads)

    def forward(self, tokens):
        hidden_states = self.language_model(tokens[:, :-1])
        logits = hidden_states @ self.language_model.embedding["word_embeddings"].weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
