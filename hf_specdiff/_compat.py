"""Everything hf_specdiff needs from transformers beyond its public extension points, in one place.

Supported: transformers >= 5.17, < 5.26 (tested: 5.17, 5.24 and 5.25). `tests/test_compat.py` fails loudly outside
that range, so an upgrade shows which of these facts to re-check. Where a fact names 5.24, 5.25 behaves the same.

5.25 lists `kernels>=0.19.1` as a dependency and, with it installed, swaps some layers of a model loaded onto a GPU
for Hub kernels (RMSNorm, activations, RoPE; both plain and speculative decoding run the swapped target). The package
registry of this project's machines has no such `kernels`, so 5.25 was tested installed without it and with
`USE_HUB_KERNELS=0`, which 5.25's `from_pretrained` needs when `kernels` is missing. On a CPU no layer is swapped.

- The KV-cache argument of a model's `forward` is `past_key_values` in 5.17 and `cache` in 5.24.
- `GenerateDecoderOnlyOutput` names its cache field `past_key_values` in 5.17 and `cache` in 5.24.
- `Cache.crop(n)` with n < 0 removes |n| tokens in both; a positive n (old meaning: final length) is deprecated in
  5.17 and raises in 5.24, so we only ever pass negative counts.
- `StaticCache(config=, max_cache_len=)` builds one `StaticLayer` per full-attention layer (a ring-buffer
  `StaticSlidingWindowLayer` per sliding one, which `new_static_cache` swaps for a `StaticLayer`; a cache layer's
  `is_sliding` is what `create_sliding_window_causal_mask` sizes its mask by, the first sliding layer's else layer
  0's) in both; a layer keeps its filled length in
  a 0-d tensor `cumulative_length` (so that compiled forwards do not specialise on it) and `update` writes there.
  5.24's `StaticLayer.crop(-n)` only lowers that tensor (the next write overwrites the stale slots); 5.17's
  `StaticLayer` has no `crop`, so `crop_cache` lowers it itself, in both versions.
- `StaticCache.reset()` zeroes its tensors and `cumulative_length` in place, keeping their addresses (both); the
  speculative loop reuses its static caches that way (`generate` itself builds a new one per call in 5.17 to 5.25).
- A 4D attention mask (or a dict of them by layer type, in the models with several layer types) is used as given:
  `masking_utils._preprocess_mask_arguments` returns it unchanged (both). Batched speculation on a sliding-window
  target passes its own there, over a `DynamicCache()`, which without a config makes full `DynamicLayer`s (both);
  with layers keeping a state too, over `DynamicCache(config=)`, whose sliding layers `unwindowed_dynamic_cache`
  swaps for full ones (`DynamicSlidingWindowLayer`, `LinearAttentionAndSlidingWindowAttentionLayer`: both).
- Layers with a recurrent state (layer types "linear_attention", "hybrid", "hybrid_sliding": Qwen3.5, Qwen3-Next,
  Jamba, Bamba, Falcon-H1, Mamba 2, ...) cannot drop a token's K/V: a roll-back needs the state as it was after
  the last kept token. 5.25's cache layer records it: `activate_past_recording(recurrent_states_to_keep=n)` makes
  the models run a forward's last n tokens one by one and keep each state, and `crop(-k)` restores the state k tokens
  back. 5.17 and 5.24 have neither (their crop restores only the conv state), so speculation refuses these targets
  there (`recurrent_rollback_supported`). Layers of type "conv" (LFM2) keep only a conv state, which every supported
  version's crop restores.
- Those layers' cache layer (`LinearAttentionCacheLayerMixin`, all three versions) keeps, per state index i,
  `conv_states[i]` (batch, ..., inputs): while recording, every input since the last crop after the
  `conv_kernel_size[i]` before; and `recurrent_states[i]` (batch, ...), with, in 5.25, `recurrent_states_history[i]`:
  the states before each of the forward's recorded tokens. A crop moves every row back alike; a batch's rows kept
  different numbers of tokens, so `roll_back_rows` puts each row's state back itself. Such a layer has no
  `batch_select_indices` (5.17 to 5.25; a layer holding both a state and K/V selects only its K/V): `select_cache_rows`
  selects the states. 5.25 counts the layer's tokens in a 0-d `cumulative_length_linear`, which `get_seq_length()` reads
  when layer 0 is such a layer (5.17 / 5.24 read the first attention layer's length).
- `DynamicCache.layers[i]` holds `keys` / `values` tensors (batch, kv_heads, slots, head_dim) in both (a layer not
  filled yet has none); batched speculation gathers slots per row there (`gather_cache_slots`). A `StaticLayer`
  allocates its tensors (batch, kv_heads, max_cache_len, head_dim) at its first write, with that write's batch size,
  which `reset()` keeps (all three versions): a kept static cache suits only a call with the same batch size.
- A 2D attention mask shorter than a static cache is padded with zeros (masked) to its length
  (`masking_utils.prepare_padding_mask`, all three versions); the static batched loop passes one of the cache's
  length, so that every verify forward's mask has one shape.
- The native dFlash candidate generator reads `hidden_states[i]` for each of the drafter's `target_layer_ids` in
  5.17 and `hidden_states[i + 1]` in 5.24 (index 0 is the embeddings; z-lab's convention is i + 1).
- `GenerationMixin._valid_auto_compile_criteria(model_kwargs, generation_config)` decides whether `generate`
  compiles the decoding forward (a compileable, non-dynamic cache on cuda / xpu / neuron / tpu, no
  `disable_compile`, no offload); `CompileConfig._compile_all_devices = True` lifts the device condition (both
  5.17 and 5.24; 5.25 adds mps to the devices). The benchmark uses them to report and to force compilation of
  `ar_static`. The options of that compilation are `generation_config.compile_config`, else
  `PreTrainedModel._default_compile_config()` (both), which the speculative loop also compiles its draft and
  refinement steps with.
- With `cache_implementation="static"`, `generate` sizes its static cache to the largest length any call on this model
  asked for so far and remembers it as `model._previous_max_cache_length` (both), so that later calls keep the cache
  shape and the compiled forward does not recompile; the speculative loop sizes its own static caches from it too.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

MIN_TRANSFORMERS = Version("5.17.0")
MAX_TRANSFORMERS_EXCLUSIVE = Version("5.26.0")
TRANSFORMERS_VERSION = Version(transformers.__version__)


def check_transformers_version() -> None:
    if not MIN_TRANSFORMERS <= Version(TRANSFORMERS_VERSION.base_version) < MAX_TRANSFORMERS_EXCLUSIVE:
        raise ImportError(
            f"hf_specdiff supports transformers >= {MIN_TRANSFORMERS}, < {MAX_TRANSFORMERS_EXCLUSIVE}; found "
            f"{transformers.__version__}. Install a supported version: pip install 'transformers>=5.17,<5.26'."
        )


@functools.lru_cache(maxsize=None)
def _cache_argument(forward) -> str:
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """`{name: cache}` with the name this model's forward expects."""
    return {_cache_argument(type(model).forward): cache}


