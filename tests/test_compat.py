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
