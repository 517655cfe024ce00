"""The multi-GPU trainer's code path on a machine with one GPU: a process group (NCCL, bound with `device_id`), FSDP2
(`shard_policy`: fully_shard per decoder layer, bf16 mixed-precision policy), NCCL all-reduces inside `Trainer.step`,
DTensor gradient clipping, then the two multi-rank weight paths: the full export through `get_model_state_dict`
(`export_weights`) and the broadcast path's one-tensor-at-a-time `DTensor.full_tensor()` gathers — all on 1 rank.

Why not just `torchrun --nproc-per-node=1 primerl trainer ...`: with one rank the trainer starts no process group and
does not shard (trainer/dist.py `setup`, model.py `build_policy`), so none of the above would run. Here the real
`Trainer` is built with two hooks: the process group is started the way `setup` starts it for several ranks, and
the policy is sharded with primerl's own `shard_policy` over that 1-rank group. Run under torchrun (one rank):

    torchrun --standalone --nproc-per-node=1 benchmarks/fsdp_one_rank.py --out OUT.json              # GPU, NCCL
    torchrun --standalone --nproc-per-node=1 benchmarks/fsdp_one_rank.py --cpu                       # CPU, gloo
    torchrun --standalone --nproc-per-node=1 benchmarks/fsdp_one_rank.py --smoke                     # --cpu, 1 step

Random-init Qwen3-0.6B architecture (tiny on --cpu), fake packed rows (benchmarks/trainer.py). Prints one JSON
object with loss and tokens/s per step; writes it to --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_smoke_flag, emit
from trainer import QWEN3_0_6B, TINY, fake_rows, trainer_parts, write_random_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU with a tiny model (dry run)")
    parser.add_argument("--model-dir", type=Path, help="random model directory (written there if missing)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--samples", type=int, default=None, help="samples per packed row (default 16; --cpu 4)")
    parser.add_argument("--sample-len", type=int, default=None, help="tokens per sample (default 1024; --cpu 64)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="process group timeout")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.cpu, args.steps, args.warmup = True, 1, 0
        args.samples, args.sample_len = args.samples or 2, args.sample_len or 16
    if "RANK" not in os.environ:
        print("fsdp_one_rank: run it under torchrun --standalone --nproc-per-node=1", file=sys.stderr)
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("fsdp_one_rank: no GPU visible; --cpu for the gloo dry run", file=sys.stderr)
        return 2
    samples = args.samples or (4 if args.cpu else 16)
    sample_len = args.sample_len or (64 if args.cpu else 1024)

    import torch.distributed as dist
    import transformers
    from safetensors.torch import load_file

    from primerl.trainer import core
    from primerl.trainer import dist as tdist
    from primerl.trainer import model as tmodel
    from primerl.trainer.dist import DistInfo
    from primerl.trainer.loss import load_loss
    from primerl.trainer.rl import make_rl_loss
    from primerl.trainer.weights import POLICY_PREFIX, _full, export_plan, export_weights

    core.setup_logging(int(os.environ["RANK"]), "fsdp-1rank")
    real_setup, real_build = tdist.setup, core.build_policy
    group: dict[str, float] = {}

    def setup_with_group(choice: str):
        info, device = real_setup(choice)  # device, set_device, multicast off: as for several ranks
        if not dist.is_initialized():  # what setup does when WORLD_SIZE > 1
            t = time.perf_counter()
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                    device_id=device if device.type == "cuda" else None,
                                    timeout=datetime.timedelta(seconds=args.timeout_s))
            group["init_s"] = time.perf_counter() - t
        return info, device

    def build_sharded(model_cfg, train_cfg, lora_cfg, device, info):
        policy, tokenizer = real_build(model_cfg, train_cfg, lora_cfg, device, info)
        t = time.perf_counter()
        tmodel.shard_policy(policy, policy.compute_dtype, device, dist.get_world_size())
        group["shard_s"] = time.perf_counter() - t
        return policy, tokenizer

    tdist.setup = setup_with_group
    core.build_policy = build_sharded

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fsdp-1rank-") as tmp:
        tmp = Path(tmp)
        model_dir = args.model_dir or tmp / "model"
        if not (model_dir / "config.json").exists():
            write_random_model(TINY if args.cpu else QWEN3_0_6B, model_dir)
        parts = trainer_parts(tmp / "run", model_dir, optim={"lr": 1e-6},
                              train={"device": "cpu" if args.cpu else "cuda", "compile": False, "micro_batch_rows": 1})
        t = time.perf_counter()
        trainer = core.Trainer(parts, source="fsdp-1rank")
        build_s = time.perf_counter() - t
        param = next(trainer.policy.parameters())
        facts = {
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "param_type": type(param).__name__,
            "param_dtype": str(param.dtype),
            "fsdp_casts": getattr(trainer.policy, "_fsdp_casts", False),
            "attention": trainer.policy.attention,
            "process_group_init_s": group.get("init_s"),
            "shard_s": group.get("shard_s"),
            "trainer_build_s": build_s,
        }
        step_loss = make_rl_loss(load_loss("primerl.trainer.loss:masked_importance_loss"))
        vocab = trainer.policy.causal_lm.config.vocab_size
        steps = []
        for step in range(args.warmup + args.steps):
            batch = core.micro_batches(fake_rows(samples, sample_len, vocab, step), 1, trainer.device)
            metrics = trainer.step(batch, step_loss)
            row = {k: metrics.get(k) for k in ("loss", "entropy", "grad_norm", "step_s", "tokens_per_s", "mfu",
                                               "peak_memory_gib", "num_tokens")}
            row["warmup"] = step < args.warmup
            steps.append(row)
            print(f"fsdp_one_rank: step {step + 1}: " + " ".join(f"{k}={v:.4g}" for k, v in row.items()
                                                             if isinstance(v, float)), file=sys.stderr, flush=True)
        timed = [s for s in steps if not s["warmup"]] or steps

        # the multi-rank export path: full_state_dict takes get_model_state_dict(full_state_dict, cpu_offload) only
        # when world_size > 1, so it is handed a DistInfo that says so (nothing else in export_weights reads it)
        checks: dict[str, object] = {}
        try:
            t = time.perf_counter()
            path = export_weights(trainer.policy, trainer.tokenizer, tmp / "run", 1, trainer.export_dtype,
                                  DistInfo(rank=0, world_size=2, local_rank=0))
            checks["export_s"] = time.perf_counter() - t
            exported = load_file(str(path / "model.safetensors"))
            checks["export_bytes"] = sum(v.numel() * v.element_size() for v in exported.values())
            # the broadcast path: one DTensor.full_tensor() per tensor, as PolicyWeights.gather does for the publishers
            state = trainer.policy.state_dict()
            t = time.perf_counter()
            max_diff = 0.0
            for entry in export_plan(trainer.policy, trainer.export_dtype):
                full = entry.build(lambda key: _full(state[POLICY_PREFIX + key]))
                max_diff = max(max_diff, float((full.float().cpu() - exported[entry.name].float()).abs().max()))
            checks["gather_and_compare_s"] = time.perf_counter() - t
            checks["gathered_vs_exported_max_abs_diff"] = max_diff
            checks["ok"] = max_diff == 0.0
        except Exception as e:  # noqa: BLE001 - recorded
            checks["ok"] = False
            checks["error"] = f"{type(e).__name__}: {e}"[:2000]
        trainer.close()

    result = {
        "what": "1-rank FSDP2 trainer steps over a real process group (the multi-GPU trainer's path on one device), "
                "then the multi-rank weight export and the broadcast path's DTensor gathers, compared",
        "model": "tiny Qwen3, random init" if args.cpu else "Qwen3-0.6B architecture, random init",
        "rows": f"1 packed row of {samples} samples x {sample_len} tokens per step",
        **facts,
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
        "step_s": statistics.median(s["step_s"] for s in timed),
        "mfu": statistics.median(s["mfu"] for s in timed) if timed[0]["mfu"] is not None else None,
        "peak_memory_gib": steps[-1]["peak_memory_gib"],
        "steps": steps,
        "weights": checks,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version())),
        "transformers": transformers.__version__,
        "wall_s": time.perf_counter() - started,
    }
    emit(result, args.out, smoke=args.smoke)
    return 0 if checks.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
