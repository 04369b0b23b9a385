"""Worker for test_training.test_two_process_data_parallel: 3 SGD steps of a tiny model under
accelerate (DDP, gloo on CPU), each rank on its own half of the batch; `--single` runs the same
steps on the whole batch in one process as the reference."""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from modular_decoder import ModularDecoderForCausalLM, preset_config

out, single = Path(sys.argv[1]), "--single" in sys.argv
torch.manual_seed(0)
model = ModularDecoderForCausalLM(preset_config("llama", tiny=True))
initial = model.lm_head.weight.flatten()[:16].tolist()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
accelerator = Accelerator(cpu=True)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randint(0, 128, (3, 4, 10), generator=torch.Generator().manual_seed(1))  # steps x batch x seq
rank, world = accelerator.process_index, accelerator.num_processes
for step in range(3):
    batch = data[step] if single else data[step].chunk(world)[rank]
    loss = model(input_ids=batch, labels=batch).loss  # equal-size shards: mean of means = full mean
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
params = accelerator.unwrap_model(model).lm_head.weight.flatten()[:16].tolist()
backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
name = "single.json" if single else f"rank{rank}.json"
(out / name).write_text(json.dumps({"params": params, "initial": initial, "world_size": world, "backend": backend}))
# Tear the process group down before exit: a gloo group still alive at interpreter exit can abort
# the process ("terminate called without an active exception") after its work is done.
accelerator.wait_for_everyone()
accelerator.end_training()
# A full suite on 2 busy cores still saw rank 0 abort that way once: with the work done and its file written,
# leave without the interpreter's exit (and the C++ static destructors it runs).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
