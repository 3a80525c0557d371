"""`cache_implementation="static"`: a static target cache, fixed-width verify forwards, a static drafter cache, and
(where transformers compiles plain decoding) the verify forward, draft step and Jacobi refinement compiled.

The invariants: the same tokens as plain greedy `generate` and as the dynamic-cache loop (same accepted lengths);
the unrolled, sync-free refinement that gets compiled equals `jacobi_refine`; and a compiled run compiles once,
whatever the prompt length. The sampled static path is in tests/test_sampling.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, make_speculator, make_successor_target, make_target, require_cpu_compiler

from transformers import StaticCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_specdiff
from hf_specdiff import _compat
from hf_specdiff.candidates import DraftPicker
from hf_specdiff.xpress import jacobi_refine, jacobi_refine_unrolled


def prompts(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for i in range(count):
        length = int(torch.randint(1, 30, (1,), generator=generator))
        yield i, torch.randint(1, VOCAB, (1, length), generator=generator)


WARPERS = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)])


def left_to_right(refiner, logits, hidden, anchors) -> torch.LongTensor:
    """The greedy block picked slot by slot, each against the picks before it: the refinement's fixed point."""
    context = refiner.block_context(hidden)[:, : logits.shape[1] + 1]
    tokens = logits.argmax(dim=-1)
    for slot in range(logits.shape[1]):
        bias = refiner(context, torch.cat([anchors, tokens[:, :-1]], dim=1))
        tokens[:, slot] = (logits + bias)[:, slot].argmax(dim=-1)
    return tokens


@pytest.mark.parametrize("do_sample,processors", [(False, None), (True, None), (True, WARPERS)])
def test_unrolled_refinement_equals_jacobi_refine(do_sample, processors):
    """Same tokens, same q, same pass count, including blocks that reach their fixed point before K passes; with
    position-free warpers applied the way `DraftPicker` applies them. `jacobi_refine` reads out only the slots after
    the first one that the last pass changed and keeps the others' logits, the unrolled one reads out every slot at
    every pass: blocks of three or more passes check that the kept logits are the ones a pass would recompute."""
    target = make_successor_target()
    refiner = make_speculator(target, oracle=True).refiner
    block = refiner.config.block_size
    generator = torch.Generator().manual_seed(0)
    early = deep = 0
    for trial in range(20):
        num_passes = [1, 3, 2 * block][trial % 3]
        logits = torch.randn(2, block - 1, VOCAB, generator=generator)
        hidden = torch.randn(2, block, refiner.config.hidden_size, generator=generator).to(refiner.dtype)
        anchors = torch.randint(0, VOCAB, (2, 2), generator=generator)
        if trial % 2:  # a drafter that already picks most of the fixed point: the refinement stops early
            settled = F.one_hot(left_to_right(refiner, logits, hidden, anchors), VOCAB)
            logits = logits + 20.0 * settled * (torch.rand(2, block - 1, 1, generator=generator) < 0.7)
        picker = DraftPicker(processors, do_sample)
        picker.start_block(anchors, block - 1, VOCAB)
        tokens, q, passes = jacobi_refine(refiner, logits, hidden, anchors, picker, num_passes)
        warp = picker.warp if processors else None
        unrolled = jacobi_refine_unrolled(refiner, logits, hidden, anchors, num_passes, picker.gumbel, warp)
        assert torch.equal(unrolled[0], tokens)
        assert torch.equal(unrolled[1], q)
        assert int(unrolled[2]) == passes
        early += passes < min(num_passes, block - 1)  # n = B - 1 slots are settled after n passes at most
        deep += passes >= 3
    assert early, "some blocks should converge before K passes"
    assert deep, "some blocks should need three passes or more"


