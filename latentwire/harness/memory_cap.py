"""A smaller card's memory on a bigger card: a run on a CUDA card with more memory than its
profile's `memory_gb` holds itself to that figure, so that a profile written for an 80 GB H100 runs
out of memory on a 141 GB H200 where the H100 would (profile field `cap_memory`, on by default).

train.py makes the call, `torch.cuda.set_per_process_memory_fraction(fraction, device)`, with the
device named (a single process never calls `set_device`); `memory_fraction` decides it from the
card's figures. The caching allocator then refuses to reserve more than the fraction of the card,
the cuBLAS workspaces included (they come from the allocator), and near that line it frees its
cached blocks and retries before it gives up: slower steps, which metrics.jsonl's
`alloc_retries` counts. What the driver holds outside the allocator (the CUDA context, its loaded
kernels) is not under the cap: the memory in use outside the allocator when the cap is set is
taken off it, as a card of the profile's size holds the same context; the kernels the driver
loads later come on top, as they do on that card.
"""

from __future__ import annotations

import torch

GIB = 2**30
# Within this share of the profile's figure the card is the profile's own: profiles give memory_gb to
# a tenth, and the same card's reported memory moves by a few hundred MiB with the driver.
SAME_CARD = 0.01


def card_memory(device: torch.device) -> tuple[int, int]:
    """(the card's memory, what is in use outside the caching allocator) in bytes; (0, 0) off CUDA."""
    if device.type != "cuda":
        return 0, 0
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free - torch.cuda.memory_reserved(device)


def memory_fraction(
    total_bytes: int, outside_bytes: int, memory_gb: float, enabled: bool, device_type: str
) -> tuple[float | None, str | None]:
    """The fraction of the card that `set_per_process_memory_fraction` holds the run to, or None,
    and what the run's opening lines say of it (None: nothing to say)."""
    if device_type != "cuda":
        return None, None
    card, profile = total_bytes / GIB, memory_gb
    if card <= profile * (1 + SAME_CARD):
        if card < profile * (1 - SAME_CARD):
            return None, (
                f"note: this card has {card:.1f} GiB, less than the profile's memory_gb {profile:g}: "
                "the profile's micro-batch may not fit"
            )
        return None, None
    if not enabled:
        return None, (
            f"memory: the whole card, {card:.1f} GiB (--cap-memory false; the profile is written for {profile:g} GiB)"
        )
    fraction = (profile * GIB - outside_bytes) / total_bytes
    return fraction, (
        f"memory: held to the profile's memory_gb {profile:g} of this card's {card:.1f} GiB "
        f"(set_per_process_memory_fraction {fraction:.4f}, {outside_bytes / GIB:.2f} GiB already "
        "held outside the allocator; --cap-memory false lifts it)"
    )
