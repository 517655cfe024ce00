"""The CPU server's memory over many batches, without an RL run: the embedded engine driven with the demo's pattern.

Loads the engine in this process as `primerl inference` does on the CPU (`keep_freed_memory` first), then runs
`--batches` batches of the reverse-text demo's shape: `--prompts` distinct prompts of random lengths in
[`--min-prompt`, `--max-prompt`] tokens x `--group` completions each, up to `--max-tokens` new tokens at temperature
1 (each a random length from `--min-tokens`, as if it stopped there), and a new weight version (every parameter copied in place from a perturbed copy, as a shared-memory version is)
every `--update-every` batches, applied while the batch decodes (every `--file-every` batches read from a
safetensors file instead, as the server reads a checkpoint's version). Every `--sample-every` batches it records the process's memory
(/proc/self/smaps_rollup: RSS, PSS, USS, anonymous), glibc's heap (bytes in use, bytes free: `mallinfo2`) and the
number of distinct input shapes the decoder's packed matmuls and attention products have met, then fits a line over
the batches after the warm-up (`--warm-up`, a fraction) and reports MB per 100 batches for each. Heap fragmentation
shows as free bytes growing, live growth as bytes in use growing, kernel caches as shapes growing with memory.
It also times the server's heap trim after each version (`trim`: calls, how many fired, ms each) and counts the
process's minor page faults and CPU seconds per batch after the warm-up, which is what a trim costs later: the pages it
handed back are faulted in again when the engine reuses them. `--trim-above-mb`/`--trim-growth-mb` replace the
server's thresholds (`hf.SERVER_TRIM_ABOVE_BYTES`, `SERVER_TRIM_GROWTH_BYTES`; `none`: no growth condition).

    uv run python benchmarks/server_creep.py --batches 300 --out <file>
    uv run python benchmarks/server_creep.py --smoke      # the tiny model, a few batches
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

from procs import median_slope, slope  # benchmarks/procs.py
from report import add_smoke_flag, emit  # benchmarks/report.py


def smaps_rollup(pid: int | str = "self") -> dict[str, float]:
    """MB of a process's RSS, PSS, USS (private clean + dirty) and anonymous memory."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        fields[key] = int(value.split()[0])
    kb = 1024
    return {
        "rss_mb": fields["Rss"] / kb, "pss_mb": fields["Pss"] / kb,
        "uss_mb": (fields["Private_Clean"] + fields["Private_Dirty"]) / kb, "anon_mb": fields["Anonymous"] / kb,
    }