def test_refinement_follows_the_rows_still_decoding():
    """`decoding` leaves out rows whose blocks are refined but never offered (a static batch's finished rows): the
    passes run, and the tokens of the rows it keeps, are those of refining those rows alone, eager and unrolled. Row 0's
    drafter already picks its fixed point (one pass); row 1's random block needs more, which without the mask would
    keep the refinement going and count in its passes."""
    target = make_successor_target()
    refiner = make_speculator(target, oracle=True).refiner
    block = refiner.config.block_size
    generator = torch.Generator().manual_seed(2)
    decoding = torch.tensor([True, False])
    longer = 0
    for _ in range(10):
        logits = torch.randn(2, block - 1, VOCAB, generator=generator)
        hidden = torch.randn(2, block, refiner.config.hidden_size, generator=generator).to(refiner.dtype)
        anchors = torch.randint(0, VOCAB, (2, 2), generator=generator)
        logits[0] += 20.0 * F.one_hot(left_to_right(refiner, logits, hidden, anchors), VOCAB)[0]
        pickers = [DraftPicker(None, False) for _ in range(3)]
        for picker, rows in zip(pickers, (anchors[:1], anchors, anchors)):
            picker.start_block(rows, block - 1, VOCAB)
        alone, _, alone_passes = jacobi_refine(refiner, logits[:1], hidden[:1], anchors[:1], pickers[0], 2 * block)
        tokens, _, passes = jacobi_refine(refiner, logits, hidden, anchors, pickers[1], 2 * block, decoding=decoding)
        assert passes == alone_passes and torch.equal(tokens[:1], alone)
        unrolled, _, unrolled_passes = jacobi_refine_unrolled(refiner, logits, hidden, anchors, 2 * block,
                                                              decoding=decoding)
        assert int(unrolled_passes) == passes and torch.equal(unrolled[:1], alone)
        longer += jacobi_refine(refiner, logits, hidden, anchors, pickers[2], 2 * block)[2] > passes
    assert longer, "row 1 should keep an unmasked refinement going longer"


def test_refinement_of_n_slots_is_their_left_to_right_decoding_after_at_most_n_passes():
    """Pass p settles slot p, so `jacobi_refine` and the unrolled refinement run at most n passes for n drafted slots,
    however large K, and return the block as picked slot by slot, each against the picks before it (the fixed point
    that any number of further passes keeps). Negative control: n - 1 passes leave some blocks unsettled."""
    target = make_successor_target()
    refiner = make_speculator(target, oracle=True).refiner
    block = refiner.config.block_size
    generator = torch.Generator().manual_seed(1)
    unsettled = 0
    for trial in range(12):
        n = [1, 3, block - 1][trial % 3]
        logits = torch.randn(2, n, VOCAB, generator=generator)
        hidden = torch.randn(2, block, refiner.config.hidden_size, generator=generator).to(refiner.dtype)
        anchors = torch.randint(0, VOCAB, (2, 2), generator=generator)
        expected = left_to_right(refiner, logits, hidden, anchors)
        picker = DraftPicker(None, False)
        picker.start_block(anchors, n, VOCAB)
        tokens, _, passes = jacobi_refine(refiner, logits, hidden, anchors, picker, 2 * block)
        assert torch.equal(tokens, expected) and passes <= n
        unrolled_tokens, _, unrolled_passes = jacobi_refine_unrolled(refiner, logits, hidden, anchors, 2 * block)
        assert torch.equal(unrolled_tokens, expected) and int(unrolled_passes) == passes
        if n > 1:
            fewer, _, _ = jacobi_refine(refiner, logits, hidden, anchors, picker, n - 1)
            unsettled += not torch.equal(fewer, expected)
    assert unsettled, "some blocks should need all n passes"


def run(target, speculator, method, prompt, **kwargs):
    kwargs.setdefault("do_sample", False)
    return target.generate(prompt, assistant_model=speculator, speculation=method, return_dict_in_generate=True,
                           **kwargs)


