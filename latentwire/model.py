"""The trainable part of LatentWire: byte encoder -> latent pooler -> one adapter per LLM.

Every attention here goes through `F.scaled_dot_product_attention`, which picks the flash or
memory-efficient kernel on CUDA and a fused kernel on CPU. Padding is masked out of every
attention (as keys), so a prompt padded to any length gives the same wire.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .data import round_up

NUM_BYTE_IDS = 257  # 256 byte values + the padding id (data.PAD_BYTE)


class Attention(nn.Module):
    """Multi-head attention over keys with a padding mask. Self-attention when `kv` is `q`."""

    def __init__(self, dim: int, heads: int, kv_dim: int | None = None, dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        # No bias on q and k: a key bias shifts every score of a query equally, so softmax cancels
        # it and its gradient is pure rounding noise, which Adam would blow up into updates.
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(kv_dim or dim, dim, bias=False)
        self.v = nn.Linear(kv_dim or dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, q_in: torch.Tensor, kv_in: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, lq, d = q_in.shape
        q = self.q(q_in).view(b, lq, self.heads, -1).transpose(1, 2)
        k = self.k(kv_in).view(b, kv_in.shape[1], self.heads, -1).transpose(1, 2)
        v = self.v(kv_in).view(b, kv_in.shape[1], self.heads, -1).transpose(1, 2)
        # key_mask [B, Lk] -> [B, 1, 1, Lk]: True keys are attended to, padding never is. None: no
        # key is padding, and without a mask SDPA may pick the flash kernel.
        mask = None if key_mask is None else key_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, lq, d))


class MLP(nn.Sequential):
    def __init__(self, dim: int, dropout: float):
        super().__init__(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))


class Block(nn.Module):
    """Pre-norm transformer block: attention (self or cross) then MLP, both residual."""

    def __init__(self, dim: int, heads: int, dropout: float, kv_dim: int | None = None):
        super().__init__()
        self.norm_q = nn.LayerNorm(dim)
        # No bias on the key/value norm either: through k it is a key bias (cancelled by softmax),
        # through v it only repeats v's own bias.
        self.norm_kv = nn.LayerNorm(kv_dim, bias=False) if kv_dim else None
        self.attn = Attention(dim, heads, kv_dim, dropout)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, kv: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm_q(x)
        kv = h if kv is None else self.norm_kv(kv)
        x = x + self.drop(self.attn(h, kv, key_mask))
        return x + self.mlp(self.norm_mlp(x))


class ByteEncoder(nn.Module):
    """UTF-8 bytes -> contextual byte features (learned positions, bidirectional, padding masked)."""

    def __init__(self, dim: int, layers: int, heads: int, max_len: int, dropout: float):
        super().__init__()
        self.byte_embed = nn.Embedding(NUM_BYTE_IDS, dim)
        self.pos_embed = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, byte_ids: torch.Tensor, byte_mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(byte_ids.shape[1], device=byte_ids.device)
        x = self.byte_embed(byte_ids) + self.pos_embed(pos)
        for block in self.blocks:
            x = block(x, byte_mask)
        return self.norm(x)


class LatentPooler(nn.Module):
    """M learned queries cross-attend to the byte features: a prompt of any length becomes M tokens.

    Two rounds of (cross-attention, self-attention), as in Perceiver: the first round's queries
    are the same for every prompt, so they can only average; the second round's queries already
    depend on the prompt and can look up what the first round found (e.g. the facts about the
    person the question names) instead of an average of all bytes.
    """

    def __init__(self, num_latents: int, d_z: int, enc_dim: int, heads: int, dropout: float, rounds: int = 2):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_latents, d_z) * d_z ** -0.5)
        self.cross = nn.ModuleList(Block(d_z, heads, dropout, kv_dim=enc_dim) for _ in range(rounds))
        self.self_attn = nn.ModuleList(Block(d_z, heads, dropout) for _ in range(rounds))
        self.norm = nn.LayerNorm(d_z)

    def forward(self, feats: torch.Tensor, byte_mask: torch.Tensor) -> torch.Tensor:
        z = self.queries.expand(feats.shape[0], -1, -1)
        for cross, self_attn in zip(self.cross, self.self_attn):
            z = self_attn(cross(z, byte_mask, kv=feats), None)  # latents are never padding: no mask
        return self.norm(z)


class Adapter(nn.Module):
    """Wire (d_z) -> one LLM's input-embedding space, at the RMS of that LLM's embedding table."""

    def __init__(self, d_z: int, hidden: int, embed_rms: float, dropout: float):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(d_z, 2 * d_z), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * d_z, hidden))
        self.norm = nn.RMSNorm(hidden)
        self.register_buffer("embed_rms", torch.tensor(embed_rms), persistent=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.proj(z)
        # The norm in fp32, its weight's dtype: with a bf16 input (autocast) rms_norm takes its
        # unfused composite path and warns at every call.
        return self.norm(h.float()).to(h.dtype) * self.embed_rms


@dataclass(frozen=True)
class WireConfig:
    """The shape of the trainable model: what a checkpoint's weights need to load."""
    num_latents: int  # M soft tokens
    d_z: int  # width of the wire
    encoder_dim: int
    encoder_layers: int
    encoder_heads: int
    dropout: float
    max_prompt_bytes: int  # with pad_multiple: how many byte positions the encoder embeds
    pad_multiple: int

    @classmethod
    def of(cls, config) -> WireConfig:
        """Its fields, read from a run's configuration (a Config, or anything with these attributes)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


class WireEncoder(nn.Module):
    """Everything that trains: prompt bytes -> the wire -> soft tokens for each LLM."""

    def __init__(self, wire: WireConfig, llm_dims: dict[str, tuple[int, float]]):
        """`llm_dims` maps an LLM's name to (hidden size, input-embedding RMS)."""
        super().__init__()
        max_len = round_up(wire.max_prompt_bytes, wire.pad_multiple)  # as the collator pads
        self.encoder = ByteEncoder(wire.encoder_dim, wire.encoder_layers, wire.encoder_heads, max_len, wire.dropout)
        self.pooler = LatentPooler(wire.num_latents, wire.d_z, wire.encoder_dim, wire.encoder_heads, wire.dropout)
        self.adapters = nn.ModuleDict({name: Adapter(wire.d_z, hidden, rms, wire.dropout)
                                       for name, (hidden, rms) in llm_dims.items()})

    @classmethod
    def for_llms(cls, wire: WireConfig, llms: dict) -> WireEncoder:
        """One adapter per frozen LLM, into its hidden size and at its embedding table's RMS."""
        return cls(wire, {name: (llm.hidden_size, llm.embed_rms()) for name, llm in llms.items()})

    def wire(self, byte_ids: torch.Tensor, byte_mask: torch.Tensor) -> torch.Tensor:
        return self.pooler(self.encoder(byte_ids, byte_mask), byte_mask)

    def forward(self, byte_ids: torch.Tensor, byte_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.wire(byte_ids, byte_mask)
        return {name: adapter(z) for name, adapter in self.adapters.items()}


def count_parameters(module: nn.Module, trainable: bool) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad == trainable)
