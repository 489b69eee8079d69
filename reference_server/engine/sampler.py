"""Next-token choice for the sequences that sample this step, from one `[B, vocab]` logits tensor.

greedy (temperature 0): argmax. Otherwise: logits / temperature → keep the top_k largest →
keep the smallest set whose probability reaches top_p (nucleus) → sample with the request's
`torch.Generator` (seeded per request when it gives `seed`, so a seed reproduces its output).
The one `.tolist()` at the end is the step's only host sync.
"""

from __future__ import annotations

import torch

from phaselens.reference_server.engine.sequence import Sequence


class Sampler:
    def __init__(self, suppressed_ids: tuple[int, ...], device: torch.device, seed: int) -> None:
        self._suppressed = torch.tensor(suppressed_ids, dtype=torch.long, device=device) if suppressed_ids else None
        self._default = torch.Generator(device=device).manual_seed(seed)
        self._device = device

    def generator_for(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(device=self._device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = logits.float()
        if self._suppressed is not None:
            logits[:, self._suppressed] = float("-inf")
        ids = logits.argmax(dim=-1)
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                ids[row] = self._sample_row(logits[row], seq)
        return ids.tolist()

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        params = seq.params
        row = row / params.temperature
        if 0 < params.top_k < row.numel():
            kth = torch.topk(row, params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > params.top_p  # mass before this token already reaches top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        return torch.multinomial(probs, 1, generator=seq.generator or self._default)[0]
