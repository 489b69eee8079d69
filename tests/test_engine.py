"""The engine against Hugging Face `generate()`: same greedy tokens under continuous batching,
chunked prefill, preemption by recompute and prefix-cache hits; KV accounting; observer calls."""

from __future__ import annotations

import pytest
import torch
from server_fixtures import Collected, Recorder, greedy, make_engine, reference_greedy, run_until_idle
from transformers import ByT5Tokenizer

from phaselens.instrumentation.hotpath.observer import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from phaselens.reference_server import QueueFullError, SamplingParams
from phaselens.reference_server.engine.config import POLICY_PREFILL_FIRST
from phaselens.reference_server.engine.detokenizer import TextTracker
from phaselens.reference_server.engine.sampler import Sampler
from phaselens.reference_server.engine.sequence import FAULT_ID, Sequence

TOK = ByT5Tokenizer()
PROMPTS = [
    "Hello world, this is a test of the engine.",
    "abc",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "x" * 70,
    "Continuous batching lets requests join and leave.",
]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def submit(engine, text, params, observer=None):
    sink = Collected()
    kwargs = {"observer": observer} if observer else {}
    engine.submit(ids(text), params, sink=sink, **kwargs)
    return sink


def assert_matches_generate(text: str, sink: Collected, max_tokens: int, ignore_eos: bool = False) -> None:
    expected = reference_greedy(ids(text), max_tokens, ignore_eos)
    assert sink.final is not None
    assert sink.final.output_tokens == len(expected)
    assert sink.content == TOK.decode([t for t in expected if t != 1], skip_special_tokens=True)


@pytest.mark.parametrize("policy", ["mixed", POLICY_PREFILL_FIRST])
def test_greedy_equals_generate_while_requests_join_and_leave(policy):
    engine = make_engine(max_num_batched_tokens=24, block_size=8, kv_cache_tokens=2048, policy=policy)
    lengths = [12, 30, 7, 25, 18]
    sinks = [submit(engine, PROMPTS[i], greedy(lengths[i])) for i in range(3)]
    batches = [engine.step() for _ in range(6)]  # the first three are mid-flight now
    sinks += [submit(engine, PROMPTS[i], greedy(lengths[i])) for i in (3, 4)]
    while engine.scheduler.has_work():
        batches.append(engine.step())
    for text, sink, n in zip(PROMPTS, sinks, lengths, strict=False):
        assert_matches_generate(text, sink, n)
    chunked = [i for b in batches for i in b.items if i.prefill and i.num_tokens < i.seq.num_prompt_tokens]
    assert chunked, "a prompt longer than the 24-token budget must be prefilled in chunks"
    mixed = [b for b in batches if b.prefill_tokens and b.decode_tokens]
    assert bool(mixed) == (policy == "mixed")
    assert all(b.prefill_tokens + b.decode_tokens <= 24 for b in batches)
    assert engine.scheduler.blocks.num_used == 0


def test_preemption_by_recompute_keeps_outputs_exact():
    # 10 blocks of 8 tokens = 80 tokens of KV for three sequences that need ~60 each
    engine = make_engine(block_size=8, kv_cache_tokens=80, max_num_batched_tokens=64)
    recorders = [Recorder() for _ in range(3)]
    texts = [PROMPTS[0], PROMPTS[1] * 5, PROMPTS[4]]
    sinks = [submit(engine, t, greedy(30, ignore_eos=True), r) for t, r in zip(texts, recorders, strict=False)]
    run_until_idle(engine)
    assert engine.stats.preemptions > 0
    preempted = [r for r in recorders if "preempted" in r.names()]
    assert preempted
    for r in preempted:  # a preempted request waits again, is rescheduled, and its first token comes once
        names = r.names()
        assert names.count("first_token") == 1
        assert names.index("preempted") < len(names) - 1 - names[::-1].index("scheduled")
    for text, sink in zip(texts, sinks, strict=False):
        assert_matches_generate(text, sink, 30, ignore_eos=True)
    assert engine.scheduler.blocks.num_used == 0


