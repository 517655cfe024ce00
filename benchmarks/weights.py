"""P4: time from the trainer finishing a step to `weights/step_<k>/` being written and STABLE.

Runs one real trainer step (fake RL data), then times `export_weights` — gathering the full state dict, casting to
the export dtype, writing safetensors + config + tokenizer, renaming into place and writing STABLE — several times.
Prints one JSON object; with --out, merges it into that file under its "<device>/<model>" key.

    python benchmarks/weights.py                                  # CPU, the embedded SmolLM2-135M
    python benchmarks/weights.py --qwen3-0.6b                     # GPU, random-init Qwen3-0.6B architecture, bf16
    python benchmarks/weights.py --smoke                          # CPU, the tiny model, one export
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_smoke_flag, emit
from trainer import QWEN3_0_6B, trainer_parts, write_random_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name or model directory")
    parser.add_argument("--qwen3-0.6b", dest="qwen3", action="store_true", help="random-init Qwen3-0.6B instead")
    parser.add_argument("--repeats", type=int, default=3, help="timed exports (median reported)")
    parser.add_argument("--out", type=Path, help="merge the result into this JSON file")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.repeats = "tiny", 1

    from primerl.config.trainer import RolloutDataConfig
    from primerl.trainer.core import Trainer, micro_batches
    from primerl.trainer.loss import load_loss
    from primerl.trainer.rl import fake_rows, fill_on_policy_logprobs, make_rl_loss
    from primerl.trainer.weights import export_weights
    from primerl.transport import snapshots

    with tempfile.TemporaryDirectory(prefix="p4-") as tmp:
        tmp = Path(tmp)
        model_name, label = args.model, args.model
        if args.qwen3:
            model_name, label = str(tmp / "model"), "qwen3-0.6b-random"
            write_random_model(QWEN3_0_6B, Path(model_name))
        run_dir = tmp / "run"
        trainer = Trainer(trainer_parts(run_dir, model_name), source="benchmark")
        data = RolloutDataConfig(fake=True, fake_samples=2, fake_sample_tokens=64, fake_seq_len=128)
        vocab = trainer.policy.causal_lm.config.vocab_size
        batch = micro_batches(fake_rows(data, vocab, 0, 0, 1, 0), 1, trainer.device)
        fill_on_policy_logprobs(trainer, batch)
        trainer.step(batch, make_rl_loss(load_loss("primerl.trainer.loss:masked_importance_loss")))
        times = []
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            path = export_weights(trainer.policy, trainer.tokenizer, run_dir, step, trainer.export_dtype, trainer.dist)
            assert snapshots.is_stable(path)
            times.append(time.perf_counter() - start)
        num_bytes = json.loads((path / snapshots.STABLE).read_text())["num_bytes"]
        device = torch.cuda.get_device_name() if trainer.device.type == "cuda" else "cpu"
        export_s = statistics.median(times)
        result = {
            "model": label,
            "device": device,
            "dtype": str(trainer.export_dtype).removeprefix("torch."),
            "num_bytes": num_bytes,
            "export_s": export_s,
            "export_s_all": times,
            "gib_per_s": num_bytes / 2**30 / export_s,
            "what": "trainer step done -> full state dict gathered, cast, safetensors+config+tokenizer written, "
            "renamed into place, STABLE written",
        }
    emit(result, args.out, smoke=args.smoke, merge_under=f"{'gpu' if device != 'cpu' else 'cpu'}/{label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
