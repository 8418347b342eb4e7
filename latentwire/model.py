"""The trainable part of LatentWire: byte encoder -> latent pooler -> one adapter per LLM.

Every attention here goes through `F.scaled_dot_product_attention`, which picks the flash or
memory-efficient kernel on CUDA and a fused kernel on CPU. Padding is masked out of every
attention (as keys), so a prompt padded to any length gives the same wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .dataset import PAD_BYTE
from .harness.config import setting

NUM_BYTE_IDS = PAD_BYTE + 1  # 256 byte values + the padding id
NEWLINE = ord("\n")
ROPE_BASE = 10_000.0


def rotary_tables(length: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] of rotary position embeddings (RoFormer, as in Llama)."""
    inv_freq = ROPE_BASE ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate each head's (i, i + head_dim/2) pairs by their position's angles. The tables are
    cast to x's dtype: under autocast fp32 tables would promote q and k out of bf16."""
    cos, sin = (t.to(x.dtype) for t in rotary)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    """Multi-head attention over keys with a padding mask. Self-attention when `kv` is `q`; with
    `rotary` tables, q and k are rotated by their positions (self-attention over a sequence)."""

    def __init__(self, dim: int, heads: int, kv_dim: int | None = None, dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        # No bias on q and k: a key bias shifts every score of a query equally, so softmax cancels
        # it and its gradient is pure rounding noise, which Adam would blow up into updates.
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(kv_dim or dim, dim, bias=False)
        self.v = nn.Linear(kv_dim or dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(
        self,
        q_in: torch.Tensor,
        kv_in: torch.Tensor,
        key_mask: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        b, lq, d = q_in.shape
        q = self.q(q_in).view(b, lq, self.heads, -1).transpose(1, 2)
        k = self.k(kv_in).view(b, kv_in.shape[1], self.heads, -1).transpose(1, 2)
        v = self.v(kv_in).view(b, kv_in.shape[1], self.heads, -1).transpose(1, 2)
        if rotary is not None:
            q, k = rotate(q, rotary), rotate(k, rotary)
        # key_mask [B, Lk] -> [B, 1, 1, Lk]: True keys are attended to, padding never is. None: no
        # key is padding, and without a mask SDPA may pick the flash kernel. CUDA's fused kernels
        # take only a mask whose last dimension has stride 1, which a mask sliced every patch_bytes
        # has not: without the copy no kernel is left (seen on an H100), while the CPU runs anyway.
        mask = None if key_mask is None else key_mask.contiguous()[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
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

    def forward(
        self,
        x: torch.Tensor,
        key_mask: torch.Tensor | None,
        kv: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        h = self.norm_q(x)
        kv = h if kv is None else self.norm_kv(kv)
        x = x + self.drop(self.attn(h, kv, key_mask, rotary))
        return x + self.mlp(self.norm_mlp(x))


class ByteEncoder(nn.Module):
    """UTF-8 bytes -> contextual features of byte patches (bidirectional, padding masked).

    Patches: every `patch` bytes become one position (their embeddings side by side, projected;
    a strided convolution), so self-attention runs over length/patch positions, patch^2 times
    cheaper, and a position already holds a piece of a word. Rotary positions: an attention
    score depends on how far apart two patches are, not on where they sit, which is what finding
    the rest of a word or sentence needs; a learned table trains one row per position, from the
    prompts long enough to reach it, and caps the prompt length.

    With word patches (WireConfig.word_patches; data.Collator pads each word to whole patches) a
    word is always the same patches, wherever it sits: on the fixed grid a short word such as an
    age lands in any of `patch` alignments, sharing a patch with its neighbours or split over two.
    With the patch MLP a patch's bytes are read jointly, so " 23" and " 24" can get codes of
    their own. On the cpu profile the two together made ages cross the wire (docs/evaluation.md);
    either alone did not.
    """

    def __init__(
        self,
        dim: int,
        layers: int,
        heads: int,
        patch: int,
        dropout: float,
        patch_mlp: bool = False,
        hash_buckets: int = 0,
    ):
        super().__init__()
        self.patch, self.head_dim = patch, dim // heads
        self.byte_embed = nn.Embedding(NUM_BYTE_IDS, dim)
        # Linear, a patch's code is a sum of one code per (slot, byte): " 23" and " 24" differ by one
        # summand. The MLP reads the bytes jointly (see the docstring).
        self.patch_embed = (
            nn.Sequential(nn.Linear(patch * dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            if patch_mlp
            else nn.Linear(patch * dim, dim)
        )
        # A code per patch as a whole, looked up by its bytes' hash (BLT's hash n-gram embeddings): a
        # lookup, no matmul, and " 23" and " 24" land in rows of their own.
        self.patch_hash = nn.Embedding(hash_buckets, dim) if hash_buckets else None
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, byte_ids: torch.Tensor, byte_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [B, ceil(L/patch), dim] and their padding mask."""
        # Rows pad to whole patches (a no-op when pad_multiple is a multiple of patch). Real bytes
        # are a prefix of each row (with word patches, of each patch), so a patch is real when its
        # first byte is, and a last patch that is part padding reads the same padding ids at any
        # padded length: padding still never changes the wire.
        extra = -byte_ids.shape[1] % self.patch
        if extra:
            byte_ids = F.pad(byte_ids, (0, extra), value=PAD_BYTE)
            byte_mask = F.pad(byte_mask, (0, extra), value=False)
        b, length = byte_ids.shape
        x = self.patch_embed(self.byte_embed(byte_ids).view(b, length // self.patch, -1))
        if self.patch_hash is not None:
            x = x + self.patch_hash(patch_hashes(byte_ids.view(b, -1, self.patch), self.patch_hash.num_embeddings))
        patch_mask = self.patch_mask(byte_mask)
        rotary = rotary_tables(x.shape[1], self.head_dim, x.device)
        for block in self.blocks:
            x = block(x, patch_mask, rotary=rotary)
        return self.norm(x), patch_mask

    def patch_mask(self, byte_mask: torch.Tensor) -> torch.Tensor:
        """Whether each patch's first byte is in `byte_mask` (rows padded to whole patches)."""
        return F.pad(byte_mask, (0, -byte_mask.shape[1] % self.patch), value=False)[:, :: self.patch]


def patch_hashes(patches: torch.Tensor, buckets: int) -> torch.Tensor:
    """Each patch's bucket [B, P] from its byte ids [B, P, patch]: the patch as a number in base
    NUM_BYTE_IDS (exact in int64 up to 7 bytes), then a Lehmer step modulo the prime 2^31 - 1 so that
    patches differing in one byte scatter over the buckets instead of landing a fixed stride apart."""
    weights = NUM_BYTE_IDS ** torch.arange(patches.shape[-1], device=patches.device, dtype=torch.long)
    prime = 2**31 - 1
    return ((patches * weights).sum(-1) % prime * 48271 % prime) % buckets


class LatentPooler(nn.Module):
    """M learned queries cross-attend to the byte features: a prompt of any length becomes M tokens.

    Two rounds of (cross-attention, self-attention), as in Perceiver: the first round's queries
    are the same for every prompt, so they can only average; the second round's queries already
    depend on the prompt and can look up what the first round found (e.g. the facts about the
    person the question names) instead of an average of all bytes.
    """

    def __init__(
        self,
        num_latents: int,
        d_z: int,
        enc_dim: int,
        heads: int,
        dropout: float,
        rounds: int = 2,
        question_queries: bool = False,
    ):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_latents, d_z) * d_z**-0.5)
        # Queries that read the question: the first round already knows whose fact it looks for. Zero
        # at first, so training starts from the plain queries.
        self.question = nn.Linear(enc_dim, d_z) if question_queries else None
        if self.question is not None:
            nn.init.zeros_(self.question.weight)
            nn.init.zeros_(self.question.bias)
        self.cross = nn.ModuleList(Block(d_z, heads, dropout, kv_dim=enc_dim) for _ in range(rounds))
        self.self_attn = nn.ModuleList(Block(d_z, heads, dropout) for _ in range(rounds))
        self.norm = nn.LayerNorm(d_z)

    def forward(
        self, feats: torch.Tensor, feat_mask: torch.Tensor, question_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        z = self.queries.expand(feats.shape[0], -1, -1)
        if self.question is not None:  # the mean of the question's features, projected onto every query
            weights = question_mask.to(feats.dtype)[..., None]
            z = z + self.question((feats * weights).sum(1) / weights.sum(1).clamp(min=1))[:, None, :]
        for cross, self_attn in zip(self.cross, self.self_attn, strict=True):
            z = self_attn(cross(z, feat_mask, kv=feats), None)  # latents are never padding: no mask
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

    num_latents: int = setting(64, "M, the number of soft tokens on the wire", gt=0, restored=True, weights=True)
    d_z: int = setting(256, "width of one wire token", gt=0, restored=True, weights=True)
    encoder_dim: int = setting(512, "width of the byte encoder", gt=0, restored=True, weights=True)
    encoder_layers: int = setting(6, "transformer layers of the byte encoder", gt=0, restored=True, weights=True)
    encoder_heads: int = setting(8, "attention heads of the byte encoder", gt=0, restored=True, weights=True)
    patch_bytes: int = setting(
        4,
        "bytes per position of the byte encoder (its attention is patch_bytes^2 cheaper)",
        gt=0,
        restored=True,
        weights=True,
    )
    dropout: float = setting(0.1, "dropout in the encoder and adapters", ge=0, lt=1)
    # Each word starts a patch (data.Collator pads the patch before it): a word's bytes fill the
    # same slots of the same patches wherever it sits in the prompt.
    word_patches: bool = setting(
        False,
        "start every word (a space or newline and the bytes up to the next) at a patch "
        "of the byte encoder, padding the patch before it, so a word is patched the "
        "same wherever it sits",
    )
    patch_mlp: bool = setting(
        False,
        "the byte encoder reads a patch's bytes jointly (a GELU MLP) instead of as a sum of per-slot codes (linear)",
        restored=True,
        weights=True,
    )
    patch_hash_buckets: int = setting(
        0,
        "rows of a code per byte-encoder patch as a whole, looked up by a hash of "
        "its bytes and added to the patch embedding (0: none)",
        ge=0,
        restored=True,
        weights=True,
        since=4,
        before=0,
    )
    question_queries: bool = setting(
        False,
        "the latent pooler's queries start from a projection of the prompt's "
        "question (its first line) as the byte encoder reads it",
        restored=True,
        weights=True,
        since=4,
        before=False,
    )

    @property
    def word_patch(self) -> int:
        """The collator's word alignment: patch_bytes with word_patches, else 0 (none)."""
        return self.patch_bytes if self.word_patches and self.patch_bytes > 1 else 0


class WireEncoder(nn.Module):
    """Everything that trains: prompt bytes -> the wire -> soft tokens for each LLM."""

    def __init__(self, wire: WireConfig, llm_dims: dict[str, tuple[int, float]]):
        """`llm_dims` maps an LLM's name to (hidden size, input-embedding RMS)."""
        super().__init__()
        self.encoder = ByteEncoder(
            wire.encoder_dim,
            wire.encoder_layers,
            wire.encoder_heads,
            wire.patch_bytes,
            wire.dropout,
            wire.patch_mlp,
            wire.patch_hash_buckets,
        )
        self.pooler = LatentPooler(
            wire.num_latents,
            wire.d_z,
            wire.encoder_dim,
            wire.encoder_heads,
            wire.dropout,
            question_queries=wire.question_queries,
        )
        self.adapters = nn.ModuleDict(
            {name: Adapter(wire.d_z, hidden, rms, wire.dropout) for name, (hidden, rms) in llm_dims.items()}
        )

    @classmethod
    def for_llms(cls, wire: WireConfig, llms: dict) -> WireEncoder:
        """One adapter per frozen LLM, into its hidden size and at its embedding table's RMS."""
        return cls(wire, {name: (llm.hidden_size, llm.embed_rms()) for name, llm in llms.items()})

    def wire(self, byte_ids: torch.Tensor, byte_mask: torch.Tensor) -> torch.Tensor:
        feats, feat_mask = self.encoder(byte_ids, byte_mask)
        if self.pooler.question is None:
            return self.pooler(feats, feat_mask)
        return self.pooler(feats, feat_mask, self.question_patches(byte_ids, byte_mask))

    def question_patches(self, byte_ids: torch.Tensor, byte_mask: torch.Tensor) -> torch.Tensor:
        """The encoder's patches of the prompt's first line, its question (dataset.prompt_text)."""
        return self.encoder.patch_mask(byte_mask & ((byte_ids == NEWLINE).cumsum(1) == 0))

    def forward(self, byte_ids: torch.Tensor, byte_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.wire(byte_ids, byte_mask)
        return {name: adapter(z) for name, adapter in self.adapters.items()}


def count_parameters(module: nn.Module, trainable: bool) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad == trainable)