def generation_defaults() -> dict:
    """The values `generate` fills into every generation config it prepares where the model's config leaves them
    unset (`GenerationConfig._get_default_generation_params`: num_assistant_tokens=20, ...; 5.17 to 5.25)."""
    from transformers import GenerationConfig

    return GenerationConfig._get_default_generation_params()


RECURRENT_LAYER_TYPES = {"linear_attention", "hybrid", "hybrid_sliding"}  # layer types with a recurrent state
STATE_LAYER_TYPES = RECURRENT_LAYER_TYPES | {"conv"}  # layer types whose cache layer keeps a state (conv, recurrent)


def hidden_states_request(indices: list[int]) -> bool | list[int]:
    """What to pass as `output_hidden_states` to get the hidden states at these indices of the output tuple (0: the
    embeddings). transformers 5.24 on take the indices and keep only those (the others come back as None): a long
    prompt's prefill then holds len(indices) hidden states rather than one per layer. Earlier versions: all of them."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401 (5.24 on)
    except ImportError:
        return True
    return sorted(set(indices))


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor: a weight sharded across processes (tensor parallelism, FSDP)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def recurrent_rollback_supported() -> bool:
    """Whether this transformers' cache can roll back a recurrent state (5.25: `recurrent_states_to_keep`)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    parameters = inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
    return "recurrent_states_to_keep" in parameters