@pytest.mark.parametrize("method", ["xpress", "dflash", "markov"])
def test_static_cache_greedy_equals_plain_and_dynamic(method):
    """Long accepted runs (oracle add-ons on a successor target) and budgets that end inside a block, so that the
    last verify forwards are padded to the block width."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    for i, prompt in prompts(20):
        budget = dict(max_new_tokens=5 + 7 * (i % 6))
        plain = target.generate(prompt, do_sample=False, **budget)
        dynamic = run(target, speculator, method, prompt, **budget)
        static = run(target, speculator, method, prompt, cache_implementation="static", **budget)
        assert torch.equal(static.sequences, plain)
        assert static.speculation.accepted_lengths == dynamic.speculation.accepted_lengths
        assert static.speculation.refine_passes == dynamic.speculation.refine_passes
        # both caches are handed back as plain generate's: every token but the last
        field = _compat.generate_output_cache_field()
        assert isinstance(getattr(static, field), StaticCache)
        assert int(getattr(static, field).get_seq_length()) == plain.shape[1] - 1
        assert getattr(dynamic, field).get_seq_length() == plain.shape[1] - 1


@pytest.mark.parametrize("cache", [None, "static"])
def test_the_prefill_reads_out_the_last_position_only(cache):
    """As plain decoding's prefill: logits for every position of a long prompt would cost prompt x vocab floats (the
    static loop's prefill asked for them all)."""
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    widths = []
    target.register_forward_hook(lambda module, args, output: widths.append(output.logits.shape[1]))
    prompt = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=6, cache_implementation=cache)
    assert widths[0] == 1
    widths.clear()
    out = target.generate(prompt, do_sample=False, max_new_tokens=6, cache_implementation=cache,
                          assistant_model=speculator, speculation="xpress")
    assert torch.equal(out, plain) and widths[0] == 1 and len(widths) > 1


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_static_cache_on_a_sliding_window_target(family):
    """A window (5) shorter than a block: the static cache keeps every slot in every layer (a roll-back needs the
    slots a ring buffer would overwrite) and transformers' masks apply the windows; plain greedy's tokens, and the
    dynamic loop's accepted lengths."""
    import transformers
    from test_batched import SLIDING_TARGETS

    config_name, model_name, fields = SLIDING_TARGETS[family]
    target = hf_specdiff.enable(make_successor_target(
        config_class=getattr(transformers, config_name), model_class=getattr(transformers, model_name),
        num_layers=len(fields.get("layer_types", [None] * 3)), **fields,
    ))
    speculator = make_speculator(target, oracle=True)
    taus = []
    for i, prompt in prompts(8, seed=3):
        budget = dict(max_new_tokens=12 + 5 * (i % 4))
        plain = target.generate(prompt, do_sample=False, **budget)
        dynamic = run(target, speculator, "xpress", prompt, **budget)
        static = run(target, speculator, "xpress", prompt, cache_implementation="static", **budget)
        assert torch.equal(static.sequences, plain)
        assert static.speculation.accepted_lengths == dynamic.speculation.accepted_lengths
        taus.append(static.speculation.tau)
    assert sum(taus) / len(taus) > 1.5, "the oracle should get runs accepted across the windows"
    field = _compat.generate_output_cache_field()
    assert not any(getattr(static, field).is_sliding)


@pytest.mark.slow
def test_compiled_static_decoding_on_a_sliding_window_target():
    """Gemma 3 (sliding and full layers, window 5) through torch.compile: plain greedy's tokens, no recompile for a
    prompt of another length."""
    require_cpu_compiler()
    import transformers
    from test_batched import SLIDING_TARGETS

    config_name, model_name, fields = SLIDING_TARGETS["gemma3"]
    target = hf_specdiff.enable(make_successor_target(
        dtype=torch.float32, config_class=getattr(transformers, config_name),
        model_class=getattr(transformers, model_name), num_layers=len(fields["layer_types"]), **fields,
    ))
    speculator = make_speculator(target, oracle=True).to(dtype=torch.float32)
    compile_kwargs = dict(cache_implementation="static", max_cache_len=96,
                          compile_config=_compat.compile_config_for_all_devices())
    torch._dynamo.reset()
    for i, (_, prompt) in enumerate(prompts(2, seed=2)):  # 25 and 2 tokens
        plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled = run(target, speculator, "xpress", prompt, max_new_tokens=40, **compile_kwargs)
        assert torch.equal(compiled.sequences, plain)
        assert compiled.speculation.tau > 2.0


