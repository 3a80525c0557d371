"""The embedded model's cache folder: built once, atomically, repaired when incomplete, reported when damaged, and
refused up front when it cannot be written. The real dequantization (about a minute, 540 MB) is replaced by a tiny
random Llama with a two-word tokenizer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_specdiff import embedded
from hf_specdiff.embedded import DEFAULT_TARGET_NAME, default_target_path, load_default_target


def tiny_model_and_tokenizer():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")), unk_token="<unk>")
    return LlamaForCausalLM(config), tokenizer


class Dequantizer:
    """Stands in for `embedded._dequantize`; counts calls, and can run a hook first (e.g. play the process that wins a
    race) or refuse to be called at all."""

    def __init__(self, before=None, forbidden=False):
        self.calls = 0
        self.before = before
        self.forbidden = forbidden

    def __call__(self, gguf):
        assert not self.forbidden, "the dequantizer must not run here"
        self.calls += 1
        if self.before is not None:
            self.before()
        return tiny_model_and_tokenizer()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache location (through HF_SPECDIFF_CACHE) and a GGUF that need not exist: the stub never reads it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_SPECDIFF_CACHE", str(cache))
    monkeypatch.setattr(embedded, "_gguf_path", lambda: tmp_path / "absent.gguf")
    return cache


def build(monkeypatch, cache_dir=None) -> Path:
    monkeypatch.setattr(embedded, "_dequantize", Dequantizer())
    return default_target_path(cache_dir)


def test_a_complete_folder_is_reused_without_dequantizing(cache, monkeypatch):
    folder = build(monkeypatch)
    assert folder == cache / DEFAULT_TARGET_NAME
    monkeypatch.setattr(embedded, "_dequantize", Dequantizer(forbidden=True))
    model, tokenizer = load_default_target()
    assert isinstance(model, LlamaForCausalLM) and model.config.hidden_size == 16 and len(tokenizer) == 2
    assert default_target_path() == folder


def test_an_incomplete_folder_is_rebuilt_in_place(cache, monkeypatch):
    """A folder without its weights (a user deleted them, an old version was killed) used to be returned as is after
    every dequantization, and the load then failed."""
    folder = build(monkeypatch)
    (folder / "model.safetensors").unlink()
    dequantize = Dequantizer()
    monkeypatch.setattr(embedded, "_dequantize", dequantize)
    model, _ = load_default_target()
    assert dequantize.calls == 1 and (folder / "model.safetensors").is_file()
    assert sorted(path.name for path in cache.iterdir()) == [DEFAULT_TARGET_NAME]  # no build or broken folder left
    load_default_target()
    assert dequantize.calls == 1  # repaired for good


def test_a_truncated_weights_file_says_which_folder_to_delete(cache, monkeypatch):
    folder = build(monkeypatch)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OSError, match="Delete that folder") as raised:
        load_default_target()
    assert str(folder) in str(raised.value)


def test_an_unwritable_cache_fails_before_dequantizing(tmp_path, monkeypatch):
    """Tests run as root, which chmod does not stop: a cache under a regular file is unwritable for everyone."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HF_SPECDIFF_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(embedded, "_gguf_path", lambda: tmp_path / "absent.gguf")
    monkeypatch.setattr(embedded, "_dequantize", Dequantizer(forbidden=True))
    with pytest.raises(OSError, match="HF_SPECDIFF_CACHE") as raised:
        load_default_target()
    assert str(blocker / "cache") in str(raised.value)


def test_a_concurrent_winner_is_kept_and_no_build_folder_is_left(cache, monkeypatch):
    """Another process finishes first (played by the stub, which builds the final folder before returning): its folder
    stays, ours is deleted."""
    final = cache / DEFAULT_TARGET_NAME

    def other_process_wins():
        model, tokenizer = tiny_model_and_tokenizer()
        model.save_pretrained(final)
        tokenizer.save_pretrained(final)
        (final / "winner").write_text("")

    monkeypatch.setattr(embedded, "_dequantize", Dequantizer(before=other_process_wins))
    assert default_target_path() == final
    assert (final / "winner").is_file()
    assert sorted(path.name for path in cache.iterdir()) == [DEFAULT_TARGET_NAME]
    load_default_target()


def test_an_incomplete_folder_made_meanwhile_is_replaced(cache, monkeypatch):
    """Another process left an incomplete folder while we dequantized (or an old version did): ours replaces it."""
    final = cache / DEFAULT_TARGET_NAME

    def other_process_leaves_a_broken_folder():
        final.mkdir()
        (final / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_dequantize", Dequantizer(before=other_process_leaves_a_broken_folder))
    assert default_target_path() == final
    assert (final / "model.safetensors").is_file()
    assert sorted(path.name for path in cache.iterdir()) == [DEFAULT_TARGET_NAME]


def test_a_failed_dequantization_leaves_nothing_behind(cache, monkeypatch):
    def fail(gguf):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(embedded, "_dequantize", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        default_target_path()
    assert not cache.exists() or list(cache.iterdir()) == []


def test_concurrent_first_loads_all_get_the_one_complete_folder(cache, monkeypatch):
    """Threads stand in for processes: all dequantize at once, then race to put their folder in place."""
    import threading

    racers = 4
    barrier = threading.Barrier(racers, timeout=60)
    monkeypatch.setattr(embedded, "_dequantize", Dequantizer(before=barrier.wait))
    results, errors = [], []

    def load():
        try:
            results.append(default_target_path())
        except BaseException as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and results == [cache / DEFAULT_TARGET_NAME] * racers
    assert sorted(path.name for path in cache.iterdir()) == [DEFAULT_TARGET_NAME]
    load_default_target()


def test_stale_build_folders_are_removed_and_fresh_ones_kept(cache, monkeypatch):
    """A killed run leaves 540 MB behind; a young build folder may be another process's work in progress."""
    cache.mkdir()
    stale = cache / f".{DEFAULT_TARGET_NAME}.tmp-stale"
    fresh = cache / f".{DEFAULT_TARGET_NAME}.tmp-fresh"
    old_partial = cache / f"{DEFAULT_TARGET_NAME}.partial"  # what earlier versions left
    for leftover in (stale, fresh, old_partial):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"x")
    day_ago = time.time() - 24 * 3600
    for leftover in (stale, old_partial):
        os.utime(leftover, (day_ago, day_ago))
    build(monkeypatch)
    assert not stale.exists() and not old_partial.exists() and fresh.is_dir()


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_the_cache_is_readable_by_others_as_the_umask_allows(cache, monkeypatch):
    """safetensors writes 0600 and mkdtemp makes 0700: a shared HF_SPECDIFF_CACHE would be unreadable by others."""
    previous = os.umask(0o022)
    try:
        folder = build(monkeypatch)
    finally:
        os.umask(previous)
    assert folder.stat().st_mode & 0o777 == 0o755
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name
