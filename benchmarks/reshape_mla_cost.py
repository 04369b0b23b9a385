"""What `to_mla` alone costs on SmolLM2-135M: wall and CPU time, and peak memory against the model's size.

    python benchmarks/reshape_mla_cost.py MODEL_FOLDER [--rank 192] [--rows 4] [--tokens 256] [--threads 2]

Calibration is a fixed text (this repository's README), so the run measures the conversion (its
calibration pass included), not sampling. Peak RSS is read after loading and after `to_mla`.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modular_decoder.tools.reshape.mla_conversion import to_mla


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--rank", type=int, default=192)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    text = (Path(__file__).parents[1] / "README.md").read_text()
    ids = AutoTokenizer.from_pretrained(args.model)(text, return_tensors="pt").input_ids[0]
    calibration = ids[: args.rows * args.tokens].view(args.rows, args.tokens)
    loaded = rss_mib()
    clock, cpu = time.perf_counter(), time.process_time()
    to_mla(model, args.rank, None, calibration, progress=False)
    result = {"threads": args.threads, "calibration_tokens": calibration.numel(),
              "wall_s": time.perf_counter() - clock, "cpu_s": time.process_time() - cpu,
              "model_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
              "rss_after_load_mib": loaded, "peak_rss_mib": rss_mib()}
    result["peak_over_loaded_mib"] = result["peak_rss_mib"] - loaded
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