def test_static_caches_are_reused_across_calls_and_emptied():
    """A second call reuses the target's and the drafter's static caches (a compiled forward under CUDA graphs reads
    them at fixed addresses), emptied: it decodes what a fresh cache decodes. Another dtype gets new ones."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    field = _compat.generate_output_cache_field()
    options = dict(cache_implementation="static", max_cache_len=80, max_new_tokens=30)
    (_, first), (_, second) = prompts(2, seed=4)
    out = run(target, speculator, "xpress", first, **options)
    cache = getattr(out, field)
    drafter_cache = _compat._reused_static_caches.by_owner[speculator.drafter][1]
    keys = cache.layers[0].keys.data_ptr()
    for prompt in (second, first):
        again = run(target, speculator, "xpress", prompt, **options)
        assert getattr(again, field) is cache and cache.layers[0].keys.data_ptr() == keys
        assert _compat._reused_static_caches.by_owner[speculator.drafter][1] is drafter_cache
        assert torch.equal(again.sequences, target.generate(prompt, do_sample=False, max_new_tokens=30))
    assert torch.equal(again.sequences, out.sequences)
    target.to(torch.float32), speculator.to(torch.float32)
    other = run(target, speculator, "xpress", first, **options)
    assert getattr(other, field) is not cache and getattr(other, field).layers[0].keys.dtype == torch.float32
    assert torch.equal(other.sequences, out.sequences)


@pytest.mark.parametrize("first, then", [("inference_mode", "plain"), ("autocast", "plain"), ("plain", "autocast")],
                         ids=["inference-mode-then-not", "autocast-then-not", "not-then-autocast"])
def test_a_kept_static_cache_is_only_reused_by_a_call_it_suits(first, then):
    """A static call under `torch.inference_mode()` or bf16 autocast leaves caches whose tensors a later call in
    another mode cannot write (inference tensors; bf16 keys into a float32 cache): that call gets new caches and
    decodes as plain `generate` does in its mode, as plain static `generate` itself does."""
    import contextlib

    modes = {"plain": contextlib.nullcontext, "inference_mode": torch.inference_mode,
             "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    target = hf_specdiff.enable(make_successor_target(dtype=torch.float32))
    speculator = make_speculator(target, oracle=True).to(dtype=torch.float32)
    (_, prompt), = prompts(1, seed=5)
    options = dict(cache_implementation="static", max_new_tokens=24)
    try:
        for mode in (first, then):
            with modes[mode]():
                plain = target.generate(prompt, do_sample=False, **options)
    except RuntimeError as error:  # 5.17 sizes a static cache in the model's dtype, and autocast's keys then fail
        pytest.skip(f"plain static generate fails in these modes too, with this transformers: {error}")
    with modes[first]():
        run(target, speculator, "xpress", prompt, **options)
    with modes[then]():
        out = run(target, speculator, "xpress", prompt, **options)
    assert torch.equal(out.sequences, plain)


def test_threads_do_not_share_a_kept_static_cache():
    """Two threads decoding with one model at once must not write one cache: each thread keeps its own (and a thread
    reuses its own across calls)."""
    import threading

    target = make_successor_target()
    config = target.config.get_text_config(decoder=True)
    here = _compat.reused_static_cache(target, config, 64)
    assert _compat.reused_static_cache(target, config, 64) is here
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(_compat.reused_static_cache(target, config, 64)))
    thread.start(), thread.join()
    assert elsewhere and elsewhere[0] is not here


@pytest.mark.slow
def test_compiled_static_decoding_is_lossless_and_compiles_once():
    """torch.compile on the CPU (as `compile_config._compile_all_devices` allows): the compiled verify forward, draft
    step and refinement give plain greedy's tokens, and a second prompt of another length recompiles nothing."""
    require_cpu_compiler()
    target = hf_specdiff.enable(make_successor_target(dtype=torch.float32))
    speculator = make_speculator(target, oracle=True).to(dtype=torch.float32)
    compile_kwargs = dict(cache_implementation="static", max_cache_len=96,
                          compile_config=_compat.compile_config_for_all_devices())
    torch._dynamo.reset()
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    for i, (_, prompt) in enumerate(prompts(3, seed=2)):  # prompts of 25, 2 and 25 tokens
        plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
        eager = run(target, speculator, "xpress", prompt, max_new_tokens=40)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled = run(target, speculator, "xpress", prompt, max_new_tokens=40, **compile_kwargs)
        assert torch.equal(compiled.sequences, plain)
        assert compiled.speculation.accepted_lengths == eager.speculation.accepted_lengths
        assert compiled.speculation.tau > 3.0, "the oracle's blocks should be accepted"
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames_before, "nothing was compiled"
    # sampled with warpers: compiled too, and a second call recompiles nothing
    for i in range(2):
        frames_before = torch._dynamo.utils.counters["frames"]["ok"]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            sampled = run(target, speculator, "xpress", prompt, max_new_tokens=40, do_sample=True, temperature=0.7,
                          top_k=20, **compile_kwargs)
        assert sampled.sequences.shape[1] == prompt.shape[1] + 40
        if i == 0:  # the refinement with the warpers is compiled on its own
            assert torch._dynamo.utils.counters["frames"]["ok"] > frames_before
    # a shorter call without max_cache_len keeps the size transformers remembers for this model: no recompile either
    compile_kwargs.pop("max_cache_len")
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(target, speculator, "xpress", prompt, max_new_tokens=20, **compile_kwargs)
    assert torch.equal(compiled.sequences, target.generate(prompt, do_sample=False, max_new_tokens=20))
    # a call past that size sizes a larger cache (one recompile); a shorter call after it keeps the larger size
    run(target, speculator, "xpress", prompt, max_new_tokens=90, **compile_kwargs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(target, speculator, "xpress", prompt, max_new_tokens=30, **compile_kwargs)
    assert torch.equal(compiled.sequences, target.generate(prompt, do_sample=False, max_new_tokens=30))


@pytest.mark.slow
def test_compiled_static_batch_is_lossless_and_compiles_once(monkeypatch):
    """A ragged batch of 4 through the compiled static loop: plain batched greedy's tokens, with rows that stop at EOS
    at different steps and stay in the batch; a second batch of the same size with other prompt lengths, and a third,
    recompile nothing (every verify forward and draft step after the first has the same shapes), with the caches
    compacted in place whenever a slot can be saved."""
    require_cpu_compiler()
    import hf_specdiff.batching
    from test_batched import count_compactions, left_pad, ragged_batches

    monkeypatch.setattr(hf_specdiff.batching, "COMPACT_WHEN_WASTED", 0.0)
    compactions = count_compactions(monkeypatch)

    target = hf_specdiff.enable(make_successor_target(dtype=torch.float32, eos_token_id=17))
    speculator = make_speculator(target, oracle=True).to(dtype=torch.float32)
    compile_kwargs = dict(cache_implementation="static", max_cache_len=96,
                          compile_config=_compat.compile_config_for_all_devices())
    torch._dynamo.reset()
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    stopped = set()
    for i, prompts in enumerate(ragged_batches(count=3, size=4, seed=5)):
        ids, mask = left_pad(prompts)
        plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
        # no dynamic shapes to fall back on: a forward or draft step seen with other shapes would recompile
        with torch._dynamo.config.patch(error_on_recompile=True, automatic_dynamic_shapes=False):
            compiled = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                                       assistant_model=speculator, speculation="xpress", **compile_kwargs)
        assert torch.equal(compiled, plain)
        stopped.update(len(row) - int((row == 17).nonzero()[0, 0]) for row in plain if (row == 17).any())
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames_before, "nothing was compiled"
    assert len(stopped) > 1, "rows should stop at EOS at different steps"
    assert any(done for done, _ in compactions), "no compaction under compile"
    # the statistics say so (the bench reads them: a batch's output carries no cache to ask transformers' rule with)
    options = dict(attention_mask=mask, max_new_tokens=8, assistant_model=speculator, speculation="xpress",
                   return_dict_in_generate=True)
    assert target.generate(ids, **options, **compile_kwargs).speculation.compiled
    assert not target.generate(ids, **options, cache_implementation="static").speculation.compiled  # a CPU