def test_prefix_cache_hit_reports_cached_tokens_and_stays_exact():
    engine = make_engine(block_size=8, kv_cache_tokens=1024)
    shared = PROMPTS[2]
    first = submit(engine, shared, greedy(5))
    run_until_idle(engine)
    assert first.final.cached_tokens == 0
    recorder = Recorder()
    second_text = shared + " And then?"
    second = submit(engine, second_text, greedy(12), recorder)
    run_until_idle(engine)
    cached = second.final.cached_tokens
    assert cached == (len(ids(shared)) // 8) * 8 > 0
    chunks = [c for c in recorder.calls if c[0] == "prefill_chunk"]
    assert chunks[0][2] == cached and chunks[0][1] == len(ids(second_text)) - cached
    assert_matches_generate(second_text, second, 12)


def test_observer_call_order_and_step_records():
    steps = []

    class Steps:
        def step(self, stats, requests):
            steps.append((stats, requests))

    engine = make_engine(max_num_batched_tokens=16, block_size=8)
    engine.step_observer = Steps()
    recorder = Recorder()
    sink = submit(engine, PROMPTS[0], greedy(4, ignore_eos=True), recorder)
    run_until_idle(engine)
    names = recorder.names()
    n_chunks = -(-len(ids(PROMPTS[0])) // 16)
    assert names == [
        "enqueued",
        "scheduled",
        *["prefill_chunk"] * n_chunks,
        "first_token",
        "token",
        "token",
        "token",
        "finished",
    ]
    assert recorder.calls[-1] == ("finished", FINISH_LENGTH)
    assert all(c[3] for c in recorder.calls if c[0] == "prefill_chunk")
    assert sink.final.output_tokens == 4
    stats, members = steps[0]
    assert stats.end_ts >= stats.start_ts and stats.prefill_tokens == 16 and stats.decode_tokens == 0
    assert 0 < stats.kv_blocks_used <= stats.kv_blocks_total and members == [recorder]
    assert [s.decode_tokens for s, _ in steps[-3:]] == [1, 1, 1]


def test_eos_stops_unless_ignored():
    expected = reference_greedy(ids("abc"), 64)
    assert expected[-1] == 1 and len(expected) < 64, "the fixed tiny weights end 'abc' with EOS"
    engine = make_engine()
    stopped = submit(engine, "abc", greedy(64))
    ignored = submit(engine, "abc", greedy(64, ignore_eos=True))
    run_until_idle(engine)
    assert (stopped.final.finish_reason, stopped.final.output_tokens) == (FINISH_STOP, len(expected))
    assert (ignored.final.finish_reason, ignored.final.output_tokens) == (FINISH_LENGTH, 64)
    assert ignored.content.startswith(stopped.content)


def test_stop_string_truncates_and_is_never_emitted():
    engine = make_engine()
    full = submit(engine, PROMPTS[0], greedy(40, ignore_eos=True))
    run_until_idle(engine)
    text = full.content
    stop = text[10:13]
    cut = submit(engine, PROMPTS[0], greedy(40, ignore_eos=True, stop=(stop, "never-there")))
    run_until_idle(engine)
    assert cut.final.finish_reason == FINISH_STOP
    assert cut.content == text[: text.index(stop)]


def test_sampling_seed_reproduces_and_filters_apply():
    engine = make_engine()

    def sample(**kw):
        sink = submit(engine, PROMPTS[4], SamplingParams(max_tokens=24, ignore_eos=True, **kw))
        run_until_idle(engine)
        return sink.content

    assert sample(temperature=1.0, seed=7) == sample(temperature=1.0, seed=7)
    assert sample(temperature=1.0, seed=7) != sample(temperature=1.0, seed=8)
    greedy_text = sample(temperature=0.0)
    assert sample(temperature=1.5, top_k=1, seed=3) == greedy_text
    assert sample(temperature=1.5, top_p=1e-6, seed=3) == greedy_text


def _plain_rows(temperatures: list[float]) -> list:
    """Sequences as the sampler sees them: unseeded, no top-k or top-p (one batched draw)."""
    return [
        Sequence(i, [5], 1, SamplingParams(temperature=t), TextTracker(lambda ids: ""))
        for i, t in enumerate(temperatures)
    ]


def test_unseeded_rows_are_drawn_together_by_each_rows_softmax():
    """4,000 draws of each row from fixed logits: the frequencies are softmax(logits / T) of that
    row's own temperature (a draw that ignored T, or drew one row for all, is 0.1+ off)."""
    sampler = Sampler((), torch.device("cpu"), seed=0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]] * 2))
    counts = torch.zeros(2, 3)
    rows = _plain_rows([1.0, 0.5])
    for _ in range(4000):
        counts[torch.arange(2), torch.tensor(sampler.sample(logits.clone(), rows))] += 1
    expected = torch.stack([logits[0].softmax(-1), (logits[1] / 0.5).softmax(-1)])
    assert torch.allclose(counts / 4000, expected, atol=0.025), counts / 4000


