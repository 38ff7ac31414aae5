"""PL-BERT: an ALBERT encoder over phoneme ids (Kokoro's `bert`).

Parameter names follow `transformers.AlbertModel`, so the official state dict loads as it is;
the model itself is written here so serving needs no transformers import. ALBERT shares one
transformer layer across all depths: `num_hidden_layers` passes through the same weights."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from service.models.kokoro.hparams import AlbertHParams


class AlbertEmbeddings(nn.Module):
    def __init__(self, hp: AlbertHParams) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(hp.vocab_size, hp.embedding_size)
        self.position_embeddings = nn.Embedding(hp.max_position_embeddings, hp.embedding_size)
        self.token_type_embeddings = nn.Embedding(hp.type_vocab_size, hp.embedding_size)
        self.LayerNorm = nn.LayerNorm(hp.embedding_size, eps=hp.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Kokoro never passes token types: every token is type 0, so its row is a constant.
        x = self.word_embeddings(ids) + self.token_type_embeddings.weight[0]
        x = x + self.position_embeddings.weight[: ids.shape[1]]
        return self.LayerNorm(x)


class AlbertAttention(nn.Module):
    """Self-attention with its residual and post-norm (ALBERT keeps both in this module)."""

    def __init__(self, hp: AlbertHParams) -> None:
        super().__init__()
        self.heads = hp.num_attention_heads
        self.query = nn.Linear(hp.hidden_size, hp.hidden_size)
        self.key = nn.Linear(hp.hidden_size, hp.hidden_size)
        self.value = nn.Linear(hp.hidden_size, hp.hidden_size)
        self.dense = nn.Linear(hp.hidden_size, hp.hidden_size)
        self.LayerNorm = nn.LayerNorm(hp.hidden_size, eps=hp.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, c = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, c // self.heads).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=key_mask)
        return self.LayerNorm(x + self.dense(ctx.transpose(1, 2).reshape(b, n, c)))


class AlbertLayer(nn.Module):
    def __init__(self, hp: AlbertHParams) -> None:
        super().__init__()
        self.attention = AlbertAttention(hp)
        self.ffn = nn.Linear(hp.hidden_size, hp.intermediate_size)
        self.ffn_output = nn.Linear(hp.intermediate_size, hp.hidden_size)
        self.full_layer_layer_norm = nn.LayerNorm(hp.hidden_size, eps=hp.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        h = self.attention(x, key_mask)
        # ALBERT's "gelu_new" is the tanh approximation of GELU.
        return self.full_layer_layer_norm(h + self.ffn_output(F.gelu(self.ffn(h), approximate="tanh")))


class AlbertLayerGroup(nn.Module):
    def __init__(self, hp: AlbertHParams) -> None:
        super().__init__()
        self.albert_layers = nn.ModuleList([AlbertLayer(hp)])


class AlbertTransformer(nn.Module):
    def __init__(self, hp: AlbertHParams) -> None:
        super().__init__()
        self.depth = hp.num_hidden_layers
        self.embedding_hidden_mapping_in = nn.Linear(hp.embedding_size, hp.hidden_size)
        self.albert_layer_groups = nn.ModuleList([AlbertLayerGroup(hp)])

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.embedding_hidden_mapping_in(x)
        group = self.albert_layer_groups[0]
        assert isinstance(group, AlbertLayerGroup)
        layer = group.albert_layers[0]
        for _ in range(self.depth):
            x = layer(x, key_mask)
        return x


class Albert(nn.Module):
    """Phoneme ids [B, N] -> hidden states [B, N, hidden]. `pooler` is never used; it is kept
    so the official state dict loads strictly."""

    def __init__(self, hp: AlbertHParams) -> None:
        super().__init__()
        self.embeddings = AlbertEmbeddings(hp)
        self.encoder = AlbertTransformer(hp)
        self.pooler = nn.Linear(hp.hidden_size, hp.hidden_size)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """`lengths` [B]: tokens past a row's length are padding, hidden from attention."""
        key_mask = None
        if lengths is not None:
            valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
            key_mask = valid[:, None, None, :]
        return self.encoder(self.embeddings(ids), key_mask)
