"""P1-GPU at real sizes: one cell of the matrix per invocation, primerl's engines against TRL's two ways to generate.

A cell is ARCH/NEW_TOKENS/PROMPTSxGROUP (`--list` prints them): the SmolLM2-135M, Qwen3-0.6B and Qwen3-1.7B
architectures with random weights (fixed seed; the tokenizer of `--tokenizer-dir`, whose special token ids the model
takes, the architecture's vocabulary kept unless the tokenizer's is larger), 128 and 512 new tokens, 16 x 8 and
64 x 8 rollouts per step. Sides, each through benchmarks/e2e_vs_trl.py's own runs on the same prompts, sizes,
precision (bf16) and lr: `primerl-embedded` and `primerl-vllm` (`rl` with the embedded engine or vLLM, shared weight
handoff), `trl-vllm` (TRL's GRPOTrainer generating through vLLM colocated, `--trl-vllm-memory`, `--trl-vllm-sleep`)
and `trl-generate` (TRL with `model.generate`). Each side runs with a time limit (`--side-timeout-s`); one that
fails or runs out is recorded with its error, never as a figure.

The cell's entry in `--out` (default benchmarks/results/p1_gpu_matrix.json; the file keeps every cell) holds each
side's overall and steady rollouts/s (steady: first step left out), tokens/s, lost rollouts, reward per step and
the card; a side run again replaces its entry, but for `trl-vllm`, whose runs with each setting are listed under
`trl_vllm_tried` and whose fastest on the card is kept (the peer at its best). Then `steady_ratio_vs_trl_vllm` and
`steady_ratio_vs_trl_generate` (and the overall ones) for each primerl side and for primerl's best, where both sides
ran on the same card.

    python3 benchmarks/p1_gpu_matrix.py --cell qwen3-0.6b/512/64x8 --trl-script PEER --tokenizer-dir TOK \\
        --trl-pythonpath SITE --sides primerl-vllm,trl-vllm --out OUT.json
    uv run python benchmarks/p1_gpu_matrix.py --smoke --out /tmp/m.json   # CPU: primerl-embedded, tiny model

`--primerl-set KEY=VALUE` (repeatable) adds one of rl's settings to primerl's sides, e.g.
`trainer.train.compile=true` or `trainer.train.warm_up_tokens=0`: such a run is an A/B against the side as
configured, so it goes under the cell's `variants` with its settings and leaves the side and the ratios alone.

`--smoke` runs the cell tiny/4/1x2 on the CPU (the registry's tiny model, 2 steps, primerl with the embedded
engine); the vLLM and TRL sides are named under "not_run" with the reason.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from e2e_vs_trl import primerl_override  # benchmarks/e2e_vs_trl.py
from report import add_smoke_flag, commit, emit, not_run  # benchmarks/report.py

HERE = Path(__file__).resolve().parent
ARCHS = ("smollm2-135m", "qwen3-0.6b", "qwen3-1.7b")
TOKENS, ROLLOUTS = (128, 512), ((16, 8), (64, 8))
SIDES = ("primerl-embedded", "primerl-vllm", "trl-vllm", "trl-generate")
QWEN3_1_7B = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128}  # the rest as Qwen3-0.6B
SMOKE_SKIPS = {"primerl-vllm": "vLLM needs a CUDA device; a smoke run is CPU-only",
               "trl-vllm": "the peer needs its own environment with TRL and vLLM on a CUDA device",
               "trl-generate": "the peer needs its own environment with TRL, which a smoke run does not build"}
CELL = re.compile(r"^([\w.-]+)/(\d+)/(\d+)x(\d+)$")


def cells() -> list[str]:
    return [f"{a}/{t}/{p}x{g}" for a in ARCHS for t in TOKENS for p, g in ROLLOUTS]


def parse_cell(cell: str) -> tuple[str, int, int, int]:
    match = CELL.match(cell)
    if match is None:
        raise SystemExit(f"cell {cell!r}: expected ARCH/NEW_TOKENS/PROMPTSxGROUP, e.g. qwen3-0.6b/512/64x8 (--list)")
    return match[1], int(match[2]), int(match[3]), int(match[4])


def random_model(arch: str, tokenizer_dir: Path, into: Path) -> Path:
    """`arch` with random weights (seed 0, bfloat16) and the tokenizer of `tokenizer_dir`; made once per work dir."""
    if (into / "model.safetensors").is_file() or (into / "model.safetensors.index.json").is_file():
        return into
    import torch
    from engine import ARCHITECTURES  # benchmarks/engine.py
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = dict(ARCHITECTURES["qwen3-0.6b"], **QWEN3_1_7B) if arch == "qwen3-1.7b" else dict(ARCHITECTURES[arch])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    spec.update(vocab_size=max(spec["vocab_size"], len(tokenizer)), eos_token_id=eos,
                bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(into)
    tokenizer.save_pretrained(into)
    if (tokenizer_dir / "generation_config.json").is_file():
        shutil.copy(tokenizer_dir / "generation_config.json", into)
    return into


def e2e_args(args: argparse.Namespace, tokens: int, prompts: int, group: int, model_dir: Path | None):
    """benchmarks/e2e_vs_trl.py's settings for this cell, parsed by its own parser."""
    from e2e_vs_trl import parse_args

    overrides = [f"--primerl-set={item}" for item in args.primerl_set]
    if args.smoke:
        return parse_args(["--smoke", "--work-dir", str(args.work_dir), *overrides])
    return parse_args([
        "--trl-script", str(args.trl_script), "--model-dir", str(model_dir), "--bf16", "--rounds", "1",
        "--steps", str(args.steps), "--prompts-per-step", str(prompts), "--group", str(group),
        "--new-tokens", str(tokens), "--seq-len", str(max(2048, tokens + 512)),
        *(["--micro-batch-rows", str(max(1, args.primerl_micro_batch_tokens // max(2048, tokens + 512)))]
          if args.primerl_micro_batch_tokens else []),
        "--max-batch-size", str(args.max_batch_size), "--weight-transfer", "shared", "--lr", str(args.lr),
        "--work-dir", str(args.work_dir), "--trl-vllm-memory", str(args.trl_vllm_memory),
        *(["--trl-vllm-sleep"] if args.trl_vllm_sleep else []),
        *(["--trl-python", str(args.trl_python)] if args.trl_python else []),
        *(["--trl-pythonpath", args.trl_pythonpath] if args.trl_pythonpath is not None else []),
        *(["--side-timeout-s", str(args.side_timeout_s)]),
        *(["--trl-micro-batch", str(args.trl_micro_batch)] if args.trl_micro_batch else []),
        *overrides,
    ])


def run_side(side: str, e2e: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    """One side of the cell through e2e_vs_trl.py's runs; an error (failure, timeout) is recorded as such."""
    import tomli_w
    from e2e_vs_trl import (
        SMOKE_SYSTEM_PROMPT,
        VERSIONS,
        ensure_trl_venv,
        peer_system_prompt,
        primerl_config,
        primerl_versions,
        run_primerl,
        run_trl,
        trl_env,
        write_prompts,
    )
    from sides import package_versions

    system = peer_system_prompt(e2e.trl_script) if e2e.trl_script else SMOKE_SYSTEM_PROMPT
    prompts, system_file = write_prompts(work, system)
    try:
        if side.startswith("primerl-"):
            e2e.engine = "vllm" if side == "primerl-vllm" else "hf"
            config = work / f"{side}.toml"
            config.write_text(tomli_w.dumps(primerl_config(model_dir, system_file, e2e)))
            return {**run_primerl(config, work / side, e2e), "versions": primerl_versions()}
        e2e.trl_vllm_colocate = side == "trl-vllm"
        python = e2e.trl_python or ensure_trl_venv(e2e.trl_venv)
        versions = package_versions(str(python), VERSIONS, trl_env(e2e))
        return {**run_trl(python, e2e.trl_script, model_dir, prompts, e2e), "versions": versions}
    except SystemExit as e:  # e2e_vs_trl's one-line failures
        return {"error": str(e)[-3000:]}


def figures(side: str, run: dict, tokens: int, per_step: int, steps: int) -> dict:
    """The matrix's fields of one side's run."""
    if "error" in run:
        return run
    out = {key: run[key] for key in ("rollouts_per_s", "steady_rollouts_per_s", "cold_rollouts_per_s", "seconds",
                                     "wall_s", "launch_to_first_step_s", "rewards", "backward_dtype", "generation",
                                     "versions", "micro_batch") if key in run}
    out["lost_rollouts"] = run.get("lost_rollouts", 0 if side.startswith("trl-") else None)
    if side.startswith("trl-"):
        out["lost_rollouts_note"] = "TRL trains on every rollout it generated (no server between)"
    out["tokens_per_s_at_max_len"] = round(run["rollouts_per_s"] * tokens, 1)  # upper bound: eos ends a reply early
    if run.get("steady_rollouts_per_s"):
        out["steady_tokens_per_s_at_max_len"] = round(run["steady_rollouts_per_s"] * tokens, 1)
    if run.get("completion_tokens") and run.get("seconds"):
        out["tokens_per_s"] = round(run["completion_tokens"] / run["seconds"], 1)  # primerl: the tokens sampled
    out["steps"], out["rollouts_per_step"] = steps, per_step
    return out


def keep_fastest_trl_vllm(entry: dict, measured: dict) -> dict:
    """TRL-with-vLLM runs with different settings (memory share, sleep) each go into `trl_vllm_tried`; the side keeps
    the fastest (steady rollouts/s) on this card, so the peer is compared at its best."""
    tried = entry.setdefault("trl_vllm_tried", [])
    tried.append({key: measured.get(key) for key in ("generation", "rollouts_per_s", "steady_rollouts_per_s", "card",
                                                      "error", "measured_at") if key in measured})
    best = entry.get("sides", {}).get("trl-vllm")
    if best and best.get("card") == measured["card"] and (best.get("steady_rollouts_per_s") or 0) > (
            measured.get("steady_rollouts_per_s") or 0):
        return best
    return measured


def ratios(sides: dict) -> dict:
    """primerl's sides (and its best) over each TRL side, steady and overall, where both ran on the same card."""
    out: dict = {}
    for peer, name in (("trl-vllm", "trl_vllm"), ("trl-generate", "trl_generate")):
        for clock, key in (("steady", "steady_rollouts_per_s"), ("overall", "rollouts_per_s")):
            theirs = sides.get(peer, {})
            ours = {s: sides[s] for s in ("primerl-embedded", "primerl-vllm") if sides.get(s, {}).get(key)
                    and sides[s].get("card") == theirs.get("card")}
            if not theirs.get(key) or not ours:
                continue
            per = {s: round(v[key] / theirs[key], 3) for s, v in ours.items()}
            out[f"{clock}_ratio_vs_{name}"] = {**per, "best": max(per.values())}
    return out


def card() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", help="ARCH/NEW_TOKENS/PROMPTSxGROUP (see --list)")
    parser.add_argument("--list", action="store_true", help="print the matrix's cells and exit")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--max-batch-size", type=int, default=256, help="primerl's inference.max_batch_size")
    parser.add_argument("--tokenizer-dir", type=Path, help="tokenizer (and generation config) of the random models")
    parser.add_argument("--model-dir", type=Path, help="a model directory instead of the random one")
    parser.add_argument("--trl-script", type=Path, help="the peer harness trl_grpo.py")
    parser.add_argument("--trl-python", type=Path, help="the peer's interpreter")
    parser.add_argument("--trl-pythonpath", help="PYTHONPATH for the peer (TRL, and vLLM for trl-vllm)")
    parser.add_argument("--trl-vllm-memory", type=float, default=0.3, help="trl-vllm: vLLM's share of the GPU")
    parser.add_argument("--trl-vllm-sleep", action="store_true", help="trl-vllm: vLLM's sleep mode")
    parser.add_argument("--primerl-micro-batch-tokens", type=int, default=8192, help="primerl's tokens per forward "
                        "and backward (packed rows of seq_len; about TRL's 16 rows of a 512-token cell; 0: the "
                        "trainer's auto, 16,384 on a GPU, which beside a 256-row engine does not fit Qwen3-0.6B on 80 GB)")
    parser.add_argument("--trl-micro-batch", type=int, default=16, help="TRL's rows per forward and backward (gradient "
                        "accumulation over the step's rollouts; 0: all in one, which does not fit the real sizes)")
    parser.add_argument("--side-timeout-s", type=float, default=500.0, help="limit of each side's run")
    parser.add_argument("--primerl-set", action="append", default=[], type=primerl_override, metavar="KEY=VALUE",
                        help="one more of rl's settings for primerl's sides (repeatable): such a run is a variant, "
                        "kept under the cell's `variants` with its settings, and leaves its side and the ratios "
                        "as they were")
    parser.add_argument("--work-dir", type=Path, default=HERE.parent / "runs" / "p1-gpu-matrix")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "p1_gpu_matrix.json")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(cells()))
        return 0
    if args.smoke:
        args.cell, chosen = "tiny/4/1x2", ["primerl-embedded"]
    else:
        if not args.cell:
            parser.error("--cell is needed (--list prints them)")
        chosen = [s.strip() for s in args.sides.split(",") if s.strip()]
        if unknown := sorted(set(chosen) - set(SIDES)):
            parser.error(f"unknown side(s) {', '.join(unknown)}; choose among {', '.join(SIDES)}")
        if args.trl_script is None:
            parser.error("--trl-script is needed (the peer harness; its system prompt is both sides')")
        if args.model_dir is None and args.tokenizer_dir is None:
            parser.error("--tokenizer-dir is needed for a random model (or --model-dir)")
    arch, tokens, prompts, group = parse_cell(args.cell)
    if not args.smoke and args.model_dir is None and arch not in ARCHS:
        parser.error(f"unknown architecture {arch!r}; choose among {', '.join(ARCHS)}")
    sys.path.insert(0, str(HERE))
    work = args.work_dir.resolve() / args.cell.replace("/", "_")
    work.mkdir(parents=True, exist_ok=True)
    args.work_dir = work
    if args.smoke:
        from primerl.models import resolve_model

        model_dir = resolve_model("tiny")
    else:
        model_dir = args.model_dir or random_model(arch, args.tokenizer_dir, args.work_dir.parent / f"model-{arch}")
    e2e = e2e_args(args, tokens, prompts, group, model_dir)
    matrix = json.loads(args.out.read_text()) if args.out.is_file() else {}
    matrix.setdefault("benchmark", "P1-GPU matrix: primerl (embedded, vLLM) vs TRL GRPOTrainer (vLLM colocate, "
                      "generate)")
    entry = matrix.setdefault("cells", {}).setdefault(args.cell, {"sides": {}})
    entry["settings"] = {"arch": arch, "model": "tiny (the registry's)" if args.smoke else
                         str(args.model_dir or f"{arch} (random init)"),
                         "tokenizer": str(args.tokenizer_dir) if args.tokenizer_dir else None, "new_tokens": tokens,
                         "prompts_per_step": prompts, "rollouts_per_prompt": group, "steps": e2e.steps, "lr": e2e.lr,
                         "precision": "bfloat16" if e2e.bf16 else "float32", "primerl_weight_transfer":
                         e2e.weight_transfer, "primerl_max_batch_size": e2e.max_batch_size,
                         "primerl_micro_batch_rows": e2e.micro_batch_rows, "seq_len": e2e.seq_len,
                         "trl_micro_batch": e2e.trl_micro_batch}
    device = card()
    for side in SIDES:
        if side not in chosen:
            if args.smoke:
                not_run(matrix, f"{args.cell}.{side}", SMOKE_SKIPS[side])
            continue
        print(f"=== {args.cell} {side}", file=sys.stderr, flush=True)
        run = run_side(side, e2e, model_dir, work)
        measured = {**figures(side, run, tokens, prompts * group, e2e.steps), "card": device,
                    "commit": commit()["sha"], "measured_at": round(time.time())}
        if args.primerl_set and side.startswith("primerl-"):  # an A/B against the side as configured
            entry.setdefault("variants", []).append({"side": side, "primerl_overrides": args.primerl_set, **measured})
        else:
            entry["sides"][side] = keep_fastest_trl_vllm(entry, measured) if side == "trl-vllm" else measured
            for key in [k for k in entry if "_ratio_vs_" in k]:  # a side run again may have failed this time
                del entry[key]
            entry.update(ratios(entry["sides"]))
        emit(matrix, args.out, smoke=args.smoke, echo=False)  # each side kept as soon as it is measured
    emit(matrix, args.out, smoke=args.smoke)
    return 1 if any("error" in entry["sides"].get(s, {}) for s in chosen) else 0


if __name__ == "__main__":
    sys.exit(main())
