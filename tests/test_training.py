"""Training paths: gradient checkpointing and packed sequences against their plain references,
Trainer and a plain accelerate loop with bf16 autocast, and 2-process data parallel (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from modular_decoder import ModularDecoderForCausalLM, preset_config

HERE = Path(__file__).resolve().parent


def _grads(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients():
    model = ModularDecoderForCausalLM(preset_config("gemma2", tiny=True)).train()
    ids = torch.randint(0, 128, (2, 16))
    plain = _grads(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.model.gradient_checkpointing
    checkpointed = _grads(model, ids)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_packed_sequences_equal_separate_sequences():
    """DataCollatorWithFlattening packs documents into one row with restarting position_ids; each
    document's logits must equal its own forward (no attention across documents)."""
    model = ModularDecoderForCausalLM(preset_config("llama", tiny=True)).eval()
    docs = [[3, 9, 27, 81, 5], [7, 14, 28], [11, 22, 33, 44, 55, 66]]
    batch = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": d} for d in docs])
    assert batch["input_ids"].shape == (1, 14) and "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=torch.tensor([doc])).logits[0]
            torch.testing.assert_close(packed[start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
            start += len(doc)


def _dataset(n=16, length=12):
    starts = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ((s + torch.arange(length)) % 128).tolist()} for s in starts]


def test_trainer_bf16_checkpointing_packed(tmp_path):
    model = ModularDecoderForCausalLM(preset_config("qwen3", tiny=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             bf16=True, gradient_checkpointing=True, use_cpu=True, report_to=[], logging_steps=1,
                             save_strategy="no", remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(),
                      data_collator=DataCollatorWithFlattening(return_position_ids=True))
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert model.model.gradient_checkpointing
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_accelerate_loop_bf16(tmp_path):
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = ModularDecoderForCausalLM(preset_config("phi", tiny=True))
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 128, (2, 12))
    for _ in range(2):
        with accelerator.autocast():
            out = model(input_ids=ids, labels=ids)
        assert seen[-1] == torch.bfloat16  # autocast reached the matmuls (accelerate returns fp32 outputs)
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(out.loss)


@pytest.mark.slow  # three interpreter start-ups (~1 min on 2 cores)
def test_two_process_data_parallel(tmp_path):
    """torchrun, 2 CPU processes (gloo) on different data: the averaged gradients keep the replicas
    identical, and equal to one process stepping on the union of the data."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "ddp_worker.py"), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2 and ranks[0]["backend"] == "gloo"
    assert ranks[0]["params"] == ranks[1]["params"]  # replicas in sync
    assert ranks[0]["params"] != ranks[0]["initial"]  # and they moved
    single = subprocess.run([sys.executable, str(HERE / "ddp_worker.py"), str(tmp_path), "--single"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert single.returncode == 0, single.stderr[-4000:]
    reference = json.loads((tmp_path / "single.json").read_text())
    torch.testing.assert_close(torch.tensor(ranks[0]["params"]), torch.tensor(reference["params"]),
                               rtol=1e-5, atol=1e-6)