def test_a_nan_row_fails_alone_in_the_batched_draw():
    sampler = Sampler((), torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 50.0, 0.0], [float("nan")] * 3, [50.0, 0.0, 0.0]])
    assert sampler.sample(logits, _plain_rows([1.0, 1.0, 1.0])) == [1, FAULT_ID, 0]


def test_reasoning_tokens_split_the_stream():
    engine = make_engine()
    plain = submit(engine, PROMPTS[1], greedy(10, ignore_eos=True))
    split = submit(engine, PROMPTS[1], greedy(10, ignore_eos=True, reasoning_tokens=4))
    run_until_idle(engine)
    assert split.reasoning == plain.content[:4] and split.content == plain.content[4:]
    assert split.final.reasoning_tokens == 4


def test_abort_frees_kv_and_queue_bound():
    engine = make_engine(max_waiting=1, block_size=8)
    recorder = Recorder()
    sink = Collected()
    seq_id = engine.submit(ids(PROMPTS[2]), greedy(100, ignore_eos=True), recorder, sink)
    engine.step()
    engine.step()
    assert engine.scheduler.blocks.num_used > 0
    engine.submit(ids("a"), greedy(1))
    with pytest.raises(QueueFullError):
        engine.submit(ids("b"), greedy(1))
    engine.abort(seq_id)
    engine.step()
    assert sink.final.finish_reason == FINISH_ABORT and recorder.calls[-1] == ("finished", FINISH_ABORT)
    run_until_idle(engine)
    assert engine.scheduler.blocks.num_used == 0 and engine.num_running == 0


def test_step_is_schedule_run_postprocess_with_stamps_at_the_seams():
    """The scheduler has appended the token and freed a finished sequence's KV before the engine
    stamps it and hands it to the stream; the stamp comes before the text."""
    engine = make_engine(block_size=8)
    recorder = Recorder()
    seen = []
    engine.submit(
        ids(PROMPTS[0]),
        greedy(3, ignore_eos=True),
        recorder,
        sink=lambda out: seen.append((out.finish_reason, engine.scheduler.blocks.num_used, recorder.names()[-1])),
    )
    batch = engine.step()
    assert [s.seq_id for s in batch.admitted] == [1] and batch.items[0].output.new_tokens == 1
    assert recorder.names() == ["enqueued", "scheduled", "prefill_chunk", "first_token"]
    run_until_idle(engine)
    assert [(reason, stamp) for reason, _, stamp in seen] == [
        (None, "first_token"),
        (None, "token"),
        (FINISH_LENGTH, "finished"),
    ]
    assert seen[0][1] == seen[1][1] == len(ids(PROMPTS[0])) // 8 + 1 and seen[2][1] == 0


def test_too_long_request_is_refused():
    engine = make_engine(kv_cache_tokens=64, block_size=8)
    assert engine.max_model_len == 64
    with pytest.raises(ValueError):
        engine.submit(ids("y" * 60), greedy(10))


def test_detokenizer_holds_split_characters_and_stop_prefixes():
    from phaselens.reference_server.engine.detokenizer import TextTracker, decode_bytes

    e_acute = ids("é")  # two byte tokens
    tracker = TextTracker(decode_bytes)
    assert [tracker.push(t).content for t in e_acute] == ["", "é"]
    tracker = TextTracker(decode_bytes, stop=("STOP",))
    emitted = [tracker.push(t) for t in ids("abcSTxyzSTOPtail")]
    assert "".join(d.content for d in emitted) == "abcSTxyz" and emitted[-5].stopped and emitted[-6].stopped is False
    assert tracker.finish().content == ""
    tracker = TextTracker(decode_bytes, stop=("zz",))
    text = "".join(tracker.push(t).content for t in ids("abz"))
    assert text == "ab" and tracker.finish().content == "z"  # held back until the end proves it no stop


