"""A target sharded across processes: with FSDP every forward gathers each layer's shards from all processes, so the
processes must run the same number of target forwards though each accepts its own drafts and finishes at its own step
(transformers' `synced_gpus`, which it turns on itself for an FSDP model). Real processes (gloo, on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_speculator, make_target

import hf_specdiff
import hf_specdiff.generation

FSDP_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from conftest import make_speculator, make_target
import hf_specdiff
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = dist.get_rank()
target = make_target(initializer_range=0.2, dtype=torch.float32)
speculator = make_speculator(target)
# the lm_head sharded on its own (FSDP's subclass of it, resharded after every forward), the embeddings with the root
# (sharded until the first forward gathers them, and kept gathered)
for module in [*target.model.layers, target.lm_head]:
    fully_shard(module)
fully_shard(target)
hf_specdiff.enable(target)
# each process its own prompts and budget: they accept differently and finish at different steps
single = torch.tensor([[4, 9, 1, 33, 7] * (1 + 2 * rank)])
batch = torch.tensor([[0, 0, 5, 2, 8], [3, 1, 4, 1, 5]]) + rank
mask = (batch != 0).long() if rank == 0 else torch.ones_like(batch)
for method, prompt, kwargs in [("xpress", single, {{}}), ("dflash", batch, dict(attention_mask=mask)),
                               ("markov", single, dict(do_sample=True))]:
    sampled = kwargs.pop("do_sample", False)
    budget = dict(max_new_tokens=6 + 14 * rank, **kwargs)
    # speculation first: the model's first forward has not yet gathered the weights the drafter reads
    ours = target.generate(prompt, assistant_model=speculator, speculation=method, do_sample=sampled, **budget)
    plain = target.generate(prompt, do_sample=False, **budget)
    same = ours.shape == plain.shape if sampled else torch.equal(ours, plain)
    print(f"rank {{rank}} {{method}}: {{'same' if same else 'DIFFERENT'}}", flush=True)
dist.destroy_process_group()
"""


TENSOR_PARALLEL_SCRIPT = """
import sys, torch, torch.distributed as dist
import hf_specdiff
from transformers import AutoModelForCausalLM

target = hf_specdiff.enable(AutoModelForCausalLM.from_pretrained({target!r}, tp_plan="auto", dtype=torch.float32))
speculator = hf_specdiff.AutoSpeculator.from_pretrained({speculator!r}, dtype=torch.float32)
rank = dist.get_rank()
assert type(target.lm_head.weight).__name__ == "DTensor"  # sharded: the drafter reads a gathered copy
batch = torch.tensor([[0, 0, 5, 2, 8], [3, 1, 4, 1, 5]])
for method, sampled in [("xpress", False), ("dflash", False), ("xpress", True)]:
    torch.manual_seed(0)  # every process draws the same samples, as tensor parallelism needs
    ours = target.generate(batch, attention_mask=(batch != 0).long(), max_new_tokens=12, do_sample=sampled,
                           assistant_model=speculator, speculation=method)
    torch.manual_seed(0)
    plain = target.generate(batch, attention_mask=(batch != 0).long(), max_new_tokens=12, do_sample=sampled)
    gathered = [torch.empty_like(ours) for _ in range(2)]
    dist.all_gather(gathered, ours)
    same = (ours.shape == plain.shape if sampled else torch.equal(ours, plain)) and torch.equal(*gathered)
    print(f"rank {{rank}} {{method}}{{'_sampled' if sampled else ''}}: {{'same' if same else 'DIFFERENT'}}", flush=True)
dist.destroy_process_group()
"""


def run_two_processes(script) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(re.findall(r"rank \d \w+: (?:same|DIFFERENT)", done.stdout))  # (their lines may interleave)


@pytest.mark.slow
def test_processes_of_an_fsdp_target_decode_in_lockstep(tmp_path):
    """Each process gets plain greedy's output (FSDP's own), single prompts and a ragged batch; sampled runs end too.
    Without the lockstep the process finishing first left, and the other failed in its next forward ("Connection
    closed by peer") or waited for it for ever. Before the model's first forward the drafter's weights (embeddings,
    lm_head) are still sharded: a speculative call first failed on them (DTensor met a plain tensor)."""
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_SCRIPT.format(tests=str(Path(__file__).parent)))
    assert run_two_processes(script) == [
        f"rank {rank} {method}: same" for rank in (0, 1) for method in ("dflash", "markov", "xpress")]


@pytest.mark.slow
def test_a_tensor_parallel_target_speculates_as_plain_generate(tmp_path):
    """transformers' tensor parallelism (`tp_plan="auto"`) shards the embeddings and lm_head the drafter reads (it
    failed on them); every process runs the same decoding, so they accept alike and need no lockstep."""
    target = make_target(initializer_range=0.2, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    make_speculator(target).save_pretrained(tmp_path / "speculator")
    script = tmp_path / "tensor_parallel.py"
    script.write_text(TENSOR_PARALLEL_SCRIPT.format(target=str(tmp_path / "target"),
                                                    speculator=str(tmp_path / "speculator")))
    assert run_two_processes(script) == [
        f"rank {rank} {method}: same" for rank in (0, 1) for method in ("dflash", "xpress", "xpress_sampled")]


def test_deepspeed_zero3_is_refused(monkeypatch):
    """ZeRO-3 keeps the embeddings and lm_head the drafter reads partitioned outside the target's forward."""
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    monkeypatch.setattr(hf_specdiff.generation, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3 keeps them partitioned.*FSDP"):
        target.generate(torch.tensor([[4, 9, 1]]), assistant_model=speculator, speculation="xpress", max_new_tokens=4)