def record_past(cache, tokens_per_forward: int) -> None:
    """Make `cache` keep what a roll-back of up to `tokens_per_forward` tokens of one forward needs: a sliding-window
    layer its keys past the window, a conv layer its inputs, a recurrent layer (5.25) its state after each token."""
    if recurrent_rollback_supported():
        cache.activate_past_recording(recurrent_states_to_keep=tokens_per_forward)
    else:
        cache.activate_past_recording()


def _check_state_can_roll_back(layer, num_tokens_to_remove: int) -> None:
    """A model whose layers keep their state outside the cache (RecurrentGemma keeps it on the module), or do not
    record the recurrent states a roll-back lands on, would keep rejected drafts in its state: refuse it."""
    states = range(layer.number_of_states)
    history = getattr(layer, "recurrent_states_history", {})
    outside = not any(layer.is_conv_states_initialized[i] or layer.is_recurrent_states_initialized[i] for i in states)
    unrecorded = num_tokens_to_remove > 0 and any(
        layer.is_recurrent_states_initialized[i] and len(history.get(i) or ()) <= num_tokens_to_remove for i in states
    )
    if outside or unrecorded:
        raise ValueError(
            "speculation=... cannot roll this model's recurrent layers back past rejected drafts: they keep their "
            f"state {'outside the cache' if outside else 'without the per-token history a roll-back needs'}. "
            "Generate without speculation."
        )


def crop_cache(cache, num_tokens_to_remove: int) -> None:
    """Drop the last `num_tokens_to_remove` positions of a transformers cache. Called after every forward, with 0 too:
    sliding-window layers recording their past (`activate_past_recording`) are cut back to their window only by a
    crop (transformers < 5.24 would otherwise hand the next forward more keys than its mask covers)."""
    if num_tokens_to_remove < 0:
        raise ValueError(f"cannot remove a negative number of tokens ({num_tokens_to_remove}).")
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):  # a linear-attention / state-space / conv layer
            _check_state_can_roll_back(layer, num_tokens_to_remove)
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            # the next `update` overwrites the slots past it; a layer reusing another's K/V (Gemma 3n) holds none
            if layer.is_initialized and num_tokens_to_remove and hasattr(layer, "cumulative_length"):
                layer.cumulative_length.sub_(num_tokens_to_remove)
        return
    cache.crop(-num_tokens_to_remove)


def roll_back_rows(cache, num_fed: int, kept: list[int], idle: list[bool] | None = None) -> None:
    """After a forward of `num_fed` tokens per row, row i keeps its first `kept[i]`. K/V layers drop the slots past the
    longest kept run (the other rows' rejected slots stay, for the caller to mask); a layer keeping a state (conv,
    recurrent) holds no slots to mask, so each row gets back the state it had after its own last kept token. Rows
    marked `idle` (finished rows kept in the batch, keeping no slot) have no state anyone reads: theirs is left as the
    longest run's, which needs no history further back than a decoding row's."""
    longest = max(kept)
    state_kept = kept if idle is None else [longest if is_idle else k for k, is_idle in zip(kept, idle)]
    per_row = [] if min(state_kept) == longest else [
        (layer, _states_after(layer, num_fed, state_kept)) for layer in cache.layers if hasattr(layer, "conv_states")
    ]
    crop_cache(cache, num_fed - longest)  # every row as the longest: right for K/V, and for the states of its rows
    for layer, (conv_states, recurrent_states) in per_row:
        layer.conv_states.update(conv_states)
        layer.recurrent_states.update(recurrent_states)