def test_local_hugging_face_folder_loads_offline_and_matches_generate(tmp_path):
    from phaselens.reference_server.engine.model_loader import build_tiny

    tiny = build_tiny()
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    engine = make_engine(model=str(tmp_path))
    assert engine.runner.loaded.name == tmp_path.name and engine.runner.loaded.eos_ids == {1}
    prompt = ids(PROMPTS[0])
    sink = Collected()
    engine.submit(prompt, greedy(20, ignore_eos=True), sink=sink)
    run_until_idle(engine)
    expected = tiny.model.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert sink.final.output_tokens == 20
    assert sink.content == TOK.decode(expected, skip_special_tokens=True)


def test_peer_benchmark_model_batched_equals_generate_on_one_thread(tmp_path):
    """The byte-level BPE tiny Llama of benchmarks/peers.py, 8 streams at once: each stream's greedy
    tokens are `generate()`'s, its text is the tokenizer's own decode of them (the Rust-backend fast
    path changes no character), and a model this small runs on one intra-op thread."""
    from phaselens.integrations.vllm.tiny_model import save_tiny_llama
    from phaselens.reference_server.engine.model_loader import load_local

    folder = save_tiny_llama(tmp_path / "model")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine(model=str(folder), max_num_seqs=8, max_num_batched_tokens=64)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    tokenizer = engine.tokenizer
    words = ["the", "time", "to", "first", "token", "is", "queue", "prefill", "decode", "of", "a", "request"]
    prompts = [tokenizer.encode(" ".join(words[i:] + words[:i]) + " é ü", add_special_tokens=False) for i in range(8)]
    sinks = [Collected() for _ in prompts]
    seq_ids = [engine.submit(p, greedy(24, ignore_eos=True), sink=s) for p, s in zip(prompts, sinks, strict=True)]
    engine._drain()
    seqs = [engine._live[i] for i in seq_ids]
    run_until_idle(engine)
    reference = load_local(str(folder), dtype="float32").model
    for prompt, seq, sink in zip(prompts, seqs, sinks, strict=True):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert seq.token_ids[len(prompt) :] == expected
        assert sink.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_tokenizer_decoder_keeps_the_wrapper_where_it_cleans_up_spaces(tmp_path):
    from phaselens.integrations.vllm.tiny_model import save_tiny_llama
    from phaselens.reference_server.engine.detokenizer import tokenizer_decoder
    from phaselens.reference_server.engine.model_loader import load_tokenizer

    tokenizer, _, _ = load_tokenizer(str(save_tiny_llama(tmp_path / "model")))
    ids_ = [*tokenizer.encode("the token , is .", add_special_tokens=False), tokenizer.eos_token_id]
    assert tokenizer_decoder(tokenizer)(ids_) == "the token , is ."  # the backend: special token skipped
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert tokenizer_decoder(tokenizer)(ids_) == "the token, is."  # the wrapper's clean-up, kept


@pytest.mark.parametrize(("model", "dtype"), [("tiny", "float32"), ("tiny", "bfloat16"), ("folder", "float32")])
def test_lean_llama_forward_gives_the_models_own_logits_bitwise(tmp_path, model, dtype):
    """Each step (chunked prefills beside decodes) runs transformers' forward and the lean one on
    the same inputs: the logits are the same bits, so greedy outputs cannot drift between them."""
    from phaselens.integrations.vllm.tiny_model import save_tiny_llama

    name = str(save_tiny_llama(tmp_path / "model")) if model == "folder" else model
    engine = make_engine(model=name, dtype=dtype, max_num_seqs=4, max_num_batched_tokens=40)
    runner, lean = engine.runner, engine.runner.lean
    assert lean is not None
    steps = []

    def both(input_ids, positions, keep, layout):
        runner.lean = None
        theirs = type(runner).forward(runner, input_ids, positions, keep, layout)
        runner.lean = lean
        ours = lean(input_ids, positions, keep, runner.cache, layout)
        steps.append((bool(layout.prefills), bool(layout.decodes), torch.equal(ours, theirs)))
        return ours

    runner.forward = both
    prompts = [[5 + i % 90 for i in range(n)] for n in (5, 37, 70)]
    for prompt in prompts:
        engine.submit(prompt, greedy(6, ignore_eos=True))
    run_until_idle(engine)
    assert (True, True, True) in steps  # a step that mixed a prefill chunk with decodes
    assert [equal for _, _, equal in steps] == [True] * len(steps)