class ShapeLog:
    """Records the input shapes of the decoder's packed matmuls (`llama._linear`) and of `torch.matmul` (the decode
    attention's products) by wrapping them."""

    def __init__(self) -> None:
        self.linear: set[tuple] = set()
        self.matmul: set[tuple] = set()

    def install(self) -> None:
        import torch

        from primerl.inference.engines import llama, llama_ops

        original_pointwise = torch.ops.mkldnn._linear_pointwise
        linear_log, matmul_log = self.linear, self.matmul

        class Pointwise:  # what `_linear` calls: the shape oneDNN sees
            def __call__(self, x, w, *args):
                linear_log.add((tuple(x.shape), tuple(w.shape)))
                return original_pointwise(x, w, *args)

        class Ops:
            def __getattr__(self, name):
                return Pointwise() if name == "_linear_pointwise" else getattr(torch.ops.mkldnn, name)

        class TorchOps:
            mkldnn = Ops()

            def __getattr__(self, name):
                return getattr(torch.ops, name)

        original_matmul = torch.matmul

        def matmul(a, b, *args, **kwargs):
            matmul_log.add((tuple(a.shape), tuple(b.shape)))
            return original_matmul(a, b, *args, **kwargs)

        class TorchProxy:  # llama_ops' own `torch`, with the two calls recorded
            ops = TorchOps()

            def __getattr__(self, name):
                return matmul if name == "matmul" else getattr(torch, name)

        llama_ops.torch = TorchProxy()
        del llama  # llama's `_linear` is llama_ops' function, which reads llama_ops' globals


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from primerl.cpu import heap_bytes, keep_freed_memory
    from primerl.inference.engines import hf
    from primerl.inference.engines.base import SamplingParams
    from primerl.inference.engines.hf import HFEngine
    from primerl.models import resolve_model

    kept = keep_freed_memory() if not args.no_keep else False
    if args.trim_above_mb is not None:
        hf.SERVER_TRIM_ABOVE_BYTES = int(args.trim_above_mb * 2**20)
    if args.trim_growth_mb is not None:
        hf.SERVER_TRIM_GROWTH_BYTES = None if args.trim_growth_mb == "none" else int(float(args.trim_growth_mb) * 2**20)
    trims: list[tuple[int, float, int]] = []  # (batch, seconds, bytes free when it fired or 0)
    trim = hf.trim_freed_memory
    batch = 0

    def timed_trim(*args_: Any) -> int:  # the engine's own call, timed
        started_ = time.perf_counter()
        freed = trim(*args_)
        trims.append((batch, time.perf_counter() - started_, freed))
        return freed

    hf.trim_freed_memory = timed_trim
    if args.repack_beside_old:  # the decoder before the fix: every old packing lives until all new ones are made
        from primerl.inference.engines.llama import LlamaDecoder

        weights_changed = LlamaDecoder.weights_changed

        def beside_old(self) -> None:
            old = [p.packed for p in (self.lm_head, *(p for layer in self.projections for p in layer.values()))]
            weights_changed(self)
            del old

        LlamaDecoder.weights_changed = beside_old
    engine = HFEngine(resolve_model(args.model), device="cpu", max_batch_size=args.max_batch_size,
                      max_model_len=args.max_model_len, threads=args.threads, seed=0)
    await engine.start()
    shapes = ShapeLog()
    if args.shapes:
        shapes.install()
    params = dict(engine.model.named_parameters())
    versions = [{n: (p + torch.randn_like(p) * 1e-4 * sign).contiguous() for n, p in params.items()}
                for sign in (1.0, -1.0)]
    snapshot = None
    if args.file_every:
        import tempfile

        from safetensors.torch import save_file

        snapshot = Path(tempfile.mkdtemp(prefix="server-creep-")) / "model.safetensors"
        save_file(versions[0], str(snapshot))
    rng = random.Random(args.seed)
    vocab = min(engine.vocab_size, 20000)
    samples: list[dict[str, Any]] = []
    tokens_out = 0
    started = time.monotonic()

    async def complete(prompt: list[int], request_id: str, max_tokens: int) -> int:
        n = 0
        params_ = SamplingParams(max_tokens=max_tokens, temperature=1.0)
        async for _event in engine.generate(prompt, params_, request_id):
            n += 1
        return n

    for batch in range(args.batches + 1):
        if batch % args.sample_every == 0:
            heap = heap_bytes() or (0, 0)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            samples.append({
                "batch": batch, "s": round(time.monotonic() - started, 1), **smaps_rollup(),
                "heap_in_use_mb": heap[0] / 2**20, "heap_free_mb": heap[1] / 2**20,
                "linear_shapes": len(shapes.linear), "matmul_shapes": len(shapes.matmul),
                "minflt": usage.ru_minflt, "user_s": round(usage.ru_utime, 2), "sys_s": round(usage.ru_stime, 2),
            })
            print(samples[-1], file=sys.stderr, flush=True)
        if batch == args.batches:
            break
        prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
                   for _ in range(args.prompts)]
        # random lengths stand for completions that stop early: rows finish at different steps, as in RL
        tasks = [asyncio.ensure_future(complete(p, f"{batch}-{i}-{j}", rng.randint(args.min_tokens, args.max_tokens)))
                 for i, p in enumerate(prompts) for j in range(args.group)]
        if batch % args.update_every == 0:  # a new version arrives while the batch decodes, as with async RL
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if args.file_every and batch % args.file_every == 0:  # a checkpoint's version: read from its file
                await engine.update_weights(snapshot, batch)
            else:
                await engine.load_named_tensors(versions[batch // args.update_every % 2], batch, "perturbed copy")
        tokens_out += sum(await asyncio.gather(*tasks))
    await engine.stop()

    keys = ("pss_mb", "uss_mb", "anon_mb", "heap_in_use_mb", "heap_free_mb", "linear_shapes", "matmul_shapes")
    return summarize(args, samples, keys, {"keep_freed_memory": kept, "tokens_out": tokens_out,
                                           "wall_s": round(time.monotonic() - started, 1),
                                           "trim": trim_summary(args, trims, samples)})


def trim_summary(args: argparse.Namespace, trims: list[tuple[int, float, int]],
                 samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's trims after the warm-up (calls, fired, ms each) and, per batch over the same batches, the minor
    page faults and CPU seconds (user, system) of the whole process."""
    start = args.warm_up * args.batches
    late = [t for t in trims if t[0] >= start]
    fired = sorted(s for _, s, freed in late if freed)
    idle = sorted(s for _, s, freed in late if not freed)
    after = [s for s in samples if s["batch"] >= start]
    per_batch = {}
    if len(after) > 1:
        batches = after[-1]["batch"] - after[0]["batch"]
        for key in ("minflt", "user_s", "sys_s", "s"):
            per_batch[key] = round((after[-1][key] - after[0][key]) / batches, 4)

    def ms(values: list[float]) -> dict[str, float] | None:
        return {"median_ms": round(values[len(values) // 2] * 1e3, 2), "mean_ms": round(sum(values) / len(values)
                * 1e3, 2), "max_ms": round(values[-1] * 1e3, 2)} if values else None

    return {"calls": len(late), "fired": len(fired), "fired_ms": ms(fired), "not_fired_ms": ms(idle),
            "free_mb_when_fired": [round(freed / 2**20, 1) for _, _, freed in late if freed][:5],
            "per_batch_after_warm_up": per_batch}

async def run_http(args: argparse.Namespace) -> dict[str, Any]:
    """The real `primerl inference` process (the demo's settings: one thread, 16 rows, 512 positions), sent the
    demo's requests on the token route (`n = 1` each), its memory sampled from /proc. No weight updates."""
    import os
    import signal
    import subprocess
    import tempfile

    import httpx

    work = Path(tempfile.mkdtemp(prefix="server-creep-"))
    log_path = work / "inference.log"
    command = [sys.executable, "-m", "primerl.cli", "inference", "--model.name", args.model, "--port", "0",
               "--max-batch-size", str(args.max_batch_size), "--max-model-len", str(args.max_model_len),
               "--threads", str(args.threads or 1), "--admin-token-file", str(work / "token")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMERL_")}
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)  # noqa: ASYNC220
    rng = random.Random(args.seed)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        base = None
        while base is None:
            if server.poll() is not None:
                raise SystemExit(f"server exited:\n{log_path.read_text()}")
            found = [line for line in log_path.read_text().splitlines() if "listening on" in line]
            if found:
                base = "http://" + found[0].rsplit("listening on ", 1)[1].strip()
            await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            while True:
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)

            async def one(prompt: list[int]) -> None:
                body = {"model": args.model, "token_ids": prompt, "sampling_params": {
                    "max_tokens": rng.randint(args.min_tokens, args.max_tokens), "temperature": 1.0, "logprobs": 0}}
                (await client.post("/inference/v1/generate", json=body)).raise_for_status()

            for batch in range(args.batches + 1):
                if batch % args.sample_every == 0:
                    samples.append({"batch": batch, "s": round(time.monotonic() - started, 1),
                                    **smaps_rollup(server.pid)})
                    print(samples[-1], file=sys.stderr, flush=True)
                if batch == args.batches:
                    break
                prompts = [[rng.randrange(1, 20000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
                           for _ in range(args.prompts)]
                await asyncio.gather(*(one(p) for p in prompts for _ in range(args.group)))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    return summarize(args, samples, ("pss_mb", "uss_mb", "anon_mb"), {"wall_s": round(time.monotonic() - started, 1)})


def summarize(args: argparse.Namespace, samples: list[dict[str, Any]], keys: tuple[str, ...],
              extra: dict[str, Any]) -> dict[str, Any]:
    after = [s for s in samples if s["batch"] >= args.warm_up * args.batches]
    xs = [s["batch"] for s in after]
    growth = {}
    for key in keys:
        ys = [s[key] for s in after]
        fit, median = slope(xs, ys), median_slope(xs, ys)
        growth[key] = {"per_100_batches": None if fit is None else round(fit * 100, 3),
                       "per_100_batches_median": None if median is None else round(median * 100, 3)}
    return {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
            **extra, "growth_after_warm_up": growth, "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=40)
    parser.add_argument("--max-prompt", type=int, default=120)
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--update-every", type=int, default=1)
    parser.add_argument("--file-every", type=int, default=0,
                        help="every this many batches the version is read from a safetensors file, as at a checkpoint")
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--warm-up", type=float, default=0.34)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repack-beside-old", action="store_true",
                        help="re-pack each version while the old packings live, as the decoder did before")
    parser.add_argument("--no-keep", action="store_true", help="leave glibc's malloc settings as they are")
    parser.add_argument("--trim-above-mb", type=float, help="the server's trim floor instead of its own")
    parser.add_argument("--trim-growth-mb", help="the server's trim growth step instead of its own (none: no step)")
    parser.add_argument("--no-shapes", dest="shapes", action="store_false", help="do not record the shapes")
    parser.add_argument("--http", action="store_true", help="drive the real server process over HTTP instead")
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.trim_growth_mb not in (None, "none"):
        try:
            float(args.trim_growth_mb)
        except ValueError:
            parser.error(f"--trim-growth-mb takes MB or none, got {args.trim_growth_mb!r}")
    if args.smoke:
        args.model, args.batches, args.sample_every, args.min_tokens, args.max_tokens = "tiny", 6, 2, 2, 8
    result = asyncio.run(run_http(args) if args.http else run(args))
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