def _states_after(layer, num_fed: int, kept: list[int]) -> tuple[dict, dict]:
    """({state index: conv state}, {state index: recurrent state}) of a recording state layer, row i as it was after
    the first `kept[i]` of the `num_fed` tokens of the forward just run."""
    _check_state_can_roll_back(layer, num_fed - min(kept))
    conv_states, recurrent_states = {}, {}
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            inputs = layer.conv_states[i]  # (b, ..., the kernel's inputs before the forward, then its num_fed)
            width = layer.conv_kernel_size[i]
            # a prompt shorter than the kernel: zeros before it, as the conv pads
            if inputs.shape[-1] < width + num_fed:
                inputs = torch.nn.functional.pad(inputs, (width + num_fed - inputs.shape[-1], 0))
            start = inputs.shape[-1] - num_fed - width  # row r's window: the `width` inputs up to its last kept token
            window = (start + torch.tensor(kept, device=inputs.device)[:, None]
                      + torch.arange(width, device=inputs.device))
            window = window.view(len(kept), *[1] * (inputs.dim() - 2), width).expand(*inputs.shape[:-1], width)
            conv_states[i] = inputs.gather(-1, window)
        if layer.is_recurrent_states_initialized[i]:
            # the state after the forward's k-th token: the current one for k = num_fed, else the history's, counted
            # from its end; the rows that kept k tokens copied together (a state can be megabytes a row)
            after = [*layer.recurrent_states_history[i], layer.recurrent_states[i]]
            states = after[-1].clone()
            for k in set(kept) - {num_fed}:
                rows = torch.tensor([row for row, kept_k in enumerate(kept) if kept_k == k], device=states.device)
                states[rows] = after[k - num_fed - 1][rows]
            recurrent_states[i] = states
    return conv_states, recurrent_states


def select_cache_rows(cache, index) -> None:
    """Keep the rows `index` (in that order) of every layer of a dynamic cache: K/V, and the states of the layers
    keeping one (conv, recurrent, the recorded history), which transformers' `batch_select_indices` leaves out."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(index)
        if not hasattr(layer, "conv_states"):
            continue
        history = getattr(layer, "recurrent_states_history", {})
        for i in range(layer.number_of_states):
            for states in (layer.conv_states, layer.recurrent_states):
                if states[i] is not None:
                    states[i] = states[i][index.to(states[i].device)]
            if history.get(i):
                history[i] = [state[index.to(state.device)] for state in history[i]]


def gather_cache_slots(cache, index) -> None:
    """Keep, for each row r, the cache slots `index[r]` (b, n), in that order, in every layer of a dynamic or static
    cache. A static layer's slots are rewritten in place (its tensors keep their addresses, which compiled forwards
    under CUDA graphs read) and its length becomes n."""
    for layer in cache.layers:
        if hasattr(layer, "cumulative_length_linear"):  # a state layer's token count (5.25), the cache's length
            layer.cumulative_length_linear.fill_(index.shape[1])
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        slots = index.to(keys.device)[:, None, :, None]  # broadcast over heads and head_dim
        if isinstance(layer, StaticLayer):
            width = index.shape[1]
            layer.keys[:, :, :width] = keys.take_along_dim(slots, dim=2)
            layer.values[:, :, :width] = layer.values.take_along_dim(slots, dim=2)
            layer.cumulative_length.fill_(width)
            continue
        layer.keys = keys.take_along_dim(slots, dim=2)
        layer.values = layer.values.take_along_dim(slots, dim=2)


def unwindowed_dynamic_cache(config) -> DynamicCache:
    """An empty dynamic cache for a model with this config whose sliding-window layers keep every slot, as full
    layers: a batch's rows drift apart in cache slots, and a row behind the others still needs slots a sliding layer
    would have dropped (the loop masks each row's window itself). Layers keeping a state keep their own layer type;
    without any, `DynamicCache()` makes full layers throughout as they are first written."""
    from transformers.cache_utils import (
        DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
    )

    if not any(kind in STATE_LAYER_TYPES for kind in getattr(config, "layer_types", None) or ()):
        return DynamicCache()
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
        elif type(layer) is LinearAttentionAndSlidingWindowAttentionLayer:
            cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    return cache


def generate_output_cache_field() -> str:
    """Name of the cache field of transformers' generate outputs."""
    import dataclasses

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    names = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    return "cache" if "cache" in names else "past_key_values"


def forward_compiled(model, generation_config, cache) -> bool:
    """Whether `generate` compiles `model`'s decoding forward with this generation config and this cache."""
    # the cache sits under `past_key_values` in 5.17's model kwargs and under `cache` in 5.24's
    return bool(model._valid_auto_compile_criteria({"cache": cache, "past_key_values": cache}, generation_config))


def compile_config_for_all_devices():
    """A `CompileConfig` that makes `generate` compile on any device, the CPU included."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return config


def new_static_cache(config, max_cache_len: int) -> StaticCache:
    """An empty static cache for a model with this config (tensors allocated at the first write), every layer a full
    `StaticLayer`: a sliding-window (or chunked) layer's ring buffer overwrites slots that a roll-back would need
    again. Windows and chunks still hold: transformers' masks apply them, counting cache slots, which at batch size 1
    are positions."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [StaticLayer(max_cache_len=max_cache_len) if getattr(layer, "is_sliding", False) else layer
                    for layer in cache.layers]
    return cache


