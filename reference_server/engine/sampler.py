"""Next-token choice for the sequences that sample this step, from one `[B, vocab]` logits tensor.

greedy (temperature 0): argmax. Otherwise: logits / temperature → keep the top_k largest →
keep the smallest set whose probability reaches top_p (nucleus) → sample with the request's
`torch.Generator` (seeded per request when it gives `seed`, so a seed reproduces its output).
Rows with neither seed nor filter (what a client that names only a temperature, or nothing,
gets) are drawn together: one softmax and one multinomial for all of them.
The one `.tolist()` at the end is the step's only host sync.

Each sampled row is its own: a row whose sampling raises (a NaN that reached it) gets `FAULT_ID`,
and after the sync one min/max over the ids turns any id outside the vocabulary into `FAULT_ID`,
so the scheduler fails that request alone and the rest of the step goes on.
"""

from __future__ import annotations

import torch

from phaselens.reference_server.engine.sequence import FAULT_ID, Sequence


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
        vocab = logits.shape[-1]
        plain: list[int] = []
        filtered: list[int] = []  # seeded, top-k or top-p: one row at a time
        for row, seq in enumerate(seqs):
            if _plain(seq, vocab):
                plain.append(row)
            elif not seq.params.greedy:
                filtered.append(row)
        if plain:
            self._sample_plain(logits, ids, plain, seqs)
        for row in filtered:
            self._sample_one(logits, ids, row, seqs[row])
        sampled = ids.tolist()
        if sampled and (min(sampled) < 0 or max(sampled) >= vocab):
            return [i if 0 <= i < vocab else FAULT_ID for i in sampled]
        return sampled

    def _sample_plain(self, logits: torch.Tensor, ids: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """The plain rows in one draw from the default generator, an exponential race:

            p = softmax(logits / T) per row;  id = argmax_i p_i / E_i,  E_i = −ln U_i ~ Exp(1)

        picks i with probability p_i, as torch.multinomial does, at a quarter of its CPU (8 rows of
        the tiny Llama's 347: ~40 µs against ~150). A row with a non-finite probability (a NaN
        that reached it) gets FAULT_ID: its request fails alone."""
        every = len(rows) == len(seqs)  # the usual case: no gather, no scatter
        index = slice(None) if every else torch.tensor(rows, device=logits.device)
        temperatures = {seqs[row].params.temperature for row in rows}
        scale = (
            temperatures.pop()
            if len(temperatures) == 1
            else torch.tensor([seqs[row].params.temperature for row in rows], device=logits.device)[:, None]
        )
        probs = (logits[index] / scale).softmax(-1)
        exp_draws = torch.rand(probs.shape, generator=self._default, device=probs.device).log_().neg_()
        ids[index] = torch.where(probs.isfinite().all(-1), (probs / exp_draws).argmax(-1), FAULT_ID)

    def _sample_one(self, logits: torch.Tensor, ids: torch.Tensor, row: int, seq: Sequence) -> None:
        try:
            ids[row] = self._sample_row(logits[row], seq)
        except RuntimeError:  # e.g. torch.multinomial on NaN probabilities: this row's fault
            ids[row] = FAULT_ID

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


def _plain(seq: Sequence, vocab: int) -> bool:
    """Sampled with temperature alone, from the default generator (no seed, no top-k or top-p)."""
    params = seq.params
    return not params.greedy and seq.generator is None and not 0 < params.top_k < vocab and params.top_p >= 1.0
