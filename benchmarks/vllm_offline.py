"""vLLM at vLLM's own speed? One batch through vLLM's offline `LLM.generate` and through primerl, side by side.

The same batch (B prompts of 32 random token ids, N new tokens each, temperature 1, eos ignored) on the same weights
(Qwen3-0.6B's architecture with random weights, or `--model-dir`), bfloat16, at each batch size of `--batches`,
through each side, each side in its own process with a time limit (`--side-timeout-s`):

- `vllm-offline`: vLLM's own `LLM.generate`, built from the very engine arguments primerl's adapter passes
  (`VLLMEngine.engine_args`) and the same sampling parameters (the sampled token's log-prob asked); `plain_tok_s`
  is the same batch without log-probs;
- `adapter`: primerl's vLLM adapter (`VLLMEngine`) called in this process, no HTTP; `--profile` adds one more run
  under cProfile (its top functions by own time; the timed runs are not profiled; cProfile inflates functions
  called often and briefly, so `--py-spy` is the one to read for shares of time);
- `adapter-detokenize`: the same with `vllm.detokenize` on (vLLM decodes each reply's text as it streams, as the
  adapter always did before the option; `adapter_over_adapter_detokenize` is what turning it off gained);
- `server-vllm` / `server-embedded`: `primerl inference` with the vLLM or the embedded engine, the batch sent at once
  through the token route (`/inference/v1/generate`, as the orchestrator sends it), with the server's CPU seconds
  (its own process, and its descendants: vLLM's engine core) over the timed runs;
- `embedded`: the embedded engine called in this process (the in-process counterpart of `server-embedded`);
- `adapter-each-token` / `server-vllm-each-token`: `adapter` / `server-vllm` with vLLM handing over every token as it
  is sampled (`vllm.stream_interval = 1`, as before that option; the ratios `adapter_over_adapter_each_token` and
  `server_vllm_over_server_vllm_each_token` are what the interval gained).

Each side warms up once per batch size, then `--repeats` timed runs (default 5); `tok_s` is their median, with the
best (`best_tok_s`) and every run's: one batch of 64 x 128 tokens lasts well under a second, and two runs of the same
side have differed by 40 %. `--py-spy BIN` records each side (the server's process for the server sides, the side's
own process for the others) through one more batch of the largest size.
Ratios per batch size: `adapter_over_vllm_offline`, `server_vllm_over_vllm_offline`, `server_vllm_over_embedded`
(the two servers), `server_vllm_over_adapter` and `server_embedded_over_embedded` (what HTTP and the server add).

    python3 benchmarks/vllm_offline.py --out OUT.json                 # GPU, every side, batches 64 and 256
    python3 benchmarks/vllm_offline.py --sides adapter --profile ...   # one side (merged into an existing --out)
    uv run python benchmarks/vllm_offline.py --smoke                  # CPU, tiny model: the embedded sides only

`--smoke` runs the embedded-engine sides on the CPU (random tiny Llama, float32, batches 2 and 4, 4 tokens, the
in-process one also under cProfile); the vLLM sides are skipped, each with its reason, under "not_run" and as
{"skipped": reason} (never as a figure).
An `--out` that holds a result of the same settings keeps the sides this run did not measure (each side names its
device), so a GPU call that runs out of time can be finished by the next.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import add_smoke_flag, emit, not_run  # benchmarks/report.py
from sides import cpu_delta, cpu_snapshot, inference_server, profile_top, pyspy_top, run_side, token_route_batch

HERE = Path(__file__).resolve().parent
SIDES = ("vllm-offline", "adapter", "server-vllm", "server-embedded", "embedded", "adapter-detokenize",
         "adapter-each-token", "server-vllm-each-token")
VLLM_SIDES = ("vllm-offline", "adapter", "server-vllm", "adapter-detokenize", "adapter-each-token",
              "server-vllm-each-token")
RATIOS = {"adapter_over_vllm_offline": ("adapter", "vllm-offline"),
          "adapter_over_adapter_detokenize": ("adapter", "adapter-detokenize"),
          "server_vllm_over_vllm_offline": ("server-vllm", "vllm-offline"),
          "server_vllm_over_embedded": ("server-vllm", "server-embedded"),
          "server_vllm_over_adapter": ("server-vllm", "adapter"),
          "server_embedded_over_embedded": ("server-embedded", "embedded"),
          "adapter_over_adapter_each_token": ("adapter", "adapter-each-token"),
          "server_vllm_over_server_vllm_each_token": ("server-vllm", "server-vllm-each-token")}


def settings(args: argparse.Namespace) -> dict:
    return {"model": str(args.model_dir) if args.model_dir else f"{args.arch} (random init)",
            "dtype": "float32" if args.smoke else "bfloat16", "prompt_tokens": 32, "new_tokens": args.new_tokens,
            "batches": args.batches, "repeats": args.repeats, "temperature": 1.0, "ignore_eos": True,
            "gpu_memory_utilization": args.gpu_memory_utilization}


def max_model_len(args: argparse.Namespace) -> int:
    return max(1024, 32 + args.new_tokens + 8)


def adapter_engine(model_dir: Path, args: argparse.Namespace, detokenize: bool = False, each_token: bool = False):
    """primerl's vLLM adapter as the server builds it (not started); `detokenize`: vLLM decodes every reply's text
    too, as the adapter did before `vllm.detokenize` (side `adapter-detokenize`); `each_token`: vLLM hands over
    every token as it is sampled (`vllm.stream_interval = 1`, as before the option; side `adapter-each-token`)."""
    from primerl.config.common import ModelConfig
    from primerl.config.inference import VLLMSection
    from primerl.inference.engines.vllm import VLLMEngine

    return VLLMEngine(ModelConfig(name=str(model_dir), dtype="bfloat16"), "bench", max_model_len=max_model_len(args),
                      max_batch_size=max(args.batches), options=VLLMSection(
                          gpu_memory_utilization=args.gpu_memory_utilization, detokenize=detokenize,
                          **({"stream_interval": 1} if each_token else {})))


def timed(args: argparse.Namespace, batch: int, run, pid: int | None = None) -> dict:
    """Warm-up, then `--repeats` timed runs of `run(prompts) -> seconds`; CPU seconds of `pid` (default: this
    process) and its descendants over the timed runs."""
    from engine import make_prompts  # benchmarks/engine.py

    prompts = make_prompts(batch, args.vocab_size)
    run(prompts)  # warm-up: graphs, compilation, allocator
    pid = pid or os.getpid()
    before, runs = cpu_snapshot(pid), []
    for _ in range(args.repeats):
        seconds = run(prompts)
        runs.append(batch * args.new_tokens / seconds)
    out = {"tok_s": round(statistics.median(runs), 1), "best_tok_s": round(max(runs), 1),
           "runs_tok_s": [round(r, 1) for r in runs],
           "cpu_s": cpu_delta(before, cpu_snapshot(pid))}
    print(f"batch {batch}: {out['runs_tok_s']} tok/s", file=sys.stderr, flush=True)
    return out


def offline_side(args: argparse.Namespace, model_dir: Path) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    started = time.perf_counter()
    llm = LLM(**adapter_engine(model_dir, args).engine_args(model_dir))
    start_s = time.perf_counter() - started
    same = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.new_tokens, ignore_eos=True,
                          logprobs=0, detokenize=False)  # what the adapter asks for each request (no stop strings)
    text = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.new_tokens, ignore_eos=True,
                          logprobs=0)  # the same with vLLM's default: each reply's text decoded as well
    plain = SamplingParams(n=1, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)

    def run_with(params):
        def run(prompts: list[list[int]]) -> float:
            t0 = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            if any(len(o.outputs[0].token_ids) != args.new_tokens for o in outputs):
                raise RuntimeError("vLLM returned a reply shorter than asked")
            return seconds
        return run

    batches = {}
    for batch in args.batches:
        batches[str(batch)] = timed(args, batch, run_with(same))
        batches[str(batch)]["detokenize_tok_s"] = timed(args, batch, run_with(text))["tok_s"]
        batches[str(batch)]["plain_tok_s"] = timed(args, batch, run_with(plain))["tok_s"]
    result = {"start_s": round(start_s, 1), "batches": batches,
              "sampling": "logprobs=0, detokenize off (as the adapter); detokenize_tok_s: the same with vLLM's text "
                          "decoding (its default); plain_tok_s: vLLM's defaults, no logprobs"}
    if args.py_spy:
        result["py_spy"] = side_pyspy(args, os.getpid(), run_with(same))
    return result


def engine_side(args: argparse.Namespace, model_dir: Path, kind: str) -> dict:
    """The adapter (`kind` "vllm", or "vllm-detokenize" with vLLM's text decoding on) or the embedded engine ("hf")
    in this process, no HTTP."""
    from engine import engine_run  # benchmarks/engine.py

    if kind.startswith("vllm"):
        engine = adapter_engine(model_dir, args, detokenize=kind == "vllm-detokenize",
                                each_token=kind == "vllm-each-token")
    else:
        from primerl.inference.engines.hf import HFEngine

        engine = HFEngine(model_dir, device=args.device, dtype="float32" if args.smoke else "bfloat16",
                          max_batch_size=max(args.batches), max_model_len=max_model_len(args))
    loop = asyncio.new_event_loop()
    started = time.perf_counter()
    loop.run_until_complete(engine.start())
    result: dict = {"start_s": round(time.perf_counter() - started, 1), "batches": {}}
    counter = iter(range(10**6))

    def run(prompts: list[list[int]]) -> float:
        return loop.run_until_complete(engine_run(engine, prompts, args.new_tokens, f"r{next(counter)}", seed=None))

    try:
        for batch in args.batches:
            result["batches"][str(batch)] = timed(args, batch, run)
        if args.profile:
            from engine import make_prompts

            batch = max(args.batches)
            profile = cProfile.Profile()
            profile.enable()
            seconds = run(make_prompts(batch, args.vocab_size))
            profile.disable()
            result["profile"] = {"batch": batch, "tok_s_under_profile": round(batch * args.new_tokens / seconds, 1),
                                 "top_by_own_time": profile_top(profile)}
        if args.py_spy:
            result["py_spy"] = side_pyspy(args, os.getpid(), run)
    finally:
        loop.run_until_complete(engine.stop())
        loop.close()
    return result


def server_side(args: argparse.Namespace, model_dir: Path, kind: str, each_token: bool = False) -> dict:
    """`primerl inference --engine kind`, the batch through its token route; the server's CPU seconds. `each_token`:
    vLLM hands over every token as it is sampled (`--vllm.stream_interval 1`)."""
    flags = ["--engine", kind, "--max-batch-size", str(max(args.batches)), "--max-model-len", str(max_model_len(args))]
    if kind == "vllm":
        flags += ["--vllm.gpu_memory_utilization", str(args.gpu_memory_utilization)]
        flags += ["--vllm.stream_interval", "1"] if each_token else []
    elif args.smoke:
        flags += ["--device", "cpu", "--model.dtype", "float32", "--threads", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "inference.log"
        started = time.perf_counter()
        with inference_server(model_dir, log, *flags) as (base_url, pid):
            result: dict = {"start_s": round(time.perf_counter() - started, 1), "batches": {}}
            loop = asyncio.new_event_loop()

            def run(prompts: list[list[int]]) -> float:
                return loop.run_until_complete(token_route_batch(base_url, prompts, args.new_tokens))

            try:
                for batch in args.batches:
                    result["batches"][str(batch)] = timed(args, batch, run, pid=pid)
                if args.py_spy:
                    result["py_spy"] = side_pyspy(args, pid, run)
            finally:
                loop.close()
        result["server_log_tail"] = log.read_text()[-800:]
    return result


def side_pyspy(args: argparse.Namespace, pid: int, run) -> dict:
    """py-spy (every thread, 200 samples/s, the process not stopped) on process `pid` (the server, or this side's
    own process) through one more batch of the largest size; its frames summarized by sides.pyspy_top."""
    with tempfile.TemporaryDirectory() as tmp:
        return _pyspy_batch(args, pid, Path(tmp) / "py-spy.txt", run)


def _pyspy_batch(args: argparse.Namespace, pid: int, raw: Path, run) -> dict:
    from engine import make_prompts  # benchmarks/engine.py

    batch = max(args.batches)
    prompts = make_prompts(batch, args.vocab_size)
    spy = subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-r", "200", "-f", "raw", "--threads",
                            "--nonblocking", "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    time.sleep(1.0)  # py-spy attached before the batch starts
    seconds = run(prompts)
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        _, err = spy.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        spy.kill()
        _, err = spy.communicate()
    if not raw.is_file():
        return {"error": f"py-spy wrote nothing (exit {spy.returncode}): {err[-400:]}"}
    return {"batch": batch, "tok_s_under_py_spy": round(batch * args.new_tokens / seconds, 1),
            **pyspy_top(raw.read_text())}


def side_main(args: argparse.Namespace) -> int:
    """One side, in this process: its result as one JSON line on stdout."""
    sys.path.insert(0, str(HERE))
    import torch

    args.vocab_size = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    args.device = "cpu" if args.smoke else "cuda"
    if args.side == "vllm-offline":
        result = offline_side(args, args.model_dir)
    elif args.side in ("adapter", "adapter-detokenize", "adapter-each-token", "embedded"):
        result = engine_side(args, args.model_dir, {"adapter": "vllm", "adapter-detokenize": "vllm-detokenize",
                                                    "adapter-each-token": "vllm-each-token",
                                                    "embedded": "hf"}[args.side])
    else:
        result = server_side(args, args.model_dir, "hf" if args.side == "server-embedded" else "vllm",
                             each_token=args.side == "server-vllm-each-token")
    result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if args.side in VLLM_SIDES:
        import vllm

        result["vllm"] = vllm.__version__
    print(json.dumps(result), flush=True)
    return 0


def ratios(sides: dict, batches: list[int]) -> dict:
    """Per batch size, each ratio whose two sides were measured on the same device."""
    out: dict = {}
    for batch in map(str, batches):
        for name, (a, b) in RATIOS.items():
            x, y = sides.get(a, {}), sides.get(b, {})
            if x.get("device") and x.get("device") == y.get("device") and batch in x.get("batches", {}) \
                    and batch in y.get("batches", {}):
                out.setdefault(batch, {})[name] = round(x["batches"][batch]["tok_s"] / y["batches"][batch]["tok_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="the model to serve (default: --arch with random weights)")
    parser.add_argument("--arch", default="qwen3-0.6b", help="benchmarks/engine.py's architecture for random init")
    parser.add_argument("--batches", default="64,256", help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per batch size (after one warm-up); "
                        "tok_s is their median")
    parser.add_argument("--sides", default=",".join(SIDES[:4]), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--side-timeout-s", type=float, default=150.0, help="limit of each side's process")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share, every vLLM side")
    parser.add_argument("--profile", action="store_true", help="cProfile one more adapter (and embedded) run")
    parser.add_argument("--py-spy", help="py-spy's executable: record each side (a server side's server) through "
                        "one more batch of the largest size")
    parser.add_argument("--work-dir", type=Path, help="where the random model is made (default: a temporary one)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in this process
    parser.add_argument("--out", type=Path, help="also write the JSON here (keeping other sides of the same settings)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.arch, args.new_tokens, args.repeats, args.profile = "tiny", 4, 1, True
        args.batches = "2,4" if args.batches == "64,256" else args.batches
        args.sides = "server-embedded,embedded," + ",".join(VLLM_SIDES)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.side:
        return side_main(args)
    chosen = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := sorted(set(chosen) - set(SIDES)):
        parser.error(f"unknown side(s) {', '.join(unknown)}; choose among {', '.join(SIDES)}")
    result: dict = {"benchmark": "vllm_offline", "settings": settings(args), "sides": {}}
    if args.out and args.out.is_file():  # sides measured before with the same settings stay
        before = json.loads(args.out.read_text())
        if before.get("settings") == result["settings"]:
            result["sides"] = before.get("sides", {})
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        model_dir = args.model_dir or made_model(args, work / "model")
        for side in chosen:
            if side in VLLM_SIDES and (why := vllm_missing(args)):
                result["sides"][side] = {"skipped": why}
                not_run(result, f"sides.{side}", why)
                continue
            command = [sys.executable, __file__, "--side", side, "--model-dir", str(model_dir),
                       "--batches", ",".join(map(str, args.batches)), "--new-tokens", str(args.new_tokens),
                       "--repeats", str(args.repeats), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                       *(["--profile"] if args.profile else []), *(["--smoke"] if args.smoke else []),
                       *(["--py-spy", args.py_spy] if args.py_spy else [])]
            print(f"=== side {side}", file=sys.stderr, flush=True)
            result["sides"][side] = {**run_side(command, args.side_timeout_s), "measured_at": round(time.time())}
            result["ratios"] = ratios(result["sides"], args.batches)
            emit(result, args.out, smoke=args.smoke, echo=False)  # what is measured so far survives a kill
    result["ratios"] = ratios(result["sides"], args.batches)
    emit(result, args.out, smoke=args.smoke)
    failed = [s for s in chosen if "error" in result["sides"].get(s, {})]
    return 1 if failed else 0


def vllm_missing(args: argparse.Namespace) -> str | None:
    """Why the vLLM sides cannot run here, or None."""
    import importlib.util

    if args.smoke:
        return "a smoke run is CPU-only; vLLM needs a CUDA device" + (
            "" if importlib.util.find_spec("vllm") else " (and is not installed here: a GPU-only extra)")
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable (bring it with gpu_rl_x1.sh's vllm-part stage, PYTHONPATH=$VLLM_SITE)"
    return None


def made_model(args: argparse.Namespace, into: Path) -> Path:
    """`--arch` with random weights (fixed seed; benchmarks/engine.py), reused when already made there."""
    if (into / "config.json").is_file():
        return into
    sys.path.insert(0, str(HERE))
    import torch
    from engine import random_init_dir

    return random_init_dir(args.arch, torch.float32 if args.smoke else torch.bfloat16, into)


if __name__ == "__main__":
    sys.exit(main())
