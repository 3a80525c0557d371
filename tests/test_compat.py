"""The transformers internals hf_specdiff relies on (hf_specdiff/_compat.py), checked on the installed version."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from hf_specdiff import _compat


def test_installed_transformers_is_in_the_supported_range():
    # Fails loudly on an untested transformers: re-check the facts in _compat.py, then widen the range.
    _compat.check_transformers_version()


def test_out_of_range_versions_are_refused(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", Version("5.30.0"))
    with pytest.raises(ImportError, match="supports transformers"):
        _compat.check_transformers_version()


def test_negative_crop_removes_tokens():
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 7, 4), torch.zeros(1, 2, 7, 4), 0)
    _compat.crop_cache(cache, 3)
    assert cache.get_seq_length() == 4
    _compat.crop_cache(cache, 0)
    assert cache.get_seq_length() == 4


def test_cache_argument_name_matches_forward_signature():
    import inspect

    name = next(iter(_compat.cache_kwargs(LlamaForCausalLM.__new__(LlamaForCausalLM), None)))
    assert name in inspect.signature(LlamaForCausalLM.forward).parameters


def test_generate_output_has_the_cache_field():
    import dataclasses

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    assert _compat.generate_output_cache_field() in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}


def test_auto_compile_rule_is_reachable():
    from transformers import GenerationConfig, LlamaConfig, StaticCache

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    cache = StaticCache(config=model.config, max_cache_len=8)
    assert not _compat.forward_compiled(model, GenerationConfig(), cache)  # CPU: transformers does not compile
    forced = GenerationConfig(compile_config=_compat.compile_config_for_all_devices())
    assert _compat.forward_compiled(model, forced, cache)
    assert not _compat.forward_compiled(model, forced, DynamicCache())


@pytest.mark.parametrize("repeated", [False, True], ids=["grouped-read", "repeated-heads"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_grouped_query_attention_equals_attention_over_shared_heads(mask_kind, repeated, monkeypatch):
    # Query head h reads key/value head h // 3, as SDPA's enable_gqa does, whichever way the kernel gets the heads
    # (repeated: what CUDA runs under a mask, forced here on the CPU).
    from hf_specdiff import _attention

    monkeypatch.setattr(_attention, "repeats_heads_under_a_mask", lambda device: repeated)

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 5, 8, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(2, 2, 7, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(2, 1, 5, 7, generator=generator) < 0.7
    allowed[..., 0] = True  # every query sees something
    mask = {None: None, "bool": allowed, "additive": torch.zeros(allowed.shape, dtype=torch.float64)
            .masked_fill(~allowed, float("-inf"))}[mask_kind]
    scores = query @ key.repeat_interleave(3, dim=1).transpose(-1, -2) / 8 ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    expected = scores.softmax(-1) @ value.repeat_interleave(3, dim=1)
    torch.testing.assert_close(_attention.grouped_query_attention(query, key, value, mask), expected)
    with pytest.raises(ValueError, match="cannot share"):
        _attention.grouped_query_attention(query[:, :5], key, value, mask)