# Per thread, owner module -> (what the cache was made for, the cache); weak: a cache lives no longer than its model.
# Per thread because two threads decoding with one model at once must not write one cache.
_reused_static_caches = threading.local()


def reused_static_cache(owner, config, max_cache_len: int, batch_size: int = 1) -> StaticCache:
    """An empty static cache for `owner`'s forward (the target or the drafter): the one this thread's previous call
    used, reset, where it suits this call, else a new one. A compiled forward under CUDA graphs reads the cache at
    fixed addresses: a new cache per call would re-record its graphs every call. Kept here, not on the model: nothing
    is parked on the user's objects.

    A cache suits a call made with the same batch size, length and device, the same dtype of keys and values (the
    model's, or autocast's where autocast is on: the cache's tensors take the dtype of the first keys written), and the
    same inference mode (tensors made under `torch.inference_mode()` cannot be written outside it)."""
    device_type = owner.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else owner.dtype
    made_for = (batch_size, max_cache_len, dtype, owner.device, torch.is_inference_mode_enabled())
    if not hasattr(_reused_static_caches, "by_owner"):
        _reused_static_caches.by_owner = weakref.WeakKeyDictionary()
    kept = _reused_static_caches.by_owner.get(owner)
    if kept is not None and kept[0] == made_for:
        kept[1].reset()
        return kept[1]
    cache = new_static_cache(config, max_cache_len)
    _reused_static_caches.by_owner[owner] = (made_for, cache)
    return cache


def compile_config(model, generation_config):
    """The `CompileConfig` `generate` compiles `model`'s forward with: the generation config's, else the model's
    default."""
    return generation_config.compile_config or model._default_compile_config()


def static_cache_length(model, generation_config, embedded_prompt_slots: int = 0) -> int:
    """The length `generate` sizes a static cache to for this call, by its own rule: `max_length - 1` (the last token
    is never fed) plus the slots of a prompt given as `inputs_embeds` without its `input_ids` (which `max_length` leaves
    out), at least `max_cache_len`, and never less than an earlier call on this model used (recorded by `generate`
    before the loop runs, this call's included), so that a later, shorter call keeps the compiled forwards' shapes."""
    return max(generation_config.max_length - 1 + embedded_prompt_slots, generation_config.max_cache_len or 0,
               getattr(model, "_previous_max_cache_length", 0))