class CudaGraphOutputLifetimes:
    """Stands in for torch.compile with CUDA graphs (mode="reduce-overhead"), which the CPU cannot run: in inference
    every call of a compiled function starts a new cudagraph-tree generation, and the outputs of the call before it
    live in memory the new call may overwrite. Each call here poisons the previous call's output tensors first (NaN,
    or -1 for integers), so a caller that keeps a compiled step's output past the next compiled call reads garbage,
    as it would on a GPU."""

    def __init__(self):
        self.previous: list[torch.Tensor] = []
        self.calls = 0

    def wrap(self, function):
        def call(*args, **kwargs):
            for tensor in self.previous:
                tensor.fill_(float("nan") if tensor.is_floating_point() else -1)
            out = function(*args, **kwargs)
            self.previous, self.calls = [t for t in _tensors_of(out)], self.calls + 1
            return out
        return call


def _tensors_of(out):
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else [out]
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (t for t in value if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("method", ["xpress", "dflash", "markov"])
def test_no_compiled_output_is_read_after_the_next_compiled_call(monkeypatch, method):
    """The compiled verify forward, draft step and refinement under CUDA-graph output lifetimes (see
    CudaGraphOutputLifetimes): greedy still equals plain greedy, and sampling with warpers draws what it draws when
    outputs live on."""
    from hf_specdiff import candidates

    target = hf_specdiff.enable(make_successor_target(dtype=torch.float32))
    speculator = make_speculator(target, oracle=True).to(dtype=torch.float32)
    kwargs = dict(cache_implementation="static", max_cache_len=96,
                  compile_config=_compat.compile_config_for_all_devices())

    def decode(lifetimes, prompt, **options):
        # every torch.compile (ours and transformers' verify forward) made afresh under these lifetimes
        monkeypatch.setattr(torch, "compile", lambda function, **compile_options: lifetimes.wrap(function))
        candidates._compiled.cache_clear()
        if hasattr(target, "_compiled_call"):
            del target._compiled_call
        try:
            return run(target, speculator, method, prompt, max_new_tokens=40, **kwargs, **options).sequences
        finally:
            candidates._compiled.cache_clear()

    for _, prompt in prompts(3, seed=2):
        poisoned = CudaGraphOutputLifetimes()
        assert torch.equal(decode(poisoned, prompt), target.generate(prompt, do_sample=False, max_new_tokens=40))
        assert poisoned.calls > 3, "the compiled steps were not used"
        torch.manual_seed(0)
        sampled = decode(poisoned, prompt, do_sample=True, temperature=0.7, top_k=20)
        torch.manual_seed(0)
        kept = CudaGraphOutputLifetimes()
        kept.wrap = lambda function: function  # outputs live on
        assert torch.equal(sampled, decode(kept, prompt, do_sample=True, temperature=0.7, top_k=20))


def test_static_cache_without_compilation_on_the_cpu():
    """transformers compiles plain decoding on cuda / xpu / neuron / tpu only: on the CPU the static loop runs eagerly
    unless `compile_config._compile_all_devices` is set, and `disable_compile` always keeps it eager."""
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    prompt = torch.tensor([[5, 7, 9]])
    torch._dynamo.reset()
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    for extra in ({}, dict(compile_config=_compat.compile_config_for_all_devices(), disable_compile=True)):
        out = run(target, speculator, "xpress", prompt, max_new_tokens=8, cache_implementation="static", **extra)
        assert torch.equal(out.sequences, target.generate(prompt, do_sample=False, max_new_tokens=8))
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames_before
    # sized by transformers' own rule: a shorter call after a longer one keeps the longer size (compiled forwards
    # keep their shapes), and so does a call just as long
    sizes = []
    for max_new_tokens in (40, 12, 40):
        out = run(target, speculator, "xpress", prompt, max_new_tokens=max_new_tokens, cache_implementation="static")
        sizes.append(getattr(out, _compat.generate_output_cache_field()).get_max_length())
    assert sizes[0] == sizes[1] == sizes[2], sizes
