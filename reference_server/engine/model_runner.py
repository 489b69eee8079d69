"""Runs one scheduled batch through the model as a single packed forward and samples.

Inputs of a step (built on the host from plain lists, one transfer each):
    input_ids, positions  [N]      the new tokens of every scheduled sequence, back to back
    slot_mapping          [N]      slot = block_table[pos // block_size] · block_size + pos % block_size
    logits_to_keep        [B_s]    packed index of the last token of each sequence that samples
"""

from __future__ import annotations

import torch

from phaselens.reference_server.engine import kv_cache, model_loader
from phaselens.reference_server.engine.config import EngineConfig
from phaselens.reference_server.engine.kv_cache import DecodeGroup, PagedKVCache, PrefillSpan, StepLayout
from phaselens.reference_server.engine.llama_forward import LlamaForward
from phaselens.reference_server.engine.sampler import Sampler
from phaselens.reference_server.engine.scheduler import Batch

SMALL_MODEL_PARAMS = 10_000_000  # below this, one intra-op thread (set_cpu_threads)


def set_cpu_threads(config: EngineConfig, num_params: int) -> None:
    """A small model's ops are too small to split: extra intra-op threads only spin and, on a busy
    machine, slow every step many-fold (the tiny Llama saved as a folder: 9.4 ms of CPU per output
    token on 2 threads, 0.25–0.34 ms on 1). So `cpu_threads` 0 means 1 thread below SMALL_MODEL_PARAMS
    parameters (the built-in `tiny` or a folder alike), torch's default above. Process-wide, as
    torch's setting is."""
    threads = config.cpu_threads or (1 if num_params < SMALL_MODEL_PARAMS else 0)
    if config.device == "cpu" and threads:
        torch.set_num_threads(threads)


DECODE_GROUP = 8  # decodes sorted by length, attended in groups: padding stays within similar lengths


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: model_loader.LoadedModel | None = None) -> None:
        self.loaded = loaded or model_loader.load(config.model, config.dtype, config.device, config.seed)
        model = self.loaded.model
        set_cpu_threads(config, sum(p.numel() for p in model.parameters()))
        self.model = model
        self.device = next(model.parameters()).device
        self.block_size = config.block_size
        self.max_model_len = min(self.loaded.max_context, config.num_kv_blocks * config.block_size)
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = PagedKVCache(
            cfg.num_hidden_layers,
            config.num_kv_blocks,
            config.block_size,
            kv_heads,
            head_dim,
            next(model.parameters()).dtype,
            self.device,
        )
        self.sampler = Sampler(self.loaded.suppressed_ids, self.device, config.seed)
        self.lean = LlamaForward.for_model(model, self.max_model_len)
        self.fault_token_id = config.fault_token_id

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def generator_for(self, seed: int | None) -> torch.Generator | None:
        return self.sampler.generator_for(seed)

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        """Forward the batch; return the sampled ids of the sequences that sample, in batch order."""
        input_ids, positions, keep, layout = self._prepare(batch)
        logits = self.forward(input_ids, positions, keep, layout)
        return self.sampler.sample(logits, [i.seq for i in batch.items if i.samples])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, layout: StepLayout):
        """Logits `[B, vocab]` of the `keep` rows: the lean forward where the model has one
        (llama_forward), else the model's own with the paged attention plugged in."""
        if self.lean is not None:
            return self.lean(input_ids, positions, keep, self.cache, layout)
        self.cache.layout = layout
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            cache=self.cache,
            logits_to_keep=keep,
            **{kv_cache.LAYOUT_KWARG: layout},
        )
        self.cache.layout = None
        return out.logits[0]

    def _prepare(self, batch: Batch):
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        decodes: list[tuple[int, list[int], int]] = []  # (packed row, blocks, context length)
        layout = StepLayout(slot_mapping=None)
        for item in batch.items:
            seq, start = item.seq, item.seq.num_computed
            row, end = len(ids), start + item.num_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += (seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                keep.append(len(ids) - 1)
            if item.prefill:
                layout.prefills.append(self._prefill_span(row, start, end, seq.block_table))
            else:
                decodes.append((row, seq.block_table, end))
        if self.fault_token_id >= 0 and self.fault_token_id in ids:  # the tests' seam (EngineConfig)
            raise RuntimeError(f"forced fault: token {self.fault_token_id} in the batch")
        layout.slot_mapping = self._tensor(slots)
        decodes.sort(key=lambda d: d[2])
        layout.decodes = [
            self._decode_group(decodes[i : i + DECODE_GROUP]) for i in range(0, len(decodes), DECODE_GROUP)
        ]
        return self._tensor(ids), self._tensor(positions), self._tensor(keep), layout

    def _prefill_span(self, row: int, start: int, end: int, block_table: list[int]) -> PrefillSpan:
        """Chunk queries at positions [start, end) see keys at positions ≤ their own."""
        blocks = self._tensor(block_table[: -(-end // self.block_size)])
        q_pos = torch.arange(start, end, device=self.device)[:, None]
        mask = torch.arange(end, device=self.device)[None, :] <= q_pos
        return PrefillSpan(q_start=row, q_end=row + end - start, blocks=blocks, ctx_len=end, mask=mask)

    def _decode_group(self, decodes: list[tuple[int, list[int], int]]) -> DecodeGroup:
        """Each decode of the group reads a context padded to `width` blocks; the padding is masked."""
        width = max(-(-length // self.block_size) for _, _, length in decodes)
        pad = self.cache.pad_block
        tables = [blocks[:width] + [pad] * (width - len(blocks[:width])) for _, blocks, _ in decodes]
        lengths = self._tensor([length for _, _, length in decodes])
        key_pos = torch.arange(width * self.block_size, device=self.device)
        bias = torch.zeros(len(decodes), width * self.block_size, device=self.device)
        bias.masked_fill_(key_pos[None, :] >= lengths[:, None], float("-inf"))
        return DecodeGroup(
            rows=self._tensor([row for row, _, _ in decodes]),
            blocks=self._tensor(tables).flatten(),
            bias=bias[:, None, :],
        )

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
